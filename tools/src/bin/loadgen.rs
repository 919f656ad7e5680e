//! `loadgen`: replays a Mooncake trace or a synthetic shared-prefix workload against an
//! OpenAI-compatible endpoint (streamed `/v1/completions`, token-id prompts) and reports TTFT,
//! ITL, end-to-end latency, throughput, errors and the workers' cache hit rate.

use std::path::PathBuf;
use std::time::Duration;

use envoy_kv_router_tools::loadgen::{
    format_stats, load_mooncake, run_workload, synthetic, write_svg_chart, RunOptions,
    SyntheticSpec,
};

const USAGE: &str =
    "usage: loadgen --target IP:PORT (--trace FILE [--time-scale X] | --synthetic SPEC)
  [--max-requests N] [--model NAME] [--path /v1/completions] [--timeout-s 600]
  [--max-in-flight 2048] [--workers IP:PORT,IP:PORT] [--label NAME] [--json FILE] [--svg FILE]
  [--header 'name: value']... [--quiet]
SPEC: groups=G,prefix=P,isl=I,osl=O,requests=N,(rate=R|concurrency=C)[,seed=S]
--workers: mock workers whose /metrics give the prefix-cache hit rate of the run.";

fn fail(msg: &str) -> ! {
    eprintln!("{msg}\n{USAGE}");
    std::process::exit(2);
}

fn main() {
    let mut target = None;
    let mut trace: Option<PathBuf> = None;
    let mut synth: Option<String> = None;
    let mut time_scale = 1.0;
    let mut max_requests = None;
    let mut json_out: Option<PathBuf> = None;
    let mut svg_out: Option<PathBuf> = None;
    let mut opts = RunOptions::default();
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "--help" || flag == "-h" {
            println!("{USAGE}");
            return;
        }
        if flag == "--quiet" {
            opts.progress_every = None;
            continue;
        }
        let value = args
            .next()
            .unwrap_or_else(|| fail(&format!("{flag} needs a value")));
        let num = |v: &str| -> f64 {
            v.parse()
                .unwrap_or_else(|_| fail(&format!("{flag}: bad number {v:?}")))
        };
        match flag.as_str() {
            "--target" => target = Some(value),
            "--trace" => trace = Some(PathBuf::from(value)),
            "--synthetic" => synth = Some(value),
            "--time-scale" => time_scale = num(&value),
            "--max-requests" => max_requests = Some(num(&value) as usize),
            "--model" => opts.model = value,
            "--path" => opts.path = value,
            "--timeout-s" => opts.timeout = Duration::from_secs_f64(num(&value)),
            "--max-in-flight" => opts.max_in_flight = num(&value) as usize,
            "--workers" => {
                opts.worker_addrs = value
                    .split(',')
                    .filter(|s| !s.is_empty())
                    .map(str::to_string)
                    .collect();
            }
            "--label" => opts.label = value,
            "--json" => json_out = Some(PathBuf::from(value)),
            "--svg" => svg_out = Some(PathBuf::from(value)),
            "--header" => match value.split_once(':') {
                Some((k, v)) => opts
                    .extra_headers
                    .push((k.trim().to_string(), v.trim().to_string())),
                None => fail("--header expects 'name: value'"),
            },
            _ => fail(&format!("unknown option {flag}")),
        }
    }
    let target = target.unwrap_or_else(|| fail("--target is required"));
    let workload = match (trace, synth) {
        (Some(path), None) => {
            load_mooncake(&path, time_scale, max_requests).unwrap_or_else(|e| fail(&e.to_string()))
        }
        (None, Some(spec)) => {
            let mut spec = SyntheticSpec::parse(&spec).unwrap_or_else(|e| fail(&e));
            if let Some(m) = max_requests {
                spec.requests = spec.requests.min(m);
            }
            synthetic(&spec)
        }
        _ => fail("give exactly one of --trace and --synthetic"),
    };
    eprintln!(
        "loadgen: {} requests ({}) -> {target}",
        workload.requests.len(),
        workload.name
    );
    let stats = run_workload(&target, &workload, &opts);
    let label = if opts.label.is_empty() {
        "run"
    } else {
        opts.label.as_str()
    };
    print!("{}", format_stats(label, &stats));
    if let Some(p) = json_out {
        let body = serde_json::to_string_pretty(&stats.summary_json()).unwrap_or_default();
        if let Err(e) = std::fs::write(&p, body) {
            eprintln!("loadgen: cannot write {}: {e}", p.display());
        }
    }
    if let Some(p) = svg_out {
        if let Err(e) = write_svg_chart(&p, &[(label, stats.clone())]) {
            eprintln!("loadgen: cannot write {}: {e}", p.display());
        }
    }
    if stats.completed() == 0 {
        std::process::exit(1);
    }
}
