//! Reading Prometheus text (`/metrics` of engines, mock workers, bridges and vllm-router) with
//! `prom_text_format_parser`, which takes vLLM's `vllm:` names (`prometheus-parse` drops every
//! name with a colon). The bridge reads its engine's load with it; tests and tools their scrapes.

use prom_text_format_parser::{Metric, Type, ValueType};

/// The metric families of one scrape. Families that do not parse (a sample that contradicts
/// its `# TYPE`) are left out; the rest of the scrape is still read.
#[derive(Debug, Clone, Default)]
pub struct Scrape {
    families: Vec<Metric>,
}

impl Scrape {
    pub fn parse(text: &str) -> Scrape {
        let (families, _errors) = prom_text_format_parser::parse_scrape(text);
        Scrape { families }
    }

    /// The samples named `name` (a histogram's or summary's `_bucket`, `_sum` and `_count`
    /// included) whose labels include every `(key, value)` of `labels`, with their values.
    fn samples<'s, 'q>(
        &'s self,
        name: &'q str,
        labels: &'q [(&'q str, &'q str)],
    ) -> impl Iterator<Item = (&'s prom_text_format_parser::Labels, f64)> + use<'s, 'q> {
        self.families
            .iter()
            .filter_map(move |f| {
                let want = if f.name == name {
                    ValueType::Sample
                } else {
                    let suffix = name.strip_prefix(f.name.as_str())?;
                    match (f.kind, suffix) {
                        (Type::Histogram, "_bucket") => ValueType::Sample,
                        (Type::Histogram | Type::Summary, "_sum") => ValueType::Sum,
                        (Type::Histogram | Type::Summary, "_count") => ValueType::Count,
                        _ => return None,
                    }
                };
                Some(f.samples.iter().filter(move |s| s.value.value_type == want))
            })
            .flatten()
            .filter(move |s| {
                labels
                    .iter()
                    .all(|(k, v)| s.labels.iter().any(|l| l.key == *k && l.value == *v))
            })
            .filter_map(|s| Some((&s.labels, s.value.value.parse::<f64>().ok()?)))
    }

    /// The values of every sample of `name`, whatever its labels.
    pub fn values<'s, 'q>(&'s self, name: &'q str) -> impl Iterator<Item = f64> + use<'s, 'q> {
        self.samples(name, &[]).map(|(_, v)| v)
    }

    /// The sum of the samples of `name` whose labels include `labels`; `None` when there is none.
    pub fn sum(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        self.samples(name, labels)
            .map(|(_, v)| v)
            .reduce(|a, b| a + b)
    }

    /// The value of label `key` on the first sample of `name` that has it.
    pub fn label<'s>(&'s self, name: &str, key: &str) -> Option<&'s str> {
        self.samples(name, &[]).find_map(|(labels, _)| {
            labels
                .iter()
                .find(|l| l.key == key)
                .map(|l| l.value.as_str())
        })
    }
}

/// [`Scrape::sum`] of one text.
pub fn sum(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    Scrape::parse(text).sum(name, labels)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_labels_and_colon_names() {
        let text = "# HELP x y\n\
            foo_total{worker_id=\"1\"} 3\n\
            foo_total{worker_id=\"2\"} 4.5\n\
            foo_total_other 9\n\
            foo 1\n\
            # HELP vllm:num_requests_waiting Waiting.\n\
            # TYPE vllm:num_requests_waiting gauge\n\
            vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 2.0\n\
            vllm:num_requests_waiting{engine=\"1\",model_name=\"m\"} 3.0\n\
            # TYPE vllm:ttft_seconds histogram\n\
            vllm:ttft_seconds_bucket{le=\"0.1\"} 1\n\
            vllm:ttft_seconds_bucket{le=\"+Inf\"} 4\n\
            vllm:ttft_seconds_count 4\n\
            vllm:ttft_seconds_sum 0.75\n\
            vllm:cache_config_info{block_size=\"32\",num_gpu_blocks=\"2048\"} 1.0\n";
        let s = Scrape::parse(text);
        assert_eq!(s.sum("foo_total", &[]), Some(7.5));
        assert_eq!(s.sum("foo_total", &[("worker_id", "2")]), Some(4.5));
        assert_eq!(s.sum("foo", &[]), Some(1.0));
        assert_eq!(s.sum("bar", &[]), None);
        assert_eq!(s.sum("vllm:num_requests_waiting", &[]), Some(5.0));
        assert_eq!(s.sum("vllm:ttft_seconds_count", &[]), Some(4.0));
        assert_eq!(s.sum("vllm:ttft_seconds_sum", &[]), Some(0.75));
        assert_eq!(
            s.sum("vllm:ttft_seconds_bucket", &[("le", "+Inf")]),
            Some(4.0)
        );
        assert_eq!(
            s.label("vllm:cache_config_info", "num_gpu_blocks"),
            Some("2048")
        );
        assert_eq!(s.label("vllm:cache_config_info", "cache_dtype"), None);
        assert_eq!(sum(text, "foo_total", &[("worker_id", "1")]), Some(3.0));
    }
}
