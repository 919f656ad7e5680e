//! The page's `worker` object: the worker's description of itself (see the filter's DESIGN,
//! "membership"). Flags (`--worker-*`) win; otherwise what the engine's metrics say
//! (`vllm:cache_config_info`: `block_size`, `num_gpu_blocks`). Nothing known: no object.

use kv_router_protocol::prom::Scrape;
use kv_router_protocol::worker::{WorkerDescription, MAX_MODELS};

/// `block_size` and `num_gpu_blocks` (the KV capacity of one engine, in blocks) from vLLM's
/// `vllm:cache_config_info{block_size="16",num_gpu_blocks="3000",...} 1.0`.
pub fn learn_from_metrics(text: &str) -> WorkerDescription {
    let scrape = Scrape::parse(text);
    let label = |key: &str| -> Option<u32> {
        scrape
            .label("vllm:cache_config_info", key)
            .and_then(|v| v.parse().ok())
    };
    WorkerDescription {
        block_size: label("block_size"),
        kv_capacity_blocks: label("num_gpu_blocks").filter(|&b| b > 0),
        ..WorkerDescription::default()
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
