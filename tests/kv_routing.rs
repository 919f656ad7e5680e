//! KV-aware routing through a real Envoy: events from workers feed the index, the cost model picks.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::indexing_slicing)] // test code: a failed expectation is the assertion

mod common;
use common::*;
use kv_router_testkit::kv_events::stored_event;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const BLOCK: u32 = 16;

fn kv_config(workers: &[Worker], extra: Value) -> Value {
    let mut config = filter_config(workers, json!({"mode": "kv", "block_size": BLOCK}));
    if let (Some(c), Some(e)) = (config.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            c.insert(k.clone(), v.clone());
        }
    }
    config
}

fn kv_envoy(workers: &[Worker], extra: Value) -> Envoy {
    start_envoy(workers, kv_config(workers, extra))
}

/// As [`kv_envoy`], with every worker on `"kv_mode": "events"` ([`events_only`]): the index
/// holds only what the events say, not the router's own routing decisions.
fn kv_envoy_on_events(workers: &[Worker], extra: Value) -> Envoy {
    start_envoy(workers, events_only(kv_config(workers, extra)))
}

/// A streamed request pinned to `worker` that emits its first token at once and then stays in
/// flight for `hold_ms`: it loads the worker with its prompt blocks as decode load.
fn hold_decode(
    envoy: &Envoy,
    worker: u64,
    prompt: &[u32],
    hold_ms: u64,
) -> http::StreamingResponse {
    let body = json!({"model": "mock", "prompt": prompt, "stream": true, "max_tokens": 2,
        "nvext": {"backend_instance_id": worker},
        "mock": {"chunks": 2, "chunk_interval_ms": hold_ms}});
    let mut stream = http::request_streaming(
        &envoy.listener,
        "POST",
        "/v1/completions",
        &[("content-type", "application/json")],
        body.to_string().as_bytes(),
        Duration::from_secs(60),
    )
    .expect("held request");
    assert_eq!(stream.status, 200);
    let first = stream.next_event().expect("first chunk");
    assert!(first.is_some(), "first token arrives before the hold");
    stream
}

#[test]
fn seed_worked_example() {
    let workers = echo_workers(3, BLOCK);
    // The seed's Dynamo cost is this test's subject, on the overlaps the events give (the probes'
    // own predicted blocks would add to them).
    let envoy = kv_envoy_on_events(&workers, json!({"policy": "dynamo"}));
    let prompt = tokens(1000, 10 * BLOCK);
    // Device overlaps 2, 5 and 8 blocks of the 10-block prompt.
    for (worker, blocks) in workers.iter().zip([2u32, 5, 8]) {
        let cached = &prompt[..(blocks * BLOCK) as usize];
        publish(worker, vec![vllm_stored(cached, BLOCK, None, 100, "GPU")]);
    }
    let probe = completion(&prompt);
    assert!(
        wait_for_overlap(&envoy, &probe, 8, Duration::from_secs(5)),
        "events reached the index"
    );
    // Decode loads of 10, 5 and 9 blocks, counted as Dynamo does: the blocks of requests in
    // flight (2, 0 and 7, past their first token) plus this request's blocks each worker does not
    // hold yet (8, 5 and 2).
    let _held: Vec<_> = workers
        .iter()
        .zip([2u32, 0, 7])
        .filter(|(_, blocks)| *blocks > 0)
        .enumerate()
        .map(|(i, (w, blocks))| {
            hold_decode(
                &envoy,
                w.id,
                &tokens(50_000 + 1000 * i as u32, blocks * BLOCK),
                8000,
            )
        })
        .collect();
    // The held requests are past their first token in the load table (as the gauges show).
    assert!(envoy.wait_for(Duration::from_secs(5), |e| {
        e.router_stat("worker.1.rank.0.decode_blocks") == 2
            && e.router_stat("worker.3.rank.0.decode_blocks") == 7
            && e.router_stat("worker.1.rank.0.prefill_tokens") == 0
            && e.router_stat("worker.3.rank.0.prefill_tokens") == 0
    }));
    let (worker, overlap, resp) = route(&envoy, &probe);
    let costs = costs(&resp);
    assert_eq!(costs.get(&1).copied(), Some(18.0), "{costs:?}");
    assert_eq!(costs.get(&2).copied(), Some(10.0), "{costs:?}");
    assert_eq!(costs.get(&3).copied(), Some(11.0), "{costs:?}");
    assert_eq!(worker, 2);
    assert_eq!(overlap, 5);
}

#[test]
fn stored_attracts_and_removed_or_cleared_takes_the_credit_away() {
    let workers = echo_workers(3, BLOCK);
    // Events only: the routed requests' predicted blocks would keep the credit the events take.
    let envoy = kv_envoy_on_events(&workers, json!({}));
    let prompt = tokens(7, 8 * BLOCK);
    let body = completion(&prompt);
    publish(
        &workers[1],
        vec![vllm_stored(&prompt, BLOCK, None, 500, "GPU")],
    );
    assert!(wait_for_overlap(&envoy, &body, 8, Duration::from_secs(5)));
    for _ in 0..5 {
        assert_eq!(
            route(&envoy, &body).0,
            2,
            "the worker holding the prefix wins"
        );
    }
    // Remove the last 4 blocks: 4 remain.
    publish(
        &workers[1],
        vec![vllm_removed(&[504, 505, 506, 507], "GPU")],
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut overlap = 8;
    while overlap != 4 && Instant::now() < deadline {
        overlap = route(&envoy, &body).1;
    }
    assert_eq!(overlap, 4);
    publish(&workers[1], vec![json!({"type": "AllBlocksCleared"})]);
    let deadline = Instant::now() + Duration::from_secs(5);
    while overlap != 0 && Instant::now() < deadline {
        overlap = route(&envoy, &body).1;
    }
    assert_eq!(overlap, 0, "cleared: no credit left");
}

/// `events.stored|removed|cleared` split `events.received` by kind, once per process (not per
/// Envoy thread); blocks that arrive in a dump are not events.
#[test]
fn received_events_are_counted_by_kind() {
    let workers = echo_workers(2, BLOCK);
    let envoy = kv_envoy(&workers, json!({}));
    assert!(
        envoy.wait_for(Duration::from_secs(5), |e| e.router_stat("events.resyncs")
            >= 2)
    );
    let a = tokens(100, 2 * BLOCK);
    let b = tokens(200, 3 * BLOCK);
    publish(
        &workers[0],
        vec![
            vllm_stored(&a, BLOCK, None, 10, "GPU"),
            vllm_stored(&b, BLOCK, None, 20, "GPU"),
            vllm_removed(&[11], "GPU"),
        ],
    );
    publish(&workers[1], vec![json!({"type": "AllBlocksCleared"})]);
    assert!(
        envoy.wait_for(Duration::from_secs(5), |e| e.router_stat("events.received")
            == 4)
    );
    let by_kind =
        ["stored", "removed", "cleared"].map(|k| envoy.router_stat(&format!("events.{k}")));
    assert_eq!(by_kind, [2, 1, 1]);
}

/// `vm.linear_memory_bytes` sums every VM's wasm memory: with 2 worker threads three VMs (the
/// main thread's and the workers') each grow a replica of the index as it fills.
#[test]
fn the_linear_memory_gauge_counts_every_replica() {
    const BLOCKS: u64 = 40_000;
    let workers = echo_workers(1, BLOCK);
    let mut config = filter_config(&workers, json!({"mode": "kv", "block_size": BLOCK}));
    config["index"] = json!({"max_blocks": BLOCKS});
    let envoy = start_envoy_with(&workers, config, |o| o.concurrency = 2);
    assert!(
        envoy.wait_for(Duration::from_secs(5), |e| e.router_stat("events.resyncs")
            >= 1)
    );
    // Every VM adds its share on its tick (50 ms): idle once the sum holds still for 300 ms.
    let (mut idle, mut since) = (0, Instant::now());
    assert!(envoy.wait_for(Duration::from_secs(10), |e| {
        let now = e.router_stat("vm.linear_memory_bytes");
        if now != idle {
            (idle, since) = (now, Instant::now());
        }
        idle >= 3 << 16 && since.elapsed() >= Duration::from_millis(300)
    }));
    let mut parent = None;
    for first in (0..BLOCKS).step_by(1000) {
        let hashes: Vec<u64> = (first + 1..=first + 1000).collect();
        let ids: Vec<u32> = (0..1000 * u64::from(BLOCK))
            .map(|t| ((first + t) % 50_000) as u32)
            .collect();
        publish(
            &workers[0],
            vec![stored_event(&hashes, parent, &ids, BLOCK, "GPU")],
        );
        parent = hashes.last().copied();
    }
    assert!(
        envoy.wait_for(Duration::from_secs(60), |e| e.router_stat("index.entries")
            == BLOCKS)
    );
    // Each of the three VMs holds a replica of `index.bytes`; beyond that only the poller's page
    // and batch buffers and allocator slack (~0.5 MB measured). A gauge fed by one VM alone grows
    // by about a third of the lower bound, one that counts a VM twice by twice it.
    let replicas = 3;
    let index_bytes = envoy.router_stat("index.bytes");
    assert!(index_bytes >= BLOCKS * 28, "index.bytes {index_bytes}");
    let lower = replicas * index_bytes;
    let upper = lower + (3 << 19);
    let mut grown = 0;
    let reached = envoy.wait_for(Duration::from_secs(10), |e| {
        grown = e.router_stat("vm.linear_memory_bytes").saturating_sub(idle);
        grown >= lower
    });
    assert!(
        reached && grown <= upper,
        "grew {grown} B, expected {lower}..={upper}"
    );
}

#[test]
fn dynamo_shaped_events_route_too() {
    let workers = echo_workers(2, BLOCK);
    // Events only: a probe routed to worker 2 before the event lands would be predicted there.
    let envoy = kv_envoy_on_events(&workers, json!({}));
    let prompt = tokens(300, 6 * BLOCK);
    let locals = envoy_kv_router::hashing::local_block_hashes(
        &prompt,
        BLOCK,
        envoy_kv_router::hashing::hash_seed(None),
    );
    let blocks: Vec<Value> = locals
        .iter()
        .enumerate()
        .map(|(i, h)| json!({"block_hash": 9000 + i, "tokens_hash": h.0}))
        .collect();
    publish(
        &workers[0],
        vec![json!({"dp_rank": 0, "data": {"stored": {"parent_hash": null, "blocks": blocks}}})],
    );
    assert!(wait_for_overlap(
        &envoy,
        &completion(&prompt),
        6,
        Duration::from_secs(5)
    ));
    assert_eq!(route(&envoy, &completion(&prompt)).0, 1);
}

/// Host blocks past the device prefix earn 0.75 of a device block's credit, disk 0.25.
#[test]
fn host_and_disk_tiers_earn_partial_credit() {
    for (medium, weight) in [("CPU", 0.75), ("DISK", 0.25)] {
        let workers = echo_workers(2, BLOCK);
        // The Dynamo cost's tier credits are this test's subject, on the events' tiers alone (a
        // probe's predicted blocks would be device blocks).
        let envoy = kv_envoy_on_events(&workers, json!({"policy": "dynamo"}));
        let prompt = tokens(40, 10 * BLOCK);
        let device = &prompt[..(2 * BLOCK) as usize];
        let slower = &prompt[(2 * BLOCK) as usize..(6 * BLOCK) as usize];
        publish(
            &workers[0],
            vec![
                vllm_stored(device, BLOCK, None, 1, "GPU"),
                vllm_stored(slower, BLOCK, Some(2), 3, medium),
            ],
        );
        let body = completion(&prompt);
        let deadline = Instant::now() + Duration::from_secs(5);
        let (mut worker, mut resp) = (0, None);
        while Instant::now() < deadline {
            let (w, _, r) = route(&envoy, &body);
            let c = costs(&r);
            worker = w;
            if c.get(&2).zip(c.get(&1)).is_some_and(|(a, b)| a > b) {
                resp = Some(r);
                break;
            }
        }
        let resp = resp.expect("worker 1 became cheaper");
        let c = costs(&resp);
        // Prefill credit 2 + 4 * weight; the 2 device blocks also spare 2 new decode blocks.
        let advantage = c[&2] - c[&1];
        let expected = (2.0 + 4.0 * weight) + 2.0;
        assert!(
            (advantage - expected).abs() < 1e-6,
            "{medium}: advantage {advantage}, expected {expected}, costs {c:?}"
        );
        assert_eq!(worker, 1);
        assert_eq!(
            resp.header("x-kv-router-overlap-blocks"),
            Some("2"),
            "device prefix only"
        );
    }
}

#[test]
fn ties_at_temperature_zero_are_broken_at_random() {
    let workers = echo_workers(2, BLOCK);
    let envoy = kv_envoy(&workers, json!({}));
    let mut counts = [0u32; 2];
    for i in 0..40 {
        let (w, _, _) = route(&envoy, &completion(&tokens(i * 1000, 4 * BLOCK)));
        counts[(w - 1) as usize] += 1;
    }
    assert!(
        counts[0] >= 5 && counts[1] >= 5,
        "both tied workers picked: {counts:?}"
    );
}

#[test]
fn temperature_spreads_selection_by_softmax() {
    let workers = echo_workers(2, BLOCK);
    // The softmax over the Dynamo cost is this test's subject, with worker 1 alone holding the
    // prefix (the requests' predicted blocks would give worker 2 the same overlap).
    let envoy = kv_envoy_on_events(
        &workers,
        json!({"policy": "dynamo", "router_temperature": 1.0}),
    );
    let prompt = tokens(77, 8 * BLOCK);
    publish(
        &workers[0],
        vec![vllm_stored(&prompt, BLOCK, None, 1, "GPU")],
    );
    let body = completion(&prompt);
    assert!(wait_for_overlap(&envoy, &body, 8, Duration::from_secs(5)));
    // Two candidates: normalised costs 0 and 1, so p(best) = 1 / (1 + e^-1) = 0.731.
    let n = 400;
    let best = (0..n).filter(|_| route(&envoy, &body).0 == 1).count();
    let p = best as f64 / n as f64;
    assert!((p - 0.731).abs() < 0.07, "p(best) = {p}");
}

#[test]
fn two_envoys_fed_by_the_same_workers_agree() {
    let workers = echo_workers(3, BLOCK);
    // Events only: what the workers report is shared, each Envoy's own predictions are not.
    let a = kv_envoy_on_events(&workers, json!({}));
    let b = kv_envoy_on_events(&workers, json!({}));
    let prompts: Vec<Vec<u32>> = (0..9)
        .map(|i| tokens(10_000 * (i + 1), 6 * BLOCK))
        .collect();
    for (i, prompt) in prompts.iter().enumerate() {
        let owner = &workers[i % 3];
        publish(
            owner,
            vec![vllm_stored(
                &prompt[..(3 + i % 3) * BLOCK as usize],
                BLOCK,
                None,
                100 * i as u64,
                "GPU",
            )],
        );
    }
    for (i, prompt) in prompts.iter().enumerate() {
        let blocks = (3 + i % 3) as u32;
        assert!(wait_for_overlap(
            &a,
            &completion(prompt),
            blocks,
            Duration::from_secs(5)
        ));
        assert!(wait_for_overlap(
            &b,
            &completion(prompt),
            blocks,
            Duration::from_secs(5)
        ));
    }
    for (i, prompt) in prompts.iter().enumerate() {
        let body = completion(prompt);
        let (wa, oa, _) = route(&a, &body);
        let (wb, ob, _) = route(&b, &body);
        assert_eq!((wa, oa), (wb, ob), "prompt {i}");
        assert_eq!(wa, workers[i % 3].id);
    }
}

/// Reports how long a "stored" event takes to count for routing at the default settings.
#[test]
fn stored_event_counts_for_routing_quickly() {
    let workers = echo_workers(2, BLOCK);
    // Events only: the second probe would otherwise overlap its predecessor's predicted blocks,
    // timing the prediction instead of the event.
    let envoy = kv_envoy_on_events(&workers, json!({}));
    let mut delays = Vec::new();
    for round in 0..5u32 {
        let prompt = tokens(900_000 + round * 10_000, 4 * BLOCK);
        let body = completion(&prompt);
        let start = Instant::now();
        publish(
            &workers[1],
            vec![vllm_stored(
                &prompt,
                BLOCK,
                None,
                1000 * u64::from(round),
                "GPU",
            )],
        );
        assert!(wait_for_overlap(&envoy, &body, 4, Duration::from_secs(5)));
        delays.push(start.elapsed().as_millis());
    }
    delays.sort();
    println!(
        "stored-to-routable delay ms: {delays:?} (median {})",
        delays[2]
    );
    // The default poll (100 ms) and tick (50 ms) bound it near 150 ms; the slack absorbs a busy CI machine.
    assert!(delays[2] < 1000, "median {} ms", delays[2]);
}

#[test]
fn bad_event_pages_are_rejected_and_change_nothing() {
    let workers = echo_workers(2, BLOCK);
    // Events only: the probes' predicted blocks would outlive the removal that must land. A
    // reply limit below the mock's `oversized` fault (8 MiB of padding).
    let envoy = kv_envoy_on_events(
        &workers,
        json!({"events": {"max_response_bytes": 4_194_304}}),
    );
    let prompt = tokens(5, 6 * BLOCK);
    let body = completion(&prompt);
    publish(
        &workers[0],
        vec![vllm_stored(&prompt, BLOCK, None, 1, "GPU")],
    );
    assert!(wait_for_overlap(&envoy, &body, 6, Duration::from_secs(5)));
    for fault in ["malformed", "oversized", "wrong_block_size"] {
        let before = envoy.router_stat("events.pages_rejected");
        let resp = workers[0]
            .admin("/admin/events_fault", &json!({"mode": fault}))
            .expect("fault");
        assert_eq!(resp.status, 200);
        publish(&workers[0], vec![vllm_removed(&[1, 2, 3, 4, 5, 6], "GPU")]);
        assert!(
            envoy.wait_for(Duration::from_secs(5), |e| e
                .router_stat("events.pages_rejected")
                > before),
            "{fault}: rejected"
        );
        let (worker, overlap, _) = route(&envoy, &body);
        assert_eq!((worker, overlap), (1, 6), "{fault}: the index is unchanged");
        assert!(
            http::get(&envoy.admin, "/ready").is_ok_and(|r| r.status == 200),
            "{fault}: envoy alive"
        );
        workers[0]
            .admin("/admin/events_fault", &json!({"mode": "none"}))
            .expect("fault off");
        // The page that was refused is fetched again and now applies: the removal lands.
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut overlap = 6;
        while overlap != 0 && Instant::now() < deadline {
            overlap = route(&envoy, &body).1;
        }
        assert_eq!(overlap, 0, "{fault}: recovered");
        publish(
            &workers[0],
            vec![vllm_stored(&prompt, BLOCK, None, 1, "GPU")],
        );
        assert!(wait_for_overlap(&envoy, &body, 6, Duration::from_secs(5)));
    }
    assert!(envoy.router_stat("events.block_size_mismatch") >= 1);
    assert!(envoy.log().contains("block_size"), "the mismatch is logged");
}

#[test]
fn a_gap_in_event_ids_triggers_a_resync_from_the_dump() {
    let workers = echo_workers(1, BLOCK);
    // Events only: the probes' predicted blocks would keep the 5 blocks the dump drops.
    let envoy = kv_envoy_on_events(&workers, json!({}));
    let prompt = tokens(11, 5 * BLOCK);
    let body = completion(&prompt);
    publish(
        &workers[0],
        vec![vllm_stored(&prompt, BLOCK, None, 1, "GPU")],
    );
    assert!(wait_for_overlap(&envoy, &body, 5, Duration::from_secs(5)));
    let resyncs = envoy.router_stat("events.resyncs");
    // Events are lost; the worker's dump says only the first 2 blocks remain.
    workers[0]
        .admin("/admin/drop_events", &json!({"count": 3}))
        .expect("drop");
    let dump = json!({"block_size": BLOCK, "last_event_id": 4,
        "events": [vllm_stored(&prompt[..(2 * BLOCK) as usize], BLOCK, None, 1, "GPU")]});
    workers[0].admin("/admin/dump", &dump).expect("dump");
    publish(&workers[0], vec![vllm_removed(&[99], "GPU")]);
    assert!(
        envoy.wait_for(Duration::from_secs(5), |e| e.router_stat("events.resyncs")
            > resyncs)
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut overlap = 5;
    while overlap != 2 && Instant::now() < deadline {
        overlap = route(&envoy, &body).1;
    }
    assert_eq!(overlap, 2, "the index follows the dump");
}

#[test]
fn a_worker_whose_events_fail_goes_stale_and_loses_its_blocks() {
    let workers = echo_workers(2, BLOCK);
    // Events only: a probe predicted on worker 2 would give overlap while worker 1 is stale, and
    // the re-sync would be "seen" without the dump.
    let envoy = kv_envoy_on_events(&workers, json!({"events": {"stale_after_ms": 600}}));
    let prompt = tokens(21, 4 * BLOCK);
    let body = completion(&prompt);
    publish(
        &workers[0],
        vec![vllm_stored(&prompt, BLOCK, None, 1, "GPU")],
    );
    assert!(wait_for_overlap(&envoy, &body, 4, Duration::from_secs(5)));
    workers[0]
        .admin("/admin/events_fault", &json!({"mode": "http_500"}))
        .expect("fault");
    assert!(
        envoy.wait_for(Duration::from_secs(5), |e| e.router_stat("workers.stale")
            == 1)
    );
    assert_eq!(
        route(&envoy, &body).1,
        0,
        "a stale worker's blocks no longer count"
    );
    workers[0]
        .admin("/admin/events_fault", &json!({"mode": "none"}))
        .expect("fault off");
    assert!(
        envoy.wait_for(Duration::from_secs(5), |e| e.router_stat("workers.stale")
            == 0)
    );
    assert!(
        wait_for_overlap(&envoy, &body, 4, Duration::from_secs(5)),
        "re-synced from the dump"
    );
}

#[test]
fn text_only_requests_route_on_load_and_say_so() {
    let workers = echo_workers(2, BLOCK);
    // Events only (no approximate mode): the text-only path, without a tokenizer, is the subject.
    let envoy = kv_envoy_on_events(&workers, json!({}));
    let body = json!({"model": "mock", "prompt": "Hello there, a text prompt without token ids"});
    let (_, overlap, resp) = route(&envoy, &body);
    assert_eq!(overlap, 0);
    assert_eq!(resp.header("x-kv-router-reason"), Some("kv-text-only"));
    // Per-request counters reach the host on the VM's tick.
    assert!(envoy.wait_for(Duration::from_secs(5), |e| e
        .router_stat("routed.kv-text-only")
        >= 1));
    // At the defaults (`events+approximate`) the same request is hashed as text instead.
    let envoy = kv_envoy(&workers, json!({}));
    let (_, overlap, resp) = route(&envoy, &body);
    assert_eq!(overlap, 0);
    assert_eq!(resp.header("x-kv-router-reason"), Some("kv-text"));
    assert!(
        envoy.wait_for(Duration::from_secs(5), |e| e.router_stat("routed.kv-text")
            >= 1)
    );
}

/// The chosen worker is down: Envoy retries on the next address of the destination list, and the
/// filter moves the request's load booking (and its response header) to the worker that answered.
#[test]
fn a_retry_on_a_fallback_worker_moves_the_booking() {
    let mut workers = echo_workers(2, BLOCK);
    // Events only: a probe predicted on worker 2 would give it the prefix, and no retry happen.
    let envoy = kv_envoy_on_events(&workers, json!({}));
    let prompt = tokens(31, 8 * BLOCK);
    let body = completion(&prompt);
    publish(
        &workers[0],
        vec![vllm_stored(&prompt, BLOCK, None, 1, "GPU")],
    );
    assert!(wait_for_overlap(&envoy, &body, 8, Duration::from_secs(5)));
    workers[0].kill();
    // Within stale_after_ms the index still prefers worker 1.
    let (worker, overlap, resp) = route(&envoy, &body);
    assert_eq!(overlap, 8, "worker 1 was chosen");
    assert_eq!(worker, 2, "served by the fallback");
    assert_eq!(resp.header("x-kv-router-worker"), Some("2"));
    assert!(envoy.router_stat("load.moved_on_retry") >= 1);
    assert!(envoy.wait_for(Duration::from_secs(3), |e| {
        e.router_stat("load.active_entries") == 0
            && e.router_stat("worker.1.rank.0.active_requests") == 0
    }));
}

#[test]
fn an_inconsistent_event_is_rejected_and_changes_nothing() {
    let workers = echo_workers(2, BLOCK);
    // Events only: the probes' predicted blocks would keep the overlap whether the removal
    // applied or not.
    let envoy = kv_envoy_on_events(&workers, json!({}));
    let prompt = tokens(61, 4 * BLOCK);
    let body = completion(&prompt);
    publish(
        &workers[0],
        vec![vllm_stored(&prompt, BLOCK, None, 1, "GPU")],
    );
    assert!(wait_for_overlap(&envoy, &body, 4, Duration::from_secs(5)));
    let before = envoy.router_stat("events.pages_rejected");
    // Three block hashes but two blocks of tokens, next to a valid removal in the same page.
    let mut bad = vllm_stored(&tokens(9000, 2 * BLOCK), BLOCK, Some(4), 50, "GPU");
    bad["block_hashes"] = json!([50, 51, 52]);
    publish(&workers[0], vec![vllm_removed(&[1, 2, 3, 4], "GPU"), bad]);
    assert!(envoy.wait_for(Duration::from_secs(5), |e| e
        .router_stat("events.pages_rejected")
        > before));
    assert_eq!(
        route(&envoy, &body).1,
        4,
        "the whole page was refused: the removal did not apply"
    );
    assert!(
        envoy.log().contains("rejected an event page from worker 1"),
        "logged for the operator"
    );
}

/// A LoRA adapter salts the block hashes (as Dynamo does): its cached blocks only match requests
/// for the same adapter.
#[test]
fn lora_adapters_salt_the_hashes() {
    let workers = echo_workers(2, BLOCK);
    // Events only: a probe routed to worker 1 before the event lands would be predicted there.
    let envoy = kv_envoy_on_events(&workers, json!({}));
    let prompt = tokens(71, 5 * BLOCK);
    let mut event = vllm_stored(&prompt, BLOCK, None, 1, "GPU");
    event["lora_name"] = json!("sql-adapter");
    publish(&workers[1], vec![event]);
    let mut with_lora = completion(&prompt);
    with_lora["nvext"] = json!({"lora_name": "sql-adapter"});
    assert!(wait_for_overlap(
        &envoy,
        &with_lora,
        5,
        Duration::from_secs(5)
    ));
    assert_eq!(route(&envoy, &with_lora).0, 2);
    assert_eq!(
        route(&envoy, &completion(&prompt)).1,
        0,
        "the base model does not match"
    );
    let mut other = completion(&prompt);
    other["nvext"] = json!({"lora_name": "chat-adapter"});
    assert_eq!(route(&envoy, &other).1, 0, "another adapter does not match");
}

#[test]
fn an_index_too_small_for_the_fleets_caches_is_logged_and_routing_goes_on() {
    let workers = echo_workers(2, BLOCK);
    let mut config = filter_config(&workers, json!({"index": {"max_blocks": 1500}}));
    for w in config["workers"].as_array_mut().expect("workers") {
        w["kv_capacity_blocks"] = json!(1000);
    }
    let envoy = start_envoy(&workers, config);
    assert!(
        envoy.wait_for(Duration::from_secs(10), |e| e
            .log()
            .contains("index.max_blocks (1500) is below the 2000 device blocks")),
        "the undersized index is named in Envoy's log"
    );
    let (worker, _, resp) = route(&envoy, &completion(&tokens(1, 4 * BLOCK)));
    assert_eq!(resp.status, 200);
    assert!(worker == 1 || worker == 2);
}
