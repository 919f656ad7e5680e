use super::*;
use crate::config::Config;

fn config() -> Config {
    Config::from_json(
        br#"{"workers": [{"id": 1, "address": "10.0.0.1:8000", "events_address": "10.0.0.1:9000"}],
             "membership": {"cluster": "llm", "max_workers": 2, "events_port": 7000,
                            "worker": {"dp_size": 2, "device": "cpu"}}}"#,
    )
    .unwrap()
}

fn host(addr: &str, healthy: bool) -> Host {
    Host {
        address: addr.parse().unwrap(),
        healthy,
    }
}

fn admin(hosts: &str) -> Vec<u8> {
    format!(
        r#"{{"cluster_statuses": [{{"name": "other", "host_statuses": []}},
             {{"name": "llm", "added_via_api": true, "host_statuses": [{hosts}]}}]}}"#
    )
    .into_bytes()
}

#[test]
fn pool_entries_follow_the_template_and_start_vacant() {
    let c = config();
    assert_eq!(c.workers.len(), 3);
    assert_eq!(c.slots.len(), 1 + 2 * 2);
    assert_eq!(c.workers[1].id, 2, "pool ids follow the static ones");
    assert_eq!(c.workers[2].id, 3);
    assert_eq!(c.workers[1].dp_size, 2);
    assert!(c.workers[1].is_vacant() && !c.workers[1].routable);
    assert!(c.workers[0].routable && !c.workers[0].is_vacant());
    // Before the first table, the configuration as compiled.
    let e = effective_config(&c, &LogHead::default());
    assert!(e.workers[0].routable);
    assert!(e.workers[1].is_vacant());
}

#[test]
fn membership_config_errors_name_their_field() {
    let err = |j: &str| Config::from_json(j.as_bytes()).unwrap_err().to_string();
    assert_eq!(
        err(r#"{"membership": {}}"#),
        "membership.cluster: required field is missing"
    );
    assert!(
        err(r#"{"membership": {"cluster": "c", "worker": {"device": "tpu"}}}"#)
            .starts_with("membership.worker.device: unknown variant")
    );
    assert!(
        err(r#"{"membership": {"cluster": "c", "worker": {"id": 3}}}"#)
            .starts_with("membership.worker.id: unknown field")
    );
    assert!(err(r#"{"membership": {"cluster": "c", "max_workers": 0}}"#)
        .starts_with("membership.max_workers: must be within [1, 4096]"));
    assert!(err(
        r#"{"workers": [{"id": 5, "address": "10.0.0.1:80"}], "membership": {"cluster": "c", "first_id": 4}}"#
    )
    .starts_with("membership.first_id: pool ids 4..=19 include static worker id 5"));
    // Workers may be omitted entirely.
    let c = Config::from_json(br#"{"membership": {"cluster": "c", "max_workers": 3}}"#).unwrap();
    assert_eq!(
        c.workers.iter().map(|w| w.id).collect::<Vec<_>>(),
        vec![1, 2, 3]
    );
    assert!(err(r#"{}"#).starts_with("workers: required"));
}

#[test]
fn a_described_pool_entry_uses_its_description_and_a_static_entry_its_config() {
    use crate::events::parse_event_page;
    use description::{vet, Refusal};
    let c = config();
    let mut head = LogHead::default();
    apply(
        &c,
        &mut head,
        &[host("10.0.0.1:8000", true), host("10.0.0.7:8000", true)],
        0,
    );
    let pool = 1u16;
    assert_eq!(
        head.workers[1].member.as_ref().unwrap().address,
        "10.0.0.7:8000"
    );
    let page = parse_event_page(
        br#"{"block_size": 16, "last_event_id": 0, "events": [],
             "worker": {"block_size": 16, "dp_size": 4, "device": "gpu", "kv_capacity_blocks": 900,
                        "max_num_batched_tokens": 4096, "models": ["m-only-here"], "future": 1,
                        "prefill_time_ms_poly": [4, 0.004], "decode_step_ms_poly": [1.5, 13]}}"#,
        16,
        1 << 20,
    )
    .unwrap();
    let (vetted, refused) = vet(&c.workers[1], 16, page.worker.as_ref().unwrap());
    assert_eq!(
        refused,
        vec![Refusal::Layout {
            template: (0, 2),
            described: (0, 4)
        }]
    );
    let generation = head.members_generation;
    set_description(&mut head, pool, &vetted);
    assert_eq!(head.members_generation, generation + 1);
    set_description(&mut head, pool, &vetted);
    assert_eq!(
        head.members_generation,
        generation + 1,
        "unchanged: no bump"
    );
    // A static entry never takes a description, even if one is recorded.
    set_description(&mut head, 0, &vetted);
    let e = effective_config(&c, &head);
    let w = &e.workers[1];
    assert_eq!(w.models, vec!["m-only-here".to_string()]);
    assert_eq!(w.kv_capacity_blocks, Some(900));
    assert_eq!(w.max_num_batched_tokens, Some(4096));
    assert_eq!(w.prefill_poly(&[16.5]), &[4.0, 0.004][..]);
    assert_eq!(w.decode_poly(&[5.74]), &[1.5, 13.0][..]);
    assert_eq!(e.workers[0].prefill_poly(&[16.5]), &[16.5][..]);
    assert_eq!(w.device, crate::config::Device::Gpu);
    assert_eq!(w.dp_size, 2, "slots are fixed: the template's layout stays");
    assert!(e.workers[0].models.is_empty());
    assert_eq!(e.workers[0].kv_capacity_blocks, None);
    assert_eq!(e.slots, c.slots);
    // A page without a description, or with a malformed one, still parses.
    let plain =
        parse_event_page(br#"{"block_size": 16, "last_event_id": 0}"#, 16, 1 << 20).unwrap();
    assert!(plain.worker.is_none() && plain.invalid_worker.is_none());
    let bad = parse_event_page(
        br#"{"block_size": 16, "last_event_id": 0, "worker": {"models": "x"}}"#,
        16,
        1 << 20,
    )
    .unwrap();
    assert!(bad.worker.is_none() && bad.invalid_worker.is_some());
    // Oversized model lists and zero capacities are refused field by field.
    let many = description::WorkerDescription {
        models: Some(vec!["m".into(); description::MAX_MODELS + 1]),
        kv_capacity_blocks: Some(0),
        max_num_batched_tokens: Some(8),
        ..Default::default()
    };
    let (v, r) = vet(&c.workers[1], 16, &many);
    assert_eq!(r.len(), 2);
    assert_eq!(
        (v.models, v.kv_capacity_blocks, v.max_num_batched_tokens),
        (None, None, Some(8))
    );
    // So are timing polynomials without 1 to 8 finite coefficients.
    let timing = description::WorkerDescription {
        prefill_time_ms_poly: Some(vec![1.0; 9]),
        decode_step_ms_poly: Some(vec![]),
        ..Default::default()
    };
    let (v, r) = vet(&c.workers[1], 16, &timing);
    assert_eq!(
        r,
        vec![
            Refusal::Polynomial {
                field: "prefill_time_ms_poly"
            },
            Refusal::Polynomial {
                field: "decode_step_ms_poly"
            }
        ]
    );
    assert_eq!(
        (v.prefill_time_ms_poly, v.decode_step_ms_poly),
        (None, None)
    );
}

#[test]
fn admin_reply_gives_hosts_with_health() {
    let body = admin(
        r#"{"address": {"socket_address": {"address": "10.0.0.5", "port_value": 8000}},
            "stats": [{"name": "cx_active", "value": "1"}],
            "health_status": {"eds_health_status": "HEALTHY"}, "weight": 1},
           {"address": {"socket_address": {"address": "10.0.0.6", "port_value": 8000}},
            "health_status": {"failed_active_health_check": true, "eds_health_status": "HEALTHY"}},
           {"address": {"socket_address": {"address": "10.0.0.7", "port_value": 8000}},
            "health_status": {"failed_outlier_check": true}},
           {"address": {"socket_address": {"address": "10.0.0.8", "port_value": 8000}},
            "health_status": {"eds_health_status": "DRAINING"}},
           {"address": {"socket_address": {"address": "10.0.0.9", "port_value": 8000}},
            "health_status": {"pending_dynamic_removal": true}},
           {"address": {"pipe": {"path": "/tmp/x"}}},
           {"address": {"socket_address": {"address": "10.0.0.5", "port_value": 8000}}}"#,
    );
    let hosts = parse_admin_clusters(&body, "llm").unwrap();
    assert_eq!(
        hosts,
        vec![
            host("10.0.0.5:8000", true),
            host("10.0.0.6:8000", false),
            host("10.0.0.7:8000", false),
            host("10.0.0.8:8000", false),
        ]
    );
    assert_eq!(
        parse_admin_clusters(&body, "nope").unwrap_err(),
        MembershipError::ClusterNotFound {
            cluster: "nope".to_string()
        }
    );
    assert!(matches!(
        parse_admin_clusters(b"{", "llm"),
        Err(MembershipError::InvalidJson { .. })
    ));
}

#[test]
fn joins_leaves_and_health_keep_a_fixed_pool_with_generations() {
    let c = config();
    let mut head = LogHead::default();
    // The static worker's address and two new hosts; the pool has room for two.
    let ch = apply(
        &c,
        &mut head,
        &[
            host("10.0.0.1:8000", true),
            host("10.0.0.2:8000", true),
            host("10.0.0.3:8000", false),
        ],
        5,
    );
    assert_eq!(ch.joined, vec![0, 1, 2]);
    assert!(ch.left.is_empty() && ch.first_table);
    let m1 = head.workers[1].member.clone().unwrap();
    assert_eq!(m1.address, "10.0.0.2:8000");
    assert_eq!(m1.events_address, "10.0.0.2:7000", "events_port template");
    assert_eq!(
        head.workers[0].member.as_ref().unwrap().events_address,
        "10.0.0.1:9000"
    );
    let e = effective_config(&c, &head);
    assert_eq!(e.workers[1].address_text, "10.0.0.2:8000");
    assert!(e.workers[1].routable);
    assert!(!e.workers[2].routable, "unhealthy while others are healthy");

    // Same table again: nothing to publish.
    let same = apply(
        &c,
        &mut head,
        &[
            host("10.0.0.1:8000", true),
            host("10.0.0.2:8000", true),
            host("10.0.0.3:8000", false),
        ],
        6,
    );
    assert!(same.is_empty(), "{same:?}");

    // 10.0.0.2 leaves, 10.0.0.4 joins and takes its entry under a new generation; a fifth host
    // finds the pool full.
    head.workers[1].cursor = Some(40);
    let ch = apply(
        &c,
        &mut head,
        &[
            host("10.0.0.1:8000", true),
            host("10.0.0.3:8000", true),
            host("10.0.0.4:8000", true),
            host("10.0.0.5:8000", true),
        ],
        7,
    );
    assert_eq!(ch.left, vec![1]);
    assert_eq!(ch.joined, vec![1]);
    assert_eq!(ch.health_changed, 1);
    assert_eq!(ch.pool_full, 1);
    assert_eq!(ch.cleared(), vec![1]);
    let m = head.workers[1].member.clone().unwrap();
    assert_eq!(m.address, "10.0.0.4:8000");
    assert!(m.generation > m1.generation);
    assert_eq!(
        head.workers[1].cursor, None,
        "a new occupant syncs from its dump"
    );
    assert_eq!(head.workers.len(), 3, "the table never grows");

    // Everyone gone but one unhealthy host: it stays routable (nothing better exists).
    let ch = apply(&c, &mut head, &[host("10.0.0.3:8000", false)], 8);
    assert_eq!(ch.left, vec![0, 1]);
    let e = effective_config(&c, &head);
    assert!(
        e.workers[0].is_vacant() && !e.workers[0].routable,
        "static worker not listed"
    );
    assert!(e.workers[2].routable);
}

mod churn {
    use super::*;
    use crate::events::{IndexEvent, LogRecord, NumberedEvent};
    use crate::load_store;
    use crate::replication::log::{self as replication, Replica};
    use crate::store::fake::MemStore;
    use crate::types::{ExternalBlockHash, LocalBlockHash, StorageTier};

    const FP: u64 = 7;

    /// The poller's append of one event page for `worker`, made for occupant `generation`.
    fn store_block(store: &MemStore, c: &Config, worker: u16, generation: u64, id: u64) -> bool {
        let record = LogRecord::Events {
            worker,
            events: vec![NumberedEvent {
                event_id: id,
                event: IndexEvent::Stored {
                    dp_rank: 0,
                    tier: StorageTier::Device,
                    parent: None,
                    blocks: vec![(ExternalBlockHash(id), LocalBlockHash(id))],
                },
            }],
        };
        replication::append(store, FP, c.workers.len(), id, &[record], |head| {
            if head.member_generation(worker) != generation {
                return false;
            }
            head.workers[usize::from(worker)].cursor = Some(id);
            true
        })
    }

    fn entry_of(head: &LogHead, addr: &str) -> Option<u16> {
        head.workers
            .iter()
            .position(|w| w.member.as_ref().is_some_and(|m| m.address == addr))
            .map(|i| i as u16)
    }

    /// A leave clears its worker's load in the one shard key holding its slots: at 300 pool
    /// entries (three shards), the other shards are not rewritten.
    #[test]
    fn a_leave_rewrites_only_the_load_shard_of_its_slots() {
        use crate::store::SharedStore;
        let c = Config::from_json(
            br#"{"membership": {"cluster": "llm", "max_workers": 300, "events_port": 7000}}"#,
        )
        .unwrap();
        assert_eq!(load_store::shard_count(c.slots.len()), 3);
        let store = MemStore::new();
        replication::init(&store);
        load_store::init(&store, c.slots.len(), c.load.request_timeout_ms);
        let mut replica = Replica::new(&c, FP);
        let hosts: Vec<Host> = (0..200)
            .map(|i| host(&format!("10.0.{}.{}:8000", i / 100, i % 100 + 1), true))
            .collect();
        publish(&store, FP, &c, &replica.head, &hosts, 1).unwrap();
        replica.sync(&store, &c, 1);
        let leaver = entry_of(&replica.head, "10.0.1.50:8000").unwrap();
        let slot = c.worker_slots(leaver).start;
        load_store::update_slot(&store, c.slots.len(), slot, 2, |t| {
            t.admit(2, slot, 100, 2, None, 2)
        })
        .unwrap();
        let versions = |store: &MemStore| -> Vec<Option<u32>> {
            (0..3)
                .map(|shard| store.get(&load_store::shard_key(shard)).1)
                .collect()
        };
        let before = versions(&store);
        let rest: Vec<Host> = hosts
            .iter()
            .filter(|h| h.address.to_string() != "10.0.1.50:8000")
            .cloned()
            .collect();
        let done = publish(&store, FP, &c, &replica.head, &rest, 3).unwrap();
        assert_eq!(done.changes.left, vec![leaver]);
        assert_eq!(done.load_cleared, 1);
        let after = versions(&store);
        let own = usize::from(slot) / load_store::SHARD_SLOTS;
        for shard in 0..3 {
            assert_eq!(
                before[shard] != after[shard],
                shard == own,
                "shard {shard} (the leaver's: {own}) {before:?} -> {after:?}"
            );
        }
    }

    /// A host flapping 200 times: the shared-data key set, the head's table and the load table
    /// stay the same size; the departed host leaves no blocks and no load; a reply made for an
    /// earlier occupant is refused.
    #[test]
    fn flapping_keeps_keys_fixed_and_leaves_nothing_behind() {
        let c = config();
        let store = MemStore::new();
        replication::init(&store);
        load_store::init(&store, c.slots.len(), c.load.request_timeout_ms);
        let mut replica = Replica::new(&c, FP);
        let (a, b) = (host("10.0.0.2:8000", true), host("10.0.0.3:8000", true));
        publish(&store, FP, &c, &replica.head, std::slice::from_ref(&b), 1).unwrap();
        replica.sync(&store, &c, 1);
        let keys = store.key_count();
        let mut stale_generation = None;
        for round in 0..200u64 {
            let hosts = if round % 2 == 0 {
                vec![a.clone(), b.clone()]
            } else {
                vec![b.clone()]
            };
            let now = 10 + round * 10;
            let done = publish(&store, FP, &c, &replica.head, &hosts, now).unwrap();
            replica.sync(&store, &c, now);
            if let Some(entry) = entry_of(&replica.head, "10.0.0.2:8000") {
                assert_eq!(done.changes.joined, vec![entry]);
                let generation = replica.head.member_generation(entry);
                assert!(store_block(&store, &c, entry, generation, now + 1));
                let slot = c.worker_slots(entry).start;
                load_store::update_slot(&store, c.slots.len(), slot, now, |t| {
                    t.admit(now, slot, 100, 2, None, now)
                })
                .unwrap();
                replica.sync(&store, &c, now + 1);
                assert_eq!(replica.index.entries(), 1);
                stale_generation = Some((entry, generation));
            } else {
                assert_eq!(done.changes.left.len(), 1);
                assert_eq!(done.load_cleared, 1, "its in-flight load goes at once");
                assert_eq!(replica.index.entries(), 0, "its blocks left the index");
                let view = load_store::view(&store, c.slots.len(), now);
                assert!(view.iter().all(|l| l.active_requests == 0));
            }
        }
        assert_eq!(
            store.key_count(),
            keys,
            "no shared-data key per join or leave"
        );
        assert_eq!(replica.head.workers.len(), c.workers.len());
        // A page fetched for the last occupant, answered after it left and another took the entry.
        let (entry, old) = stale_generation.unwrap();
        publish(
            &store,
            FP,
            &c,
            &replica.head,
            &[b.clone(), host("10.0.0.9:8000", true)],
            5000,
        )
        .unwrap();
        replica.sync(&store, &c, 5000);
        assert_eq!(entry_of(&replica.head, "10.0.0.9:8000"), Some(entry));
        assert!(
            !store_block(&store, &c, entry, old, 5001),
            "a late reply for the old occupant is dropped"
        );
        replica.sync(&store, &c, 5001);
        assert_eq!(replica.index.entries(), 0);
    }
}
