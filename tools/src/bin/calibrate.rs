//! `calibrate`: measures one idle engine's prefill and decode timing and prints the filter
//! configuration that makes the TTFT policy predict with it (see `envoy_kv_router_tools::calibrate`).
//!
//! The measured points and the fitted values go to stderr; the JSON fragment to merge into the
//! filter's configuration goes to stdout:
//!
//! ```text
//! calibrate --target 10.0.0.7:8000 --model my-model --max-prompt-tokens 8192 > timing.json
//! ```

use std::time::Duration;

use clap::Parser;
use envoy_kv_router_tools::calibrate::{calibrate, CalibrateOptions};

#[derive(Debug, Parser)]
#[command(
    name = "calibrate",
    about = "Fits the filter's prefill-time and decode-step polynomials to an engine",
    after_help = "Run it against one idle engine (no other traffic: queueing would be measured \
as compute). Keep --max-prompt-tokens within the engine's max_num_batched_tokens and \
max_model_len. Prints the measurements on stderr and, on stdout, \
{\"load\": {\"prefill_time_ms_poly\": [...]}, \"ttft\": {\"decode_step_ms_poly\": [...]}} \
to merge into the filter configuration (--output worker: the two fields for one worker's entry; \
--output bridge-flags: kv-event-bridge's --worker-*-poly flags)."
)]
struct Args {
    /// The engine: IP:PORT of its OpenAI-compatible server.
    #[arg(long)]
    target: String,
    #[arg(long, default_value = "mock-model")]
    model: String,
    /// Prompt ids are drawn below this (and from 4 up).
    #[arg(long, default_value_t = 32_000)]
    vocab: u32,
    /// The longest prefill prompt measured.
    #[arg(long, default_value_t = 8192)]
    max_prompt_tokens: u32,
    /// Prompt lengths measured (evenly spaced up to --max-prompt-tokens).
    #[arg(long, default_value_t = 6)]
    points: u32,
    /// Requests per length (the median is kept).
    #[arg(long, default_value_t = 3)]
    repeats: u32,
    /// Decode: the most requests at once (1, 2, 4, ... up to this); 0 skips the decode.
    #[arg(long, default_value_t = 8)]
    max_concurrency: u32,
    #[arg(long, default_value_t = 1024)]
    decode_prompt_tokens: u32,
    #[arg(long, default_value_t = 48)]
    decode_output_tokens: u32,
    /// The engine's KV capacity in blocks (default: its vllm:cache_config_info).
    #[arg(long)]
    kv_capacity_blocks: Option<u32>,
    /// The engine's KV block size (default: its vllm:cache_config_info).
    #[arg(long)]
    block_size: Option<u32>,
    /// Per-request timeout, seconds.
    #[arg(long, default_value_t = 120)]
    timeout_s: u64,
    /// What stdout gets: the fleet's polynomials (`filter`), one worker entry's (`worker`, for a
    /// mixed fleet) or `kv-event-bridge` flags (`bridge-flags`, a discovered worker's own).
    #[arg(long, value_enum, default_value_t = Output::Filter)]
    output: Output,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum Output {
    Filter,
    Worker,
    BridgeFlags,
}

fn main() {
    let args = Args::parse();
    let opts = CalibrateOptions {
        model: args.model,
        vocab: args.vocab,
        max_prompt_tokens: args.max_prompt_tokens,
        points: args.points,
        repeats: args.repeats,
        max_concurrency: args.max_concurrency,
        decode_prompt_tokens: args.decode_prompt_tokens,
        decode_output_tokens: args.decode_output_tokens,
        kv_capacity_blocks: args.kv_capacity_blocks,
        block_size: args.block_size,
        timeout: Duration::from_secs(args.timeout_s),
        ..CalibrateOptions::default()
    };
    match calibrate(&args.target, &opts) {
        Ok(calibration) => {
            eprint!("{}", calibration.report());
            match args.output {
                Output::Filter => println!("{}", calibration.filter_json()),
                Output::Worker => println!("{}", calibration.worker_json()),
                Output::BridgeFlags => println!("{}", calibration.bridge_flags()),
            }
        }
        Err(e) => {
            eprintln!("calibrate: {e}");
            std::process::exit(1);
        }
    }
}
