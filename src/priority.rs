//! The scheduling priority the filter writes into a routed request's body (`engine_priority`).
//! Pure.
//!
//! An engine schedules its waiting requests in arrival order by default, so a short prompt that
//! arrives behind a long one waits for all of its prefill. vLLM started with
//! `--scheduling-policy priority` admits the lowest `priority` first (then by arrival), and the
//! filter knows what each request will cost the worker it chose: the prefill of its uncached
//! tokens there. Writing that cost as the priority makes the engine serve the shortest prefill
//! first, which minimises the mean wait; `arrival_weight` mixes arrival time back in, so that a
//! long prompt is overtaken only by prompts that arrive within `arrival_weight` times its extra
//! prefill time after it.
//!
//! ```text
//! priority = round(1000 * (predicted_prefill_ms + arrival_weight * (now_ms - EPOCH_MS)))
//! ```
//!
//! (microseconds, so that prompts a block apart still differ). The field goes first in the JSON
//! object: a `priority` the client wrote itself comes later and wins (the last duplicate key
//! wins in Python's and serde's JSON objects).

use crate::config::EnginePriorityConfig;

/// 2025-01-01T00:00:00Z in Unix milliseconds: keeps arrival-weighted priorities small.
pub const EPOCH_MS: u64 = 1_735_689_600_000;

/// The prefill (ms) a request is given when the filter routes it without pricing it (the
/// fallback rule: a body too large to read, a field it could not parse). Without a priority the
/// engine would serve it first (vLLM's default priority 0 is the lowest value written), and the
/// largest bodies are the ones most likely to fall back. Ten minutes: after every prefill the
/// filter priced, in arrival order among such requests.
pub const UNPRICED_PREFILL_MS: f64 = 600_000.0;

/// The priority of a request whose uncached tokens take `predicted_prefill_ms` on its worker,
/// routed at `now_ms` (Unix). `0..=2^53`, lower is served first.
pub fn request_priority(
    config: &EnginePriorityConfig,
    predicted_prefill_ms: f64,
    now_ms: u64,
) -> i64 {
    let work = if predicted_prefill_ms.is_finite() {
        predicted_prefill_ms.max(0.0)
    } else {
        0.0
    };
    let since_epoch = now_ms.saturating_sub(EPOCH_MS) as f64;
    let us = 1000.0 * (work + config.arrival_weight * since_epoch);
    // 2^53: exact in an f64 and far inside int64 (vLLM's range).
    const MAX: f64 = 9_007_199_254_740_992.0;
    us.round().clamp(0.0, MAX) as i64
}

/// How to put the priority into a body: remove the first `drain` bytes and put `insert` in their
/// place (the one body edit Envoy's proxy-wasm buffer supports in the middle of a request: at
/// offset 0).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Splice {
    pub drain: usize,
    pub insert: Vec<u8>,
}

/// The splice that makes `"priority":P` the first member of the JSON object whose first bytes
/// are `head`; `None` when `head` does not start (after whitespace) with `{` followed, within
/// `head`, by a member or `}`.
pub fn splice_priority(head: &[u8], priority: i64) -> Option<Splice> {
    let is_ws = |b: &u8| matches!(b, b' ' | b'\t' | b'\n' | b'\r');
    let open = head.iter().position(|b| !is_ws(b))?;
    if head.get(open) != Some(&b'{') {
        return None;
    }
    let after = head.get(open + 1..)?;
    let next = after.iter().find(|b| !is_ws(b))?;
    let separator = if *next == b'}' { "" } else { "," };
    Some(Splice {
        drain: open + 1,
        insert: format!("{{\"priority\":{priority}{separator}").into_bytes(),
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    fn apply(body: &str, priority: i64) -> Option<String> {
        let s = splice_priority(body.as_bytes(), priority)?;
        let mut out = s.insert.clone();
        out.extend_from_slice(body.as_bytes().get(s.drain..)?);
        String::from_utf8(out).ok()
    }

    #[test]
    fn the_priority_becomes_the_objects_first_member() {
        let body = r#"{"model":"m","prompt":[1,2,3]}"#;
        let out = apply(body, 1234).unwrap();
        assert_eq!(out, r#"{"priority":1234,"model":"m","prompt":[1,2,3]}"#);
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["priority"], 1234);
        assert_eq!(v["prompt"][2], 3);
        assert_eq!(apply(" \n{ }", 7).unwrap(), r#"{"priority":7 }"#);
        assert_eq!(
            apply("\t{\n\"a\":1}", 0).unwrap(),
            "{\"priority\":0,\n\"a\":1}"
        );
    }

    #[test]
    fn an_unpriced_request_comes_after_every_priced_one() {
        let sjf = EnginePriorityConfig {
            arrival_weight: 0.0,
        };
        let now = EPOCH_MS + 10_000;
        // A 1M-token prompt at the mocker's polynomial (one pass): ~436 s.
        let longest = 4.21e-7 * 1e12 + 0.0152 * 1e6 + 16.5;
        assert!(
            request_priority(&sjf, UNPRICED_PREFILL_MS, now) > request_priority(&sjf, longest, now)
        );
    }

    #[test]
    fn a_clients_own_priority_still_wins() {
        let out = apply(r#"{"priority":-5,"model":"m"}"#, 99).unwrap();
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["priority"], -5);
    }

    #[test]
    fn a_body_that_is_not_an_object_is_left_alone() {
        assert_eq!(splice_priority(b"[1,2]", 1), None);
        assert_eq!(splice_priority(b"   ", 1), None);
        assert_eq!(splice_priority(b"{   ", 1), None);
        assert_eq!(splice_priority(b"", 1), None);
    }

    #[test]
    fn shorter_prefills_come_first_and_arrival_mixes_in_by_its_weight() {
        let sjf = EnginePriorityConfig {
            arrival_weight: 0.0,
        };
        let now = EPOCH_MS + 10_000;
        assert_eq!(request_priority(&sjf, 12.3456, now), 12_346);
        assert!(request_priority(&sjf, 5.0, now + 999) < request_priority(&sjf, 6.0, now));
        // Weight 1: a later arrival overtakes only if its prefill is shorter by more than the gap.
        let edf = EnginePriorityConfig {
            arrival_weight: 1.0,
        };
        let long = request_priority(&edf, 100.0, now);
        assert!(request_priority(&edf, 10.0, now + 80) < long);
        assert!(request_priority(&edf, 10.0, now + 95) > long);
        assert_eq!(request_priority(&sjf, f64::NAN, now), 0);
        assert_eq!(request_priority(&sjf, -3.0, now), 0);
        let far = EnginePriorityConfig {
            arrival_weight: 1000.0,
        };
        assert_eq!(
            request_priority(&far, f64::MAX, u64::MAX),
            9_007_199_254_740_992
        );
    }
}
