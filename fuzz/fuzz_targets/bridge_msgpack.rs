//! The bridge's engine msgpack decoder (vLLM / SGLang ZMQ frames): never panics.
#![no_main]
use kv_router_protocol::vllm::{decode_batch, seq_from_frame, split_frames};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = decode_batch(data, 1 << 20);
    let _ = seq_from_frame(data);
    // Also as a multipart message: split at the first two 0xFF bytes.
    let mut parts = data.splitn(3, |b| *b == 0xFF);
    let frames: Vec<&[u8]> = parts.by_ref().collect();
    if let Ok(f) = split_frames(&frames) {
        let _ = decode_batch(f.payload, 1 << 20);
    }
});
