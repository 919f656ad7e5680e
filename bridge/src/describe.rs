//! The page's `worker` object: the worker's description of itself (see the filter's DESIGN,
//! "membership"). Flags (`--worker-*`) win; otherwise what the engine's metrics say
//! (`vllm:cache_config_info`: `block_size`, `num_gpu_blocks`). Nothing known: no object.

use kv_router_protocol::worker::{WorkerDescription, MAX_MODELS};

/// `block_size` and `num_gpu_blocks` (the KV capacity of one engine, in blocks) from vLLM's
/// `vllm:cache_config_info{block_size="16",num_gpu_blocks="3000",...} 1.0`.
pub fn learn_from_metrics(text: &str) -> WorkerDescription {
    let mut out = WorkerDescription::default();
    let Some(rest) = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("vllm:cache_config_info{"))
    else {
        return out;
    };
    let labels = labels(rest);
    let label = |key: &str| -> Option<u32> {
        labels
            .iter()
            .find(|(k, _)| k == key)
            .and_then(|(_, v)| v.parse().ok())
    };
    out.block_size = label("block_size");
    out.kv_capacity_blocks = label("num_gpu_blocks").filter(|&b| b > 0);
    out
}

/// `key="value"` pairs of a Prometheus label set, from just after its `{` to its `}`. Values
/// may hold commas, braces and escaped quotes (vLLM's info labels are `str()` of config fields).
fn labels(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut chars = text.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| *c == ',' || c.is_whitespace()) {
            chars.next();
        }
        let key: String = chars
            .by_ref()
            .take_while(|c| *c != '=' && *c != '}')
            .collect();
        if key.is_empty() || chars.next() != Some('"') {
            return out;
        }
        let mut value = String::new();
        loop {
            match chars.next() {
                None => return out,
                Some('\\') => {
                    if let Some(c) = chars.next() {
                        value.push(c);
                    }
                }
                Some('"') => break,
                Some(c) => value.push(c),
            }
        }
        out.push((key.trim().to_owned(), value));
    }
}

/// The model ids of an OpenAI `/v1/models` reply (`{"data": [{"id": "..."}]}`), at most
/// [`MAX_MODELS`] (the filter refuses more).
pub fn parse_models(body: &str) -> Result<Vec<String>, String> {
    let v: serde_json::Value = serde_json::from_str(body).map_err(|e| e.to_string())?;
    let data = v["data"].as_array().ok_or("no data array")?;
    let ids: Vec<String> = data
        .iter()
        .filter_map(|m| m["id"].as_str().map(str::to_owned))
        .take(MAX_MODELS)
        .collect();
    if ids.is_empty() {
        return Err("no model ids".to_owned());
    }
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_router_protocol::worker::splice;

    #[test]
    fn learns_from_vllm_cache_config_info_and_flags_win() {
        let text = "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
# TYPE vllm:cache_config_info gauge\n\
vllm:cache_config_info{block_size=\"16\",kv_offloading=\"{'a': 1, \\\"b\\\": 2}\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",num_cpu_blocks=\"None\",num_gpu_blocks=\"3055\"} 1.0\n\
vllm:num_requests_running{engine=\"0\"} 2.0\n";
        let learned = learn_from_metrics(text);
        assert_eq!(learned.block_size, Some(16));
        assert_eq!(learned.kv_capacity_blocks, Some(3055));
        let flags = WorkerDescription {
            kv_capacity_blocks: Some(100),
            models: Some(vec!["m".into()]),
            ..Default::default()
        };
        let d = flags.over(&learned);
        assert_eq!(
            d.to_json().unwrap(),
            r#"{"block_size":16,"kv_capacity_blocks":100,"models":["m"]}"#
        );
        assert_eq!(
            learn_from_metrics("vllm:num_requests_running 1\n"),
            WorkerDescription::default()
        );
        assert_eq!(WorkerDescription::default().to_json(), None);
        assert_eq!(
            splice("{\"a\":1}".into(), Some("{\"dp_size\":2}")),
            "{\"a\":1,\"worker\":{\"dp_size\":2}}"
        );
        assert_eq!(splice("{\"a\":1}".into(), None), "{\"a\":1}");
        assert_eq!(
            parse_models(r#"{"object":"list","data":[{"id":"Qwen/Qwen3-0.6B","object":"model"}]}"#),
            Ok(vec!["Qwen/Qwen3-0.6B".to_string()])
        );
        assert!(parse_models(r#"{"data":[]}"#).is_err());
    }
}
