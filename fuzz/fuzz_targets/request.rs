//! Request bodies: never panics, and the fast token-id scan agrees with the serde reference
//! parser (the same request, or both errors); the client's `priority` members the parse records
//! are the ones the structural search finds, and removing them leaves valid JSON.
#![no_main]
use envoy_kv_router::priority::{find_client_priority, replace_client_priority};
use envoy_kv_router::request::{
    parse_request, parse_request_serde, parse_request_with, Endpoint, ParseOptions,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // First byte picks the endpoint and option set; the rest is the body.
    let Some((&sel, body)) = data.split_first() else {
        return;
    };
    let endpoint = if sel & 1 == 0 {
        Endpoint::Completions
    } else {
        Endpoint::ChatCompletions
    };
    let fast = parse_request(body, endpoint);
    let reference = parse_request_serde(body, endpoint);
    match (&fast, &reference) {
        (Ok(a), Ok(b)) => assert_eq!(a, b, "fast path and serde disagree"),
        (Err(_), Err(_)) => {}
        _ => panic!("fast path {fast:?} vs serde {reference:?}"),
    }
    if let Ok(request) = &fast {
        // The fallback rule's structural search finds the `priority` members the parse records,
        // and removing them (the filter's put first) leaves valid JSON with only the filter's.
        assert_eq!(
            find_client_priority(body).as_ref(),
            Some(&request.client_priority),
            "structural search and parse disagree"
        );
        let splice = replace_client_priority(body, &request.client_priority, Some(7))
            .expect("the parsed members are removable");
        let mut edited = splice.insert;
        edited.extend_from_slice(body.get(splice.drain..).unwrap_or_default());
        // (Bodies serde's `Value` reads: the parse skips some strings without checking them.)
        if serde_json::from_slice::<serde_json::Value>(body).is_ok() {
            let value: serde_json::Value =
                serde_json::from_slice(&edited).expect("the edited body is JSON");
            assert_eq!(value["priority"], 7, "the filter's priority is the body's");
        }
    }
    let opts = ParseOptions {
        read_hints: sel & 2 == 0,
        max_hint_items: usize::from(sel >> 4),
        lazy_token_ids: false,
    };
    let eager = parse_request_with(body, endpoint, &opts);
    // Ids left in the body (as the filter parses): the same answer once they are read.
    let lazy = parse_request_with(
        body,
        endpoint,
        &ParseOptions {
            lazy_token_ids: true,
            ..opts
        },
    )
    .and_then(|mut r| {
        if let Some(span) = r.token_span.take() {
            match span.ids(body) {
                Some(ids) => r.token_ids = Some(ids),
                // Not an array of ids after all: the filter parses the body again, eagerly.
                None => return parse_request_with(body, endpoint, &opts),
            }
        }
        Ok(r)
    });
    assert_eq!(lazy, eager, "lazy and eager parses disagree");
});
