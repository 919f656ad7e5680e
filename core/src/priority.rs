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
//! object.
//!
//! A `priority` the client wrote itself would come later and win (the last duplicate key wins
//! in Python's and serde's JSON objects): it is a routing hint. With `client_routing_hints:
//! honor` it stays; otherwise the client's top-level `priority` members are removed in the same
//! edit ([`replace_client_priority`]: the parser records where their values are,
//! `LlmRequest::client_priority`; [`find_client_priority`] finds them in a body the parser did
//! not read).

use std::ops::Range;

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
    let is_ws = |b: &u8| is_json_ws(*b);
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

/// JSON whitespace (RFC 8259).
fn is_json_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

/// The offset of the last non-whitespace byte of `body[..end]`.
fn last_non_ws(body: &[u8], end: usize) -> Option<usize> {
    body.get(..end)?.iter().rposition(|&b| !is_json_ws(b))
}

/// One member of an object: the offsets of its key's opening quote, of the end of its value,
/// and of the separators around it (`{` or `,` before it, `,` or `}` after it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Member {
    key: usize,
    end: usize,
    before: usize,
    after: usize,
}

/// The member of an object in `body` whose value is at `value`; `None` if the bytes around
/// `value` are not those of a member (`"key" : value` between separators).
fn member_at(body: &[u8], value: &Range<usize>) -> Option<Member> {
    if value.start >= value.end {
        return None;
    }
    let after = value.end
        + body
            .get(value.end..)?
            .iter()
            .position(|&b| !is_json_ws(b))?;
    let colon = last_non_ws(body, value.start)?;
    let close = last_non_ws(body, colon)?;
    if !matches!(body.get(after), Some(b',' | b'}'))
        || body.get(colon) != Some(&b':')
        || body.get(close) != Some(&b'"')
    {
        return None;
    }
    // The key's opening quote: the last `"` before its closing one that no backslash escapes
    // (an even run of backslashes before it is escaped backslashes; outside a string, before a
    // key, there are none).
    let mut at = close;
    let key = loop {
        let quote = body.get(..at)?.iter().rposition(|&b| b == b'"')?;
        let backslashes = body
            .get(..quote)?
            .iter()
            .rev()
            .take_while(|&&b| b == b'\\')
            .count();
        if backslashes % 2 == 0 {
            break quote;
        }
        at = quote;
    };
    let before = last_non_ws(body, key)?;
    matches!(body.get(before), Some(b'{' | b',')).then_some(Member {
        key,
        end: value.end,
        before,
        after,
    })
}

/// The one edit (from the body's start, see [`Splice`]) that removes the client's own top-level
/// `priority` members (their values at `client`, byte ranges of `body` in body order, as
/// `LlmRequest::client_priority` records them) from the JSON object `body` starts with, and
/// makes `"priority":P` its first member when `priority` is given. The object stays valid JSON
/// whichever members go (first, last, the only one, several). Without `client` members this is
/// [`splice_priority`] (`None` for no priority). `body` must reach past the last member's
/// separator (or, for the priority, the first byte after `{` that is not whitespace). `None`
/// when the ranges are not top-level members of that object.
pub fn replace_client_priority(
    body: &[u8],
    client: &[Range<usize>],
    priority: Option<i64>,
) -> Option<Splice> {
    if client.is_empty() {
        return splice_priority(body, priority?);
    }
    let open = body.iter().position(|&b| !is_json_ws(b))?;
    if body.get(open) != Some(&b'{') {
        return None;
    }
    // A member goes with the comma before it; one that is (or, its predecessors gone, becomes)
    // the object's first goes with the comma after it, if any.
    let mut cuts: Vec<Range<usize>> = Vec::with_capacity(client.len());
    let mut previous: Option<(Member, bool)> = None;
    for value in client {
        let m = member_at(body, value)?;
        let first = match body.get(m.before) {
            Some(b'{') if m.before == open => true,
            Some(b',') => previous.is_some_and(|(p, first)| first && p.after == m.before),
            _ => return None,
        };
        let cut = if !first {
            m.before..m.end
        } else if body.get(m.after) == Some(&b',') {
            m.key..m.after + 1
        } else {
            m.key..m.end
        };
        if cuts.last().is_some_and(|last| cut.start < last.end) || cut.start <= open {
            return None;
        }
        cuts.push(cut);
        previous = Some((m, first));
    }
    let drain = cuts.last()?.end;
    let mut kept = Vec::with_capacity(drain);
    let mut at = 0;
    for cut in &cuts {
        kept.extend_from_slice(body.get(at..cut.start)?);
        at = cut.end;
    }
    let Some(priority) = priority else {
        return Some(Splice {
            drain,
            insert: kept,
        });
    };
    // The filter's member first: a comma after it unless the object is now empty.
    let members = kept.get(open + 1..)?;
    let next = members
        .iter()
        .chain(body.get(drain..)?)
        .find(|&&b| !is_json_ws(b))?;
    let separator = if *next == b'}' { "" } else { "," };
    let mut insert = format!("{{\"priority\":{priority}{separator}").into_bytes();
    insert.extend_from_slice(members);
    Some(Splice { drain, insert })
}

/// The value ranges of the top-level `priority` members (keys compared unescaped) of the JSON
/// object `body` starts with, in body order, for a body the request parser did not read (the
/// fallback rule). Found by the object's structure alone: values are skipped by their strings
/// and brackets, not checked, so a body serde refuses but a Python engine may read (`NaN`, a
/// field of the wrong type) is searched too. On valid JSON, the ranges the parser records.
/// `None` when `body` does not hold a whole object.
pub fn find_client_priority(body: &[u8]) -> Option<Vec<Range<usize>>> {
    let mut s = Cursor { body, pos: 0 };
    let mut found = Vec::new();
    s.eat(b'{')?;
    if s.ws()? == b'}' {
        return Some(found);
    }
    loop {
        let key = s.string()?;
        s.eat(b':')?;
        s.ws()?;
        let start = s.pos;
        s.value()?;
        if is_priority_key(body.get(key)?) {
            found.push(start..s.pos);
        }
        match s.ws()? {
            b',' => s.pos += 1,
            b'}' => return Some(found),
            _ => return None,
        }
    }
}

/// Whether a key (with its quotes) is `"priority"`, escapes decoded as a JSON parser would.
fn is_priority_key(raw: &[u8]) -> bool {
    if raw.contains(&b'\\') {
        serde_json::from_slice::<String>(raw).is_ok_and(|k| k == "priority")
    } else {
        raw == b"\"priority\""
    }
}

/// [`find_client_priority`]'s walk over a body.
struct Cursor<'a> {
    body: &'a [u8],
    pos: usize,
}

impl Cursor<'_> {
    /// Skips whitespace; the next byte.
    fn ws(&mut self) -> Option<u8> {
        self.pos += self
            .body
            .get(self.pos..)?
            .iter()
            .position(|&b| !is_json_ws(b))?;
        self.body.get(self.pos).copied()
    }

    fn eat(&mut self, want: u8) -> Option<()> {
        (self.ws()? == want).then(|| self.pos += 1)
    }

    /// A string (after whitespace): its range, quotes included.
    fn string(&mut self) -> Option<Range<usize>> {
        self.ws()?;
        let start = self.pos;
        self.eat(b'"')?;
        loop {
            self.pos += self
                .body
                .get(self.pos..)?
                .iter()
                .position(|&b| b == b'"' || b == b'\\')?;
            if self.body.get(self.pos) == Some(&b'"') {
                self.pos += 1;
                return Some(start..self.pos);
            }
            self.pos += 2; // the backslash and the byte it escapes
        }
    }

    /// Skips one value (at its first byte) by its strings and brackets.
    fn value(&mut self) -> Option<()> {
        match self.body.get(self.pos)? {
            b'"' => self.string().map(drop),
            b'[' | b'{' => {
                let mut depth = 0usize;
                loop {
                    match self.body.get(self.pos)? {
                        b'"' => {
                            self.string()?;
                            continue;
                        }
                        b'[' | b'{' => depth += 1,
                        b']' | b'}' => {
                            depth = depth.checked_sub(1)?;
                            if depth == 0 {
                                self.pos += 1;
                                return Some(());
                            }
                        }
                        _ => {}
                    }
                    self.pos += 1;
                }
            }
            _ => {
                let rest = self.body.get(self.pos..)?;
                let len = rest
                    .iter()
                    .position(|&b| matches!(b, b',' | b'}' | b']') || is_json_ws(b))
                    .unwrap_or(rest.len());
                self.pos += len;
                (len > 0).then_some(())
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]
mod tests {
    use super::*;
    use crate::request::{parse_request, Endpoint};

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
    fn a_clients_own_priority_wins_over_the_spliced_one() {
        // Why the client's member must go (unless honoured): the splice alone loses to it.
        let out = apply(r#"{"priority":-5,"model":"m"}"#, 99).unwrap();
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["priority"], -5);
    }

    /// `body` edited as the filter does: the client's top-level `priority` members found (by the
    /// structural scan, checked against the parser's record) and removed, `priority` put first.
    fn edit(body: &str, priority: Option<i64>) -> Option<String> {
        let values = find_client_priority(body.as_bytes())?;
        if let Ok(parsed) = parse_request(body.as_bytes(), Endpoint::Completions) {
            assert_eq!(parsed.client_priority, values, "{body}");
        }
        if values.is_empty() && priority.is_none() {
            return Some(body.to_string());
        }
        let s = replace_client_priority(body.as_bytes(), &values, priority)?;
        let mut out = s.insert.clone();
        out.extend_from_slice(body.as_bytes().get(s.drain..)?);
        String::from_utf8(out).ok()
    }

    /// The edited body parses, has no `priority` but the filter's, and keeps every other member
    /// (in order).
    fn check(body: &str, priority: Option<i64>) -> String {
        let out = edit(body, priority).unwrap_or_else(|| panic!("no edit for {body}"));
        let got: serde_json::Value = serde_json::from_str(&out)
            .unwrap_or_else(|e| panic!("{body} became invalid JSON {out}: {e}"));
        let mut want: serde_json::Value = serde_json::from_str(body).unwrap();
        let map = want.as_object_mut().unwrap();
        map.remove("priority");
        if let Some(p) = priority {
            map.insert("priority".into(), p.into());
        }
        assert_eq!(got, want, "{body} -> {out}");
        assert_eq!(
            find_client_priority(out.as_bytes()).map(|v| v.len()),
            Some(usize::from(priority.is_some())),
            "{out}"
        );
        out
    }

    #[test]
    fn the_clients_priority_is_removed_wherever_it_is() {
        for (body, dropped, replaced) in [
            (
                r#"{"priority":5,"model":"m","prompt":[1,2]}"#,
                r#"{"model":"m","prompt":[1,2]}"#,
                r#"{"priority":7,"model":"m","prompt":[1,2]}"#,
            ),
            (
                r#"{"model":"m","priority":5,"prompt":[1,2]}"#,
                r#"{"model":"m","prompt":[1,2]}"#,
                r#"{"priority":7,"model":"m","prompt":[1,2]}"#,
            ),
            (
                r#"{"model":"m","prompt":[1,2],"priority":5}"#,
                r#"{"model":"m","prompt":[1,2]}"#,
                r#"{"priority":7,"model":"m","prompt":[1,2]}"#,
            ),
            (r#"{"priority":5}"#, r#"{}"#, r#"{"priority":7}"#),
            (
                " \n{ \"priority\" : -5 , \"model\" : \"m\" }\n",
                " \n{  \"model\" : \"m\" }\n",
                "{\"priority\":7,  \"model\" : \"m\" }\n",
            ),
            (
                "{\n  \"model\": \"m\",\n  \"priority\":\t\"x\"\n}",
                "{\n  \"model\": \"m\"\n}",
                "{\"priority\":7,\n  \"model\": \"m\"\n}",
            ),
            (
                "{ \"priority\": [1, {\"a\": \"]\"}] }",
                "{  }",
                r#"{"priority":7  }"#,
            ),
        ] {
            assert_eq!(check(body, None), dropped, "{body}");
            assert_eq!(check(body, Some(7)), replaced, "{body}");
        }
    }

    #[test]
    fn only_top_level_priority_members_are_touched() {
        for body in [
            r#"{"nvext":{"priority":1},"model":"m"}"#,
            r#"{"messages":[{"role":"user","content":"hi","priority":2}]}"#,
            r#"{"prompt":"\"priority\": 3, \"a\":1","x":["priority",{"priority":4}]}"#,
            r#"{"priority_class":1,"Priority":2,"x":"priority"}"#,
        ] {
            assert_eq!(
                find_client_priority(body.as_bytes()),
                Some(vec![]),
                "{body}"
            );
            assert_eq!(check(body, None), body);
        }
        // A nested one stays beside a removed top-level one.
        let out = check(
            r#"{"nvext":{"priority":1},"priority":9,"m":{"priority":2}}"#,
            None,
        );
        assert_eq!(out, r#"{"nvext":{"priority":1},"m":{"priority":2}}"#);
    }

    #[test]
    fn every_duplicate_and_escaped_spelling_goes() {
        for body in [
            r#"{"priority":1,"priority":2}"#,
            r#"{"priority":1,"priority":2,"a":3}"#,
            r#"{"a":3,"priority":1,"priority":2}"#,
            r#"{"priority":1,"a":3,"priority":2}"#,
            r#"{"priority":1,"priority":2,"a":3,"priority":4,"b":5,"priority":6}"#,
            r#"{"pr\u0069ority":-9,"a":1}"#,
            r#"{"a":1,"pri\"x":2,"pr\u0069ority":-9}"#,
            r#"{"a\\":1,"priority":-9}"#,
            "{ \"priority\" :1 ,\n\"priority\": 2 , \"a\" : 3 }",
        ] {
            check(body, None);
            check(body, Some(42));
        }
    }

    #[test]
    fn random_bodies_keep_their_other_members() {
        let mut rng = crate::rng::Rng::new(7);
        let ws = ["", " ", "\n", "\t ", "  \r\n"];
        let values = [
            r#""s""#,
            "-3",
            "1.5e3",
            "null",
            r#"[1,"]"]"#,
            r#"{"priority":1}"#,
        ];
        for round in 0..2000 {
            let n = rng.index(5);
            let mut members = Vec::new();
            for i in 0..n {
                let key = if rng.index(3) == 0 {
                    "priority".to_string()
                } else {
                    format!("k{i}")
                };
                let value = values[rng.index(values.len())];
                let w = |rng: &mut crate::rng::Rng| ws[rng.index(ws.len())];
                members.push(format!(
                    "{}\"{key}\"{}:{}{value}{}",
                    w(&mut rng),
                    w(&mut rng),
                    w(&mut rng),
                    w(&mut rng)
                ));
            }
            let body = format!(
                "{}{{{}{}}}",
                ws[round % ws.len()],
                members.join(","),
                ws[rng.index(5)]
            );
            check(&body, None);
            check(&body, Some(round as i64));
        }
    }

    #[test]
    fn a_body_that_is_not_a_whole_object_is_not_searched() {
        for body in [
            "",
            "[1]",
            r#"{"priority":1"#,
            r#"{"priority":1,"#,
            r#"{"a":"priority"#,
            r#"{"a" 1}"#,
            r#"{"a":}"#,
            r#"{"prompt":[1,2}"#,
        ] {
            assert_eq!(find_client_priority(body.as_bytes()), None, "{body:?}");
        }
        // What Python's json reads and serde does not: still searched.
        let body = r#"{"x":NaN,"priority":-1,"y":Infinity}"#;
        let found = find_client_priority(body.as_bytes()).unwrap();
        assert_eq!(found.len(), 1);
        assert_eq!(found[0], 20..22);
        assert_eq!(
            edit(body, Some(3)).unwrap(),
            r#"{"priority":3,"x":NaN,"y":Infinity}"#
        );
    }

    #[test]
    fn ranges_that_are_not_members_are_refused() {
        let body = br#"{"a":{"priority":1},"b":2}"#;
        // The nested member's value, a key, the whole object, past the end.
        for bad in [17..18, 1..4, 0..26, 25..30, 24..24] {
            assert_eq!(
                replace_client_priority(body, std::slice::from_ref(&bad), Some(1)),
                None,
                "{bad:?}"
            );
        }
        // Out of order.
        let body = br#"{"priority":1,"priority":2}"#;
        assert_eq!(replace_client_priority(body, &[25..26, 12..13], None), None);
        assert!(replace_client_priority(body, &[12..13, 25..26], None).is_some());
        // A head too short for the separator after the last member: not guessed.
        assert_eq!(
            replace_client_priority(&body[..26], &[12..13, 25..26], None),
            None
        );
        // Nothing to remove: the plain splice, or nothing.
        assert_eq!(
            replace_client_priority(br#"{"a":1}"#, &[], Some(4)),
            splice_priority(br#"{"a":1}"#, 4)
        );
        assert_eq!(replace_client_priority(br#"{"a":1}"#, &[], None), None);
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
