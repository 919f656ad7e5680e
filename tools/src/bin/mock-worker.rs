//! `mock-worker`: a mock LLM worker (echo or vLLM-like engine) serving the KV event endpoint.
//! See `envoy_kv_router_tools::mock` and `mock-worker --help`.

use clap::Parser;
use envoy_kv_router_tools::mock::{run, Options};
use envoy_kv_router_tools::sys::raise_fd_limit;

fn main() {
    let opts = Options::parse();
    if let Err(e) = opts.validate() {
        eprintln!("mock-worker: {e}");
        std::process::exit(2);
    }
    // Every client connection is a descriptor: a worker of a large fleet test holds thousands.
    if let Err(e) = raise_fd_limit() {
        eprintln!("mock-worker: cannot raise the open-file limit: {e}");
    }
    if let Err(e) = run(opts) {
        eprintln!("mock-worker: {e}");
        std::process::exit(1);
    }
}
