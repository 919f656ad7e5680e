//! `calibrate`: measures an engine's prefill and decode timing and fits the polynomials the
//! filter's TTFT policy predicts with (`load.prefill_time_ms_poly`, `ttft.decode_step_ms_poly`).
//!
//! The filter's defaults are the Dynamo mocker's (an H100-class GPU); a fleet of other hardware
//! or another model needs its own. Against one idle engine:
//!
//! * **Prefill**: prompts of evenly spaced lengths up to `max_prompt_tokens`, one at a time, each
//!   of fresh random token ids (no prefix-cache hit), one output token; the TTFT's median per
//!   length is the prefill time of that many uncached tokens (the engine's request overhead lands
//!   in the constant term, as it does in the TTFT the filter predicts). Keep the prompts within
//!   the engine's `max_num_batched_tokens`: the filter applies the polynomial per engine step.
//! * **Decode**: `c` requests at once (c = 1, 2, 4, ... `max_concurrency`), each with a fresh
//!   `decode_prompt_tokens` prompt and `decode_output_tokens` outputs; the median gap between
//!   streamed tokens is the step time at the KV fill the `c` requests hold
//!   (`c * ceil((prompt + outputs / 2) / block_size) / capacity`, the filter's decode load over
//!   the worker's `kv_capacity_blocks`).
//!
//! Both fits are least squares with non-negative coefficients (a fitted time never falls as the
//! tokens or the fill grow, so the extrapolation beyond the measured range stays sane): prefill
//! of degree 2, decode of degree 1.

use std::fmt::Write as _;
use std::io;
use std::time::Duration;

use serde_json::{json, Value};

use crate::client;
use crate::loadgen::{run_workload, Arrival, RequestResult, RequestSpec, RunOptions, Workload};
use crate::util::{percentile, splitmix64};

/// What to measure.
#[derive(Debug, Clone)]
pub struct CalibrateOptions {
    pub model: String,
    /// Prompt ids are drawn from `4..vocab` (ids below 4 are often specials).
    pub vocab: u32,
    /// The longest prefill prompt; the lengths are `points` steps up to it.
    pub max_prompt_tokens: u32,
    pub points: u32,
    /// Requests per prefill length (the median is kept).
    pub repeats: u32,
    /// Decode: the most requests at once (0: no decode measurement).
    pub max_concurrency: u32,
    pub decode_prompt_tokens: u32,
    pub decode_output_tokens: u32,
    /// The engine's KV capacity in blocks and its block size; read from its `/metrics`
    /// (`vllm:cache_config_info`) when not given.
    pub kv_capacity_blocks: Option<u32>,
    pub block_size: Option<u32>,
    /// Merged into every request body (e.g. `{"ignore_eos": true}`).
    pub extra_body: Option<Value>,
    pub timeout: Duration,
    pub seed: u64,
}

impl Default for CalibrateOptions {
    fn default() -> Self {
        CalibrateOptions {
            model: "mock-model".to_string(),
            vocab: 32_000,
            max_prompt_tokens: 8192,
            points: 6,
            repeats: 3,
            max_concurrency: 8,
            decode_prompt_tokens: 1024,
            decode_output_tokens: 48,
            kv_capacity_blocks: None,
            block_size: None,
            extra_body: Some(json!({"ignore_eos": true})),
            timeout: Duration::from_secs(120),
            seed: 1,
        }
    }
}

/// One measured prefill length.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefillPoint {
    pub tokens: u32,
    /// Median TTFT over the repeats.
    pub ms: f64,
}

/// One measured decode concurrency.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodePoint {
    pub requests: u32,
    /// The KV fill the requests hold, a fraction of the capacity.
    pub kv_fill: f64,
    /// Median gap between streamed tokens.
    pub ms: f64,
}

/// The measurements and the fitted polynomials (lowest degree first).
#[derive(Debug, Clone, PartialEq)]
pub struct Calibration {
    pub prefill: Vec<PrefillPoint>,
    pub prefill_poly: Vec<f64>,
    pub decode: Vec<DecodePoint>,
    /// `None` when the decode was not measured.
    pub decode_poly: Option<Vec<f64>>,
}

impl Calibration {
    /// The filter configuration fragment: `{"load": {"prefill_time_ms_poly"}, "ttft":
    /// {"decode_step_ms_poly"}}` (without `ttft` when the decode was not measured).
    pub fn filter_json(&self) -> Value {
        let mut v = json!({"load": {"prefill_time_ms_poly": self.prefill_poly}});
        if let Some(d) = &self.decode_poly {
            v["ttft"] = json!({"decode_step_ms_poly": d});
        }
        v
    }

    /// The same for one worker's entry (`workers[]`, `membership.worker`): `{"prefill_time_ms_poly",
    /// "decode_step_ms_poly"}`, for a mixed fleet priced worker by worker.
    pub fn worker_json(&self) -> Value {
        let mut v = json!({"prefill_time_ms_poly": self.prefill_poly});
        if let Some(d) = &self.decode_poly {
            v["decode_step_ms_poly"] = json!(d);
        }
        v
    }

    /// The same as `kv-event-bridge` flags, so a discovered worker describes its own timing.
    pub fn bridge_flags(&self) -> String {
        let list = |p: &[f64]| p.iter().map(f64::to_string).collect::<Vec<_>>().join(",");
        let mut s = format!("--worker-prefill-time-ms-poly {}", list(&self.prefill_poly));
        if let Some(d) = &self.decode_poly {
            s.push_str(&format!(" --worker-decode-step-ms-poly {}", list(d)));
        }
        s
    }

    /// The measured points beside the fitted values, for people.
    pub fn report(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "prefill: tokens  measured_ms  fitted_ms");
        for p in &self.prefill {
            let fit = eval_poly(&self.prefill_poly, f64::from(p.tokens));
            let _ = writeln!(s, "  {:>13}  {:>11.1}  {:>9.1}", p.tokens, p.ms, fit);
        }
        if let Some(poly) = &self.decode_poly {
            let _ = writeln!(s, "decode step: requests  kv_fill  measured_ms  fitted_ms");
            for p in &self.decode {
                let fit = eval_poly(poly, p.kv_fill);
                let _ = writeln!(
                    s,
                    "  {:>20}  {:>7.3}  {:>11.2}  {:>9.2}",
                    p.requests, p.kv_fill, p.ms, fit
                );
            }
        }
        s
    }
}

/// `poly[0] + poly[1] x + poly[2] x^2 + ...`
pub fn eval_poly(poly: &[f64], x: f64) -> f64 {
    poly.iter().rev().fold(0.0, |acc, c| acc * x + c)
}

/// Least-squares polynomial of `degree` through `points` (x, y) with every coefficient `>= 0`,
/// lowest degree first; `None` without points or with non-finite ones.
///
/// Exact for these sizes: every subset of free coefficients (the rest held at 0) is solved by
/// ordinary least squares, and the best fit whose coefficients are all non-negative wins (the
/// constrained optimum is the unconstrained one on its set of non-zero coefficients).
pub fn fit_nonnegative(points: &[(f64, f64)], degree: usize) -> Option<Vec<f64>> {
    if points.is_empty()
        || degree > 4
        || points.iter().any(|(x, y)| !x.is_finite() || !y.is_finite())
    {
        return None;
    }
    // Scale x into [0, 1] for conditioning; coefficient i is divided by scale^i at the end.
    let scale = points.iter().map(|(x, _)| x.abs()).fold(0.0, f64::max);
    let scale = if scale > 0.0 { scale } else { 1.0 };
    let terms = degree + 1;
    let mut best: Option<(f64, Vec<f64>)> = None;
    for mask in 1u32..(1 << terms) {
        let free: Vec<usize> = (0..terms).filter(|i| mask & (1 << i) != 0).collect();
        let Some(solution) = least_squares(points, scale, &free) else {
            continue;
        };
        if solution.iter().any(|c| *c < 0.0) {
            continue;
        }
        let mut coefficients = vec![0.0; terms];
        for (&i, c) in free.iter().zip(&solution) {
            if let Some(slot) = coefficients.get_mut(i) {
                *slot = *c;
            }
        }
        let error: f64 = points
            .iter()
            .map(|(x, y)| (eval_poly(&coefficients, x / scale) - y).powi(2))
            .sum();
        if best.as_ref().is_none_or(|(e, _)| error < *e) {
            best = Some((error, coefficients));
        }
    }
    let (_, mut coefficients) = best?;
    for (i, c) in coefficients.iter_mut().enumerate() {
        *c /= scale.powi(i as i32);
    }
    Some(coefficients)
}

/// Ordinary least squares over the powers `free` of `x / scale`, by the normal equations and
/// Gaussian elimination with partial pivoting; `None` when singular.
fn least_squares(points: &[(f64, f64)], scale: f64, free: &[usize]) -> Option<Vec<f64>> {
    let n = free.len();
    let mut a = vec![vec![0.0; n + 1]; n];
    for (x, y) in points {
        let x = x / scale;
        let powers: Vec<f64> = free.iter().map(|&p| x.powi(p as i32)).collect();
        for (row, pr) in a.iter_mut().zip(&powers) {
            for (cell, pc) in row.iter_mut().zip(&powers) {
                *cell += pr * pc;
            }
            if let Some(rhs) = row.last_mut() {
                *rhs += pr * y;
            }
        }
    }
    for col in 0..n {
        let pivot = (col..n).max_by(|&i, &j| {
            let (vi, vj) = (a[i][col].abs(), a[j][col].abs());
            vi.total_cmp(&vj)
        })?;
        if a[pivot][col].abs() < 1e-12 {
            return None;
        }
        a.swap(col, pivot);
        for row in 0..n {
            if row == col {
                continue;
            }
            let factor = a[row][col] / a[col][col];
            let pivot_row = a[col].clone();
            for (cell, p) in a[row].iter_mut().zip(&pivot_row).skip(col) {
                *cell -= factor * p;
            }
        }
    }
    Some((0..n).map(|i| a[i][n] / a[i][i]).collect())
}

/// Measures the engine at `target` (`ip:port`) and fits its timing polynomials.
pub fn calibrate(target: &str, opts: &CalibrateOptions) -> io::Result<Calibration> {
    if opts.points == 0 || opts.repeats == 0 || opts.max_prompt_tokens < opts.points {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "calibrate: points and repeats must be >= 1 and max_prompt_tokens >= points",
        ));
    }
    let mut prompts = PromptSource::new(opts.seed, opts.vocab);
    let run_opts = RunOptions {
        model: opts.model.clone(),
        extra_body: opts.extra_body.clone(),
        timeout: opts.timeout,
        progress_every: None,
        ..RunOptions::default()
    };
    // Warm-up: an engine's first requests pay one-time costs (graphs, allocations).
    let warm = Workload {
        name: "calibrate-warm-up".to_string(),
        requests: (0..2)
            .map(|_| prompts.request(opts.max_prompt_tokens, 2))
            .collect(),
        arrival: Arrival::Concurrency(1),
    };
    succeeded(run_workload(target, &warm, &run_opts).results)?;

    let mut prefill = Vec::new();
    for point in 1..=opts.points {
        let tokens =
            (u64::from(opts.max_prompt_tokens) * u64::from(point) / u64::from(opts.points)) as u32;
        let workload = Workload {
            name: format!("calibrate-prefill-{tokens}"),
            requests: (0..opts.repeats)
                .map(|_| prompts.request(tokens, 1))
                .collect(),
            arrival: Arrival::Concurrency(1),
        };
        let results = succeeded(run_workload(target, &workload, &run_opts).results)?;
        let ttfts: Vec<f64> = results.iter().filter_map(|r| r.ttft_ms).collect();
        let ms = percentile(&ttfts, 50.0)
            .ok_or_else(|| io::Error::other(format!("no TTFT measured at {tokens} tokens")))?;
        prefill.push(PrefillPoint { tokens, ms });
    }
    let points: Vec<(f64, f64)> = prefill
        .iter()
        .map(|p| (f64::from(p.tokens), p.ms))
        .collect();
    let prefill_poly = fit_nonnegative(&points, 2)
        .ok_or_else(|| io::Error::other("the prefill times could not be fitted"))?;

    let (decode, decode_poly) = if opts.max_concurrency == 0 {
        (Vec::new(), None)
    } else {
        let (capacity, block_size) = kv_geometry(target, opts)?;
        let decode = measure_decode(target, opts, &run_opts, &mut prompts, capacity, block_size)?;
        let points: Vec<(f64, f64)> = decode.iter().map(|p| (p.kv_fill, p.ms)).collect();
        let poly = fit_nonnegative(&points, 1)
            .ok_or_else(|| io::Error::other("the decode step times could not be fitted"))?;
        (decode, Some(poly))
    };
    Ok(Calibration {
        prefill,
        prefill_poly,
        decode,
        decode_poly,
    })
}

fn measure_decode(
    target: &str,
    opts: &CalibrateOptions,
    run_opts: &RunOptions,
    prompts: &mut PromptSource,
    capacity: u32,
    block_size: u32,
) -> io::Result<Vec<DecodePoint>> {
    let blocks_each = (u64::from(opts.decode_prompt_tokens)
        + u64::from(opts.decode_output_tokens) / 2)
        .div_ceil(u64::from(block_size.max(1)));
    let mut out = Vec::new();
    let mut requests = 1u32;
    while requests <= opts.max_concurrency {
        let workload = Workload {
            name: format!("calibrate-decode-{requests}"),
            requests: (0..requests)
                .map(|_| prompts.request(opts.decode_prompt_tokens, opts.decode_output_tokens))
                .collect(),
            arrival: Arrival::Concurrency(requests as usize),
        };
        let results = succeeded(run_workload(target, &workload, run_opts).results)?;
        // The first gaps share their steps with the other requests' prefills.
        let skip = requests as usize;
        let gaps: Vec<f64> = results
            .iter()
            .flat_map(|r| r.itl_ms.iter().skip(skip).copied())
            .collect();
        let ms = percentile(&gaps, 50.0).ok_or_else(|| {
            io::Error::other(format!(
                "no inter-token gaps at {requests} requests: raise --decode-output-tokens"
            ))
        })?;
        out.push(DecodePoint {
            requests,
            kv_fill: (u64::from(requests) * blocks_each) as f64 / f64::from(capacity.max(1)),
            ms,
        });
        if requests == opts.max_concurrency {
            break;
        }
        requests = (requests * 2).min(opts.max_concurrency);
    }
    Ok(out)
}

/// The KV capacity (blocks) and block size: the options, else the engine's
/// `vllm:cache_config_info` labels.
fn kv_geometry(target: &str, opts: &CalibrateOptions) -> io::Result<(u32, u32)> {
    if let (Some(c), Some(b)) = (opts.kv_capacity_blocks, opts.block_size) {
        return Ok((c, b));
    }
    let text = client::get(target, "/metrics")?.text();
    let label = |name: &str| cache_config_label(&text, name);
    let capacity = opts.kv_capacity_blocks.or_else(|| label("num_gpu_blocks"));
    let block = opts.block_size.or_else(|| label("block_size"));
    match (capacity, block) {
        (Some(c), Some(b)) if c > 0 && b > 0 => Ok((c, b)),
        _ => Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!(
                "{target}/metrics has no vllm:cache_config_info with num_gpu_blocks and \
                 block_size: give --kv-capacity-blocks and --block-size"
            ),
        )),
    }
}

/// A numeric label of the `vllm:cache_config_info` sample in Prometheus text.
pub fn cache_config_label(metrics: &str, name: &str) -> Option<u32> {
    crate::prom::Scrape::parse(metrics)
        .label("vllm:cache_config_info", name)?
        .parse()
        .ok()
}

/// Every request of a calibration must succeed: a failed one says the engine is not idle or
/// misconfigured, and a fit over the rest would mislead.
fn succeeded(results: Vec<RequestResult>) -> io::Result<Vec<RequestResult>> {
    if let Some(bad) = results.iter().find(|r| !r.ok) {
        return Err(io::Error::other(format!(
            "a calibration request failed (status {}): {}",
            bad.status,
            bad.error.as_deref().unwrap_or("no error text")
        )));
    }
    Ok(results)
}

/// Fresh random prompts: no two share a first block, so none hits the prefix cache.
struct PromptSource {
    state: u64,
    vocab: u32,
}

impl PromptSource {
    fn new(seed: u64, vocab: u32) -> PromptSource {
        PromptSource {
            state: splitmix64(seed ^ 0xCA11_B8A7E),
            vocab: vocab.max(5),
        }
    }

    fn request(&mut self, tokens: u32, max_tokens: u32) -> RequestSpec {
        let span = u64::from(self.vocab - 4);
        let ids = (0..tokens)
            .map(|_| {
                self.state = splitmix64(self.state);
                4 + (self.state % span) as u32
            })
            .collect();
        RequestSpec {
            at_ms: 0.0,
            tokens: ids,
            max_tokens: max_tokens as usize,
            messages: None,
            client: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fit_prints_for_the_fleet_a_worker_or_its_bridge() {
        let mut c = Calibration {
            prefill: Vec::new(),
            prefill_poly: vec![8.25, 0.0076, 2.105e-7],
            decode: Vec::new(),
            decode_poly: Some(vec![2.87, 27.0]),
        };
        assert_eq!(
            c.filter_json(),
            json!({"load": {"prefill_time_ms_poly": [8.25, 0.0076, 2.105e-7]},
                   "ttft": {"decode_step_ms_poly": [2.87, 27.0]}})
        );
        assert_eq!(
            c.worker_json(),
            json!({"prefill_time_ms_poly": [8.25, 0.0076, 2.105e-7],
                   "decode_step_ms_poly": [2.87, 27.0]})
        );
        assert_eq!(
            c.bridge_flags(),
            "--worker-prefill-time-ms-poly 8.25,0.0076,0.0000002105 \
             --worker-decode-step-ms-poly 2.87,27"
        );
        c.decode_poly = None;
        assert_eq!(
            c.worker_json(),
            json!({"prefill_time_ms_poly": [8.25, 0.0076, 2.105e-7]})
        );
        assert_eq!(
            c.bridge_flags(),
            "--worker-prefill-time-ms-poly 8.25,0.0076,0.0000002105"
        );
    }

    #[test]
    fn an_exact_quadratic_is_recovered() {
        let truth = [16.5, 0.0152, 4.21e-7];
        let points: Vec<(f64, f64)> = (1..=6)
            .map(|i| {
                let x = f64::from(i) * 1365.0;
                (x, eval_poly(&truth, x))
            })
            .collect();
        let fit = fit_nonnegative(&points, 2).unwrap();
        for (f, t) in fit.iter().zip(truth) {
            assert!((f - t).abs() <= t * 1e-6, "{fit:?} vs {truth:?}");
        }
    }

    #[test]
    fn a_falling_trend_is_clamped_to_non_negative_coefficients() {
        // y falls with x: the unconstrained line has a negative slope; the constrained fit is
        // the flat line at the mean.
        let points = [(1.0, 10.0), (2.0, 8.0), (3.0, 6.0)];
        let fit = fit_nonnegative(&points, 1).unwrap();
        assert_eq!(fit.len(), 2);
        assert!((fit[0] - 8.0).abs() < 1e-9, "{fit:?}");
        assert_eq!(fit[1], 0.0);
        // A concave decode curve keeps a positive slope and intercept.
        let decode: Vec<(f64, f64)> = (0..=5)
            .map(|i| {
                let u = f64::from(i) * 0.1;
                (u, 5.74 + 54.01 * u - 25.74 * u * u)
            })
            .collect();
        let line = fit_nonnegative(&decode, 1).unwrap();
        assert!(line[0] > 5.0 && line[1] > 35.0, "{line:?}");
    }

    #[test]
    fn bad_points_give_no_fit() {
        assert_eq!(fit_nonnegative(&[], 2), None);
        assert_eq!(fit_nonnegative(&[(f64::NAN, 1.0)], 1), None);
        // One point, degree 2: the constant alone fits it exactly.
        assert_eq!(fit_nonnegative(&[(3.0, 7.0)], 2), Some(vec![7.0, 0.0, 0.0]));
    }

    #[test]
    fn cache_config_labels_are_read_from_vllm_metrics() {
        let text = "# HELP vllm:cache_config_info x\n\
            vllm:cache_config_info{block_size=\"32\",cache_dtype=\"auto\",num_gpu_blocks=\"2048\"} 1.0\n";
        assert_eq!(cache_config_label(text, "num_gpu_blocks"), Some(2048));
        assert_eq!(cache_config_label(text, "block_size"), Some(32));
        assert_eq!(cache_config_label(text, "cache_dtype"), None);
        assert_eq!(cache_config_label("vllm:other 1\n", "block_size"), None);
    }

    #[test]
    fn prompts_are_fresh_and_in_the_vocabulary() {
        let mut source = PromptSource::new(3, 512);
        let a = source.request(64, 1);
        let b = source.request(64, 1);
        assert_eq!(a.tokens.len(), 64);
        assert_ne!(a.tokens[..32], b.tokens[..32]);
        assert!(a
            .tokens
            .iter()
            .chain(&b.tokens)
            .all(|t| (4..512).contains(t)));
    }
}
