//! The bridge_msgpack fuzz target's inputs (fuzz/seeds/bridge_msgpack/: real vLLM batches, and
//! fuzz/regressions/bridge_msgpack/: anything a fuzzer ever failed on) replayed in `cargo test`.

use kv_router_protocol::vllm::decode_batch;
use std::path::Path;

#[test]
fn fuzz_inputs_decode_without_panicking() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz");
    let mut decoded = 0;
    for dir in ["seeds", "regressions"] {
        let Ok(entries) = std::fs::read_dir(root.join(dir).join("bridge_msgpack")) else {
            continue;
        };
        for entry in entries.flatten() {
            let Ok(bytes) = std::fs::read(entry.path()) else {
                continue;
            };
            if dir == "seeds" {
                // The seeds are real vLLM batches: each one decodes.
                assert!(
                    decode_batch(&bytes, 1 << 20).is_ok(),
                    "{}",
                    entry.path().display()
                );
                decoded += 1;
            } else {
                let _ = decode_batch(&bytes, 1 << 20);
            }
        }
    }
    assert!(decoded >= 10, "only {decoded} seed batches");
}
