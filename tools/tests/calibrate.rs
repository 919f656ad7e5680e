//! `calibrate` against an in-process engine-mode mock, whose timing model is known (a roofline,
//! `mock::timing`, without jitter here): the fitted polynomials must give back the mock's prefill
//! and decode step times.

use std::time::Duration;

use envoy_kv_router_tools::calibrate::{calibrate, eval_poly, CalibrateOptions};
use envoy_kv_router_tools::mock::timing::{decode_step_ms, prefill_ms};
use envoy_kv_router_tools::mock::{self, Mode, Options};

#[test]
fn the_fit_gives_back_the_mock_engines_timing() {
    let (server, _) = mock::spawn(Options {
        id: "1".into(),
        mode: Mode::Engine,
        block_size: 64,
        kv_blocks: 512,
        max_seqs: 32,
        jitter: 0.0,
        ..Options::default()
    })
    .unwrap();
    let addr = server.addr_string();
    let opts = CalibrateOptions {
        max_prompt_tokens: 8192,
        max_concurrency: 16,
        timeout: Duration::from_secs(30),
        ..CalibrateOptions::default()
    };
    let c = calibrate(&addr, &opts).unwrap();
    eprint!("{}", c.report());

    let tokens: Vec<u32> = c.prefill.iter().map(|p| p.tokens).collect();
    assert_eq!(tokens, [1365, 2730, 4096, 5461, 6826, 8192]);
    // Fresh prompts every time: a prefix hit would make a repeat ~9 ms and drag the median
    // (and the fit) far under the model's 35-208 ms. The client and HTTP add a millisecond or
    // two; a busy machine a little more.
    for t in [1024.0, 4096.0, 8192.0] {
        let (fit, truth) = (eval_poly(&c.prefill_poly, t), prefill_ms(t));
        assert!(
            (fit - truth).abs() <= 0.08 * truth + 3.0,
            "prefill at {t} tokens: fitted {fit:.1} ms, the mock takes {truth:.1} ms"
        );
    }

    // The KV capacity and block size come from the mock's vllm:cache_config_info: 16 requests
    // of 1,024 + 48 / 2 tokens hold 16 x 17 of its 512 blocks.
    let fills: Vec<f64> = c.decode.iter().map(|p| p.kv_fill).collect();
    assert_eq!(fills.len(), 5);
    assert_eq!(fills.last().copied(), Some(16.0 * 17.0 / 512.0));
    // The model's decode step: the requests each decode one token after their 1,024-token
    // prompt and, mid-answer, 24 outputs.
    let decode = c.decode_poly.clone().unwrap();
    for p in &c.decode {
        let truth = decode_step_ms(p.requests as usize, 1024 + 24);
        let fit = eval_poly(&decode, p.kv_fill);
        assert!(
            (fit - truth).abs() <= 0.12 * truth + 1.0,
            "decode at fill {:.3}: fitted {fit:.2} ms, the mock steps {truth:.2} ms",
            p.kv_fill
        );
    }
    let json = c.filter_json();
    assert_eq!(
        json["load"]["prefill_time_ms_poly"]
            .as_array()
            .map(Vec::len),
        Some(3)
    );
    assert_eq!(
        json["ttft"]["decode_step_ms_poly"].as_array().map(Vec::len),
        Some(2)
    );
}

#[test]
fn an_unreachable_engine_is_a_clear_error() {
    let opts = CalibrateOptions {
        timeout: Duration::from_secs(2),
        ..CalibrateOptions::default()
    };
    let e = calibrate("127.0.0.1:1", &opts).unwrap_err();
    assert!(e.to_string().contains("calibration request failed"), "{e}");
}
