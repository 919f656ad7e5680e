//! Reports of runs: the one-run text report, the side-by-side table of modes, and an SVG chart
//! of the TTFT distribution of each mode.

use std::fmt::Write as _;
use std::io;
use std::path::Path;

use plotters::prelude::*;

use super::stats::{RunStats, Summary};

fn fmt_ms(x: f64) -> String {
    if !x.is_finite() {
        "-".into()
    } else if x >= 10_000.0 {
        format!("{:.1}s", x / 1000.0)
    } else {
        format!("{x:.1}")
    }
}

fn fmt_pct(x: Option<f64>) -> String {
    x.map_or_else(|| "-".into(), |v| format!("{:.1}%", v * 100.0))
}

/// The one-run report: counts, throughput, and mean/p50/p90/p99 of TTFT, ITL and E2E (ms).
pub fn format_stats(label: &str, s: &RunStats) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "== {label}: {}", s.workload);
    let _ = writeln!(
        out,
        "requests {}  completed {}  errors {}  wall {:.1}s  {:.2} req/s  {:.1} out tok/s  cache hit {}",
        s.results.len(),
        s.completed(),
        s.errors(),
        s.wall_s,
        s.requests_per_s(),
        s.output_tokens_per_s(),
        fmt_pct(s.hit_rate())
    );
    let _ = writeln!(
        out,
        "{:<8} {:>10} {:>10} {:>10} {:>10} {:>10}",
        "ms", "mean", "p50", "p90", "p99", "max"
    );
    for (name, sum) in [("TTFT", s.ttft()), ("ITL", s.itl()), ("E2E", s.e2e())] {
        let _ = writeln!(
            out,
            "{:<8} {:>10} {:>10} {:>10} {:>10} {:>10}",
            name,
            fmt_ms(sum.mean),
            fmt_ms(sum.p50),
            fmt_ms(sum.p90),
            fmt_ms(sum.p99),
            fmt_ms(sum.max)
        );
    }
    let c = &s.client;
    let _ = writeln!(
        out,
        "concurrency: peak in flight {}  peak open streams {}  mean in flight {:.0}",
        c.peak_in_flight,
        c.peak_open_streams,
        s.mean_in_flight()
    );
    let _ = writeln!(
        out,
        "client: cpu {:.1}s ({:.0}% of one core)  max RSS {:.0} MB  runtime lag p50 {} p99 {} max {} ms",
        c.cpu_s,
        s.client_cpu_percent(),
        c.max_rss_bytes as f64 / f64::from(1 << 20),
        fmt_ms(c.runtime_lag_ms.p50),
        fmt_ms(c.runtime_lag_ms.p99),
        fmt_ms(c.runtime_lag_ms.max)
    );
    if let (Some(server), Some(w)) = (s.server_ttft_mean_ms(), s.workers.as_ref()) {
        let _ = writeln!(
            out,
            "TTFT mean: client {:.3} ms, server side {:.3} ms (workers' /metrics), difference {} ms; workers' cpu {:.1}s",
            s.ttft().mean,
            server,
            s.ttft_overhead_ms()
                .map_or_else(|| "-".into(), |d| format!("{d:.3}")),
            w.cpu_s
        );
    }
    if let Some((prefill, busy)) = s.fleet_utilization() {
        let _ = writeln!(
            out,
            "fleet utilization over the {:.1}s arrival window: prefill {:.0}%, prefill+decode steps {:.0}% (mock engines' modelled step time / workers x window)",
            s.send_span_s(),
            prefill * 100.0,
            busy * 100.0
        );
    }
    let per_worker: Vec<String> = s
        .per_worker()
        .iter()
        .map(|(w, c)| format!("{w}:{c}"))
        .collect();
    if !per_worker.is_empty() {
        let _ = writeln!(out, "per worker: {}", per_worker.join(" "));
    }
    for (msg, count) in s.error_summary().iter().take(5) {
        let _ = writeln!(out, "error x{count}: {msg}");
    }
    out
}

/// One row per mode: throughput, errors, hit rate, TTFT/ITL/E2E mean/p50/p99.
pub fn comparison_table(rows: &[(&str, RunStats)]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<22} {:>6} {:>5} {:>7} {:>8} {:>7} | {:>9} {:>9} {:>9} | {:>7} {:>7} {:>7} | {:>9} {:>9}",
        "mode", "done", "err", "req/s", "tok/s", "hit", "TTFT mean", "TTFT p50", "TTFT p99",
        "ITL avg", "ITL p50", "ITL p99", "E2E p50", "E2E p99"
    );
    for (name, s) in rows {
        let (t, i, e) = (s.ttft(), s.itl(), s.e2e());
        let _ = writeln!(
            out,
            "{:<22} {:>6} {:>5} {:>7.2} {:>8.1} {:>7} | {:>9} {:>9} {:>9} | {:>7} {:>7} {:>7} | {:>9} {:>9}",
            name,
            s.completed(),
            s.errors(),
            s.requests_per_s(),
            s.output_tokens_per_s(),
            fmt_pct(s.hit_rate()),
            fmt_ms(t.mean),
            fmt_ms(t.p50),
            fmt_ms(t.p99),
            fmt_ms(i.mean),
            fmt_ms(i.p50),
            fmt_ms(i.p99),
            fmt_ms(e.p50),
            fmt_ms(e.p99)
        );
    }
    let _ = writeln!(
        out,
        "(times in ms unless marked s; hit = prefix-cache hit rate of the workers during the run)"
    );
    out
}

pub fn print_comparison_table(rows: &[(&str, RunStats)]) {
    print!("{}", comparison_table(rows));
}

/// The series' colours (matplotlib's "tab10").
const COLORS: [RGBColor; 8] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
    RGBColor(0xe3, 0x77, 0xc2),
    RGBColor(0x17, 0xbe, 0xcf),
];

/// An SVG (plotters) with the TTFT CDF of each mode (log-scaled time axis) and a legend with
/// p50/p99.
pub fn svg_chart(rows: &[(&str, RunStats)]) -> String {
    let series: Vec<(&str, Vec<f64>)> = rows
        .iter()
        .map(|(name, s)| {
            let mut v: Vec<f64> = s
                .results
                .iter()
                .filter(|r| r.ok)
                .filter_map(|r| r.ttft_ms)
                .map(|x| x.max(0.01))
                .collect();
            v.sort_by(f64::total_cmp);
            (*name, v)
        })
        .collect();
    let all = series.iter().flat_map(|(_, v)| v.iter().copied());
    let (mut lo, mut hi) = all.fold((f64::INFINITY, 0.0f64), |(lo, hi), x| {
        (lo.min(x), hi.max(x))
    });
    if !lo.is_finite() {
        (lo, hi) = (1.0, 1000.0);
    }
    // Whole decades on the time axis.
    let lo = 10f64.powf(lo.log10().floor());
    let hi = 10f64.powf(hi.log10().ceil()).max(lo * 10.0);
    let mut out = String::new();
    if let Err(e) = draw_cdf(&mut out, &series, lo, hi) {
        // Drawing into a string fails only on a plotters bug; say so in the picture.
        out = format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\"><text y=\"20\">chart failed: {}</text></svg>\n",
            e.to_string().replace('<', "&lt;")
        );
    }
    out
}

fn draw_cdf(
    out: &mut String,
    series: &[(&str, Vec<f64>)],
    lo: f64,
    hi: f64,
) -> Result<(), Box<dyn std::error::Error>> {
    let root = SVGBackend::with_string(out, (820, 480)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Time to first token: CDF per routing mode",
            ("sans-serif", 16),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(55)
        .build_cartesian_2d((lo..hi).log_scale(), 0.0..1.0)?;
    chart
        .configure_mesh()
        .x_desc("TTFT (log scale)")
        .y_desc("fraction of requests")
        .x_label_formatter(&|ms| {
            if *ms >= 1000.0 {
                format!("{}s", ms / 1000.0)
            } else {
                format!("{ms}ms")
            }
        })
        .y_label_formatter(&|p| format!("{:.0}%", p * 100.0))
        .light_line_style(WHITE)
        .draw()?;
    for (k, (name, v)) in series.iter().enumerate() {
        let color = COLORS[k % COLORS.len()];
        let n = v.len() as f64;
        // A step function: up by 1/n at each sample.
        let steps = v
            .iter()
            .enumerate()
            .flat_map(|(i, x)| [(*x, i as f64 / n), (*x, (i + 1) as f64 / n)]);
        let sum = Summary::of(v);
        let label = format!(
            "{name}: p50 {} p99 {} (n={})",
            fmt_ms(sum.p50),
            fmt_ms(sum.p99),
            sum.count
        );
        chart
            .draw_series(LineSeries::new(steps, color.stroke_width(2)))?
            .label(label)
            .legend(move |(x, y)| Rectangle::new([(x, y - 2), (x + 18, y + 2)], color.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

/// Writes [`svg_chart`] to `path`.
pub fn write_svg_chart(path: &Path, rows: &[(&str, RunStats)]) -> io::Result<()> {
    std::fs::write(path, svg_chart(rows))
}

#[cfg(test)]
mod tests {
    use super::super::stats::RequestResult;
    use super::super::stats::{ClientUsage, WorkerCounters};
    use super::*;

    fn fake_stats(ttfts: &[f64]) -> RunStats {
        RunStats {
            workload: "w".into(),
            wall_s: 2.0,
            results: ttfts
                .iter()
                .enumerate()
                .map(|(i, t)| RequestResult {
                    index: i,
                    ok: true,
                    status: 200,
                    ttft_ms: Some(*t),
                    itl_ms: vec![5.0, 7.0],
                    e2e_ms: t + 12.0,
                    output_tokens: 3,
                    prompt_tokens: 10,
                    cached_tokens: Some(5),
                    worker_id: Some("1".into()),
                    ..RequestResult::default()
                })
                .chain(std::iter::once(RequestResult {
                    error: Some("status 503: x".into()),
                    ..RequestResult::default()
                }))
                .collect(),
            ..RunStats::default()
        }
    }

    #[test]
    fn stats_tables_and_svg() {
        let a = fake_stats(&[10.0, 20.0, 30.0, 40.0]);
        let b = fake_stats(&[100.0, 2000.0]);
        assert_eq!(a.completed(), 4);
        assert_eq!(a.errors(), 1);
        // The percentiles' HDR histogram: 3 significant digits.
        assert!((a.ttft().p50 - 20.0).abs() <= 0.02, "{:?}", a.ttft());
        assert_eq!(a.ttft().mean, 25.0);
        assert_eq!(a.itl().mean, 6.0);
        assert_eq!(a.requests_per_s(), 2.0);
        assert_eq!(a.hit_rate(), Some(0.5));
        let table = comparison_table(&[("kv", a.clone()), ("random", b.clone())]);
        assert!(table.contains("kv") && table.contains("random"), "{table}");
        assert!(format_stats("kv", &a).contains("error x1: status 503"));
        let mut measured = a.clone();
        measured.client = ClientUsage {
            cpu_s: 1.0,
            max_rss_bytes: 64 << 20,
            peak_in_flight: 4,
            peak_open_streams: 3,
            runtime_lag_ms: Summary::of(&[0.1, 0.2]),
        };
        measured.workers = Some(WorkerCounters {
            first_token_s: 0.02,
            first_tokens: 4.0,
            ..WorkerCounters::default()
        });
        assert_eq!(measured.server_ttft_mean_ms(), Some(5.0));
        // No busy time scraped: no utilization.
        assert_eq!(measured.fleet_utilization(), None);
        let mut busy = measured.clone();
        busy.results[0].sent_at_ms = 2000.0;
        busy.workers = Some(WorkerCounters {
            prefill_busy_s: 4.0,
            busy_s: 6.0,
            workers: 4.0,
            ..WorkerCounters::default()
        });
        assert_eq!(busy.send_span_s(), 2.0);
        assert_eq!(busy.fleet_utilization(), Some((0.5, 0.75)));
        assert_eq!(busy.step_wait_ms(), None);
        // Steps of 0.1 s and 0.3 s (0.4 s busy, 0.1 s^2): an arrival during a step waits
        // 0.1 / 0.8 s = 125 ms on average, more than half the mean step (100 ms).
        busy.workers = Some(WorkerCounters {
            busy_s: 0.4,
            busy_squared_s2: 0.01 + 0.09,
            ..WorkerCounters::default()
        });
        assert!((busy.step_wait_ms().unwrap() - 125.0).abs() < 1e-9);
        assert_eq!(measured.ttft_overhead_ms(), Some(20.0));
        assert_eq!(measured.client_cpu_percent(), 50.0);
        let text = format_stats("kv", &measured);
        assert!(
            text.contains("peak in flight 4  peak open streams 3"),
            "{text}"
        );
        assert!(text.contains("server side 5.000 ms"), "{text}");
        let svg = svg_chart(&[("kv <1>", a), ("random", b)]);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("kv &lt;1&gt;"));
        // One 2-pixel line per series (axes and ticks are 1 pixel).
        assert_eq!(svg.matches("stroke-width=\"2\"").count(), 2, "{svg}");
        let empty = svg_chart(&[("none", RunStats::default())]);
        assert!(empty.contains("</svg>"));
        assert!(a_json_ok());
    }

    fn a_json_ok() -> bool {
        let s = fake_stats(&[1.0]);
        let j = s.summary_json();
        j["ttft_ms"]["p50"] == 1.0 && j["errors"] == 1
    }
}
