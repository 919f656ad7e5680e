//! `mock-worker`: a mock LLM worker (echo or vLLM-like engine) serving the KV event endpoint.
//! See `envoy_kv_router_tools::mock` and `mock-worker --help`.

use envoy_kv_router_tools::mock::{run, Options};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let opts = match Options::parse(&args) {
        Ok(o) => o,
        Err(msg) => {
            eprintln!("{msg}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(opts) {
        eprintln!("mock-worker: {e}");
        std::process::exit(1);
    }
}
