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
            .starts_with("membership.worker.device: unknown value")
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
