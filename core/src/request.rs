//! OpenAI request body -> [`LlmRequest`]: the few fields the router reads.
//!
//! Prompts can be 100k+ tokens, so the body is parsed in one pass by hand-written serde visitors
//! that keep only what routing needs: token ids go straight into a `Vec<u32>`, text is only
//! counted (`text_chars`), and every other value is skipped with `IgnoredAny`. No `Value` tree is
//! built. Which field was being read is tracked so that a type error names it
//! (`nvext.dp_rank: invalid type: string "1", expected u32 ...`).
//!
//! Token ids dominate the body, so they take a fast path (`fast::parse_fast`): a structural scan of
//! the top-level object (and of `nvext`) finds the arrays of plain non-negative integers in
//! `prompt` and `nvext.token_data` and reads them with a hand-written loop (`scan_token_ids`);
//! the body is then copied with each such array cut down to `[]` and that copy goes through the
//! same serde visitors, which validate everything else and take the ids from the scan (checking
//! that they meet exactly the `[]`s that were cut, in order). Whatever the scan does not accept (a
//! batch, strings, floats, negative numbers, exponents, leading zeros, ids above `u32::MAX`,
//! escaped keys) stays in the body for serde. If the fast pass fails in any way, the body is
//! parsed again by the serde visitors alone (the reference behaviour), so every error (field
//! names, messages, positions) is exactly theirs.
//!
//! Fields (DESIGN.md "Request fields"): `model`; `prompt` (completions only: a string, an array of
//! token ids, or an array of arrays/strings = a batch, rejected); `messages` (chat only: every
//! string inside counts towards `text_chars`, since roles, contents and tool calls all reach the
//! chat template); `stream`; `nvext.token_data` (token ids, both endpoints, takes precedence over
//! `prompt` ids); `nvext.backend_instance_id` / `nvext.dp_rank` (pin); `nvext.allowed_worker_ids`;
//! `nvext.required_taints`; `nvext.preferred_taints` (`{taint: weight}`); `nvext.agent_hints.osl`;
//! `nvext.lora_name`. A top-level `lora_name` and `base:adapter` model names are not interpreted.
//! `null` means absent everywhere, except in `priority` (vLLM's scheduling priority, a routing
//! hint): every top-level `priority` member is recorded, whatever its value, by where its value
//! is in the body ([`LlmRequest::client_priority`]), so that the filter can remove it.

use std::fmt;
use std::ops::Range;

use serde::de::IgnoredAny;

use crate::types::{DpRank, WorkerId};

mod fast;
mod visitors;

use fast::parse_fast;
pub(crate) use fast::scan_token_ids;
pub use fast::{IdOut, TokenReader};
use visitors::parse_object;

/// Which OpenAI endpoint a body was sent to (decides whether `prompt` or `messages` is read).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    ChatCompletions,
}

impl Endpoint {
    /// The endpoint for a request path if the filter routes it (`path` is matched exactly against
    /// `llm_paths` after dropping any `?query` / `#fragment`). Paths ending in `/chat/completions`
    /// are chat, every other configured path is treated as completions.
    pub fn from_path(path: &str, llm_paths: &[String]) -> Option<Endpoint> {
        let bare = path.split(['?', '#']).next().unwrap_or(path);
        if !llm_paths.iter().any(|p| p == bare) {
            return None;
        }
        if bare.ends_with("/chat/completions") {
            Some(Endpoint::ChatCompletions)
        } else {
            Some(Endpoint::Completions)
        }
    }
}

/// An explicit worker choice (body `nvext`, or headers when `allow_client_pinning`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pin {
    pub worker_id: Option<WorkerId>,
    pub dp_rank: Option<DpRank>,
}

impl Pin {
    pub fn is_set(&self) -> bool {
        self.worker_id.is_some() || self.dp_rank.is_some()
    }

    /// Headers override the body. A header worker id replaces the body pin as a whole (a body
    /// rank belongs to the body's worker); a header rank alone overrides only the body's rank.
    pub fn merge(header: Pin, body: Pin) -> Pin {
        if header.worker_id.is_some() {
            header
        } else {
            Pin {
                worker_id: body.worker_id,
                dp_rank: header.dp_rank.or(body.dp_rank),
            }
        }
    }
}

/// Header names the adapter reads the pin from (only with `allow_client_pinning`).
pub const HEADER_WORKER_ID: &str = "x-worker-instance-id";
pub const HEADER_DP_RANK: &str = "x-dp-rank";

/// Parses the pin headers' values (absent = not pinned by header).
pub fn parse_header_pin(
    worker_id: Option<&str>,
    dp_rank: Option<&str>,
) -> Result<Pin, RequestError> {
    fn parse<T: std::str::FromStr>(
        value: Option<&str>,
        field: &'static str,
        what: &str,
    ) -> Result<Option<T>, RequestError>
    where
        T::Err: std::fmt::Display,
    {
        value
            .map(|s| {
                s.trim().parse::<T>().map_err(|e| RequestError::BadField {
                    field,
                    detail: format!("\"{s}\" is not {what}: {e}"),
                })
            })
            .transpose()
    }
    let worker_id = parse(worker_id, HEADER_WORKER_ID, "an unsigned 64-bit worker id")?;
    let dp_rank = parse(dp_rank, HEADER_DP_RANK, "an unsigned 32-bit DP rank")?;
    Ok(Pin { worker_id, dp_rank })
}

/// How much of the client's routing hints to read (see [`ParseOptions`]); the configuration's
/// default, defined there.
pub use crate::config::DEFAULT_MAX_HINT_ITEMS;

/// What [`parse_request_with`] reads besides the prompt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParseOptions {
    /// Read the routing hints (`nvext.backend_instance_id`, `dp_rank`, `allowed_worker_ids`,
    /// `required_taints`, `preferred_taints`). When false they are skipped unread (nothing is
    /// allocated for them) and only their presence is noted in [`LlmRequest::routing_hints`].
    pub read_hints: bool,
    /// Most items accepted in each hint list (`allowed_worker_ids`, `required_taints`,
    /// `preferred_taints`); more is [`RequestError::TooManyItems`].
    pub max_hint_items: usize,
    /// Leave token ids unread: a token array (up to its first `]`, with no string, array or
    /// object before it) comes back as [`LlmRequest::token_span`] instead of
    /// [`LlmRequest::token_ids`]; its ids are read and checked from the body on demand, see
    /// [`TokenSpan`] (with a body of several token fields, they are all read now).
    pub lazy_token_ids: bool,
}

impl Default for ParseOptions {
    fn default() -> Self {
        ParseOptions {
            read_hints: true,
            max_hint_items: DEFAULT_MAX_HINT_ITEMS,
            lazy_token_ids: false,
        }
    }
}

/// Where a token array is in the request body (a parse with [`ParseOptions::lazy_token_ids`]):
/// its ids are read with [`TokenSpan::reader`] on that body, and are checked only as they are
/// read and by [`TokenReader::finish`], which also counts them. Until then the parse's `Ok` is
/// provisional: if `finish` says `None`, the body's answer is the eager parse's
/// ([`parse_request_with`] without `lazy_token_ids`), an error or other ids.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TokenSpan {
    /// Offset of the array's `[` in the body.
    open: usize,
    /// The number of ids, once checked ([`TokenSpan::set_count`]).
    count: Option<usize>,
}

impl TokenSpan {
    /// The number of ids, once [`TokenSpan::set_count`] recorded it.
    pub fn count(&self) -> Option<usize> {
        self.count
    }

    /// Records what [`TokenReader::finish`] said.
    pub fn set_count(&mut self, count: usize) {
        self.count = Some(count);
    }

    /// Reads (and checks) the ids, in order, from `body` (the body that was parsed).
    pub fn reader<'a>(&self, body: &'a [u8]) -> TokenReader<'a> {
        TokenReader::new(body.get(self.open..).unwrap_or_default())
    }

    /// Checks and counts the ids without reading them (see [`TokenReader::finish`]).
    pub fn check(&self, body: &[u8]) -> Option<usize> {
        self.reader(body).finish()
    }

    /// All the ids (`None` if they are not an array of ids).
    pub fn ids(&self, body: &[u8]) -> Option<Vec<u32>> {
        let count = self.check(body)?;
        let mut ids = vec![0u32; count];
        let mut reader = self.reader(body);
        if count > 0 {
            reader.read_block(ids.as_mut_slice())?;
        }
        Some(ids)
    }
}

/// What the router needs from one request body.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LlmRequest {
    pub model: Option<String>,
    /// `nvext.token_data`, else `prompt` as token ids (completions).
    pub token_ids: Option<Vec<u32>>,
    /// Instead of `token_ids` (a parse with [`ParseOptions::lazy_token_ids`]): where those ids
    /// are in the body, not read (nor checked) yet. At most one of the two is set.
    pub token_span: Option<TokenSpan>,
    /// `nvext.lora_name`.
    pub lora_name: Option<String>,
    pub stream: bool,
    /// Body pin (`nvext.backend_instance_id`, `nvext.dp_rank`).
    pub pin: Pin,
    pub allowed_worker_ids: Option<Vec<WorkerId>>,
    pub required_taints: Vec<String>,
    /// In body order; weights are finite.
    pub preferred_taints: Vec<(String, f64)>,
    /// `nvext.agent_hints.osl`: expected output length.
    pub osl_hint_tokens: Option<u32>,
    /// `max_completion_tokens`, else `max_tokens`: the output length limit, when a non-negative
    /// integer (any other value is left to the engine to reject).
    pub max_tokens: Option<u32>,
    /// Characters of the text prompt (completions `prompt` string) or of every string inside
    /// `messages` (chat); used to estimate `isl_tokens` when there are no token ids.
    pub text_chars: usize,
    /// The body carried at least one routing hint (a non-null pin, allow-list or taint field),
    /// whether or not it was read.
    pub routing_hints: bool,
    /// The client's own top-level `priority` members (vLLM's scheduling priority; a routing
    /// hint, see `crate::priority`): the byte ranges of their values in the body, in body order
    /// (duplicates and escaped spellings of the key included, `null` too). Empty without one
    /// (nothing allocated).
    pub client_priority: Vec<Range<usize>>,
    /// Set by the adapter, not the parser: `token_ids` came from the tokenizer service.
    pub rendered: bool,
    /// Set by the adapter: the overlaps passed with this text request come from text prefix
    /// hashing (approximate mode), so they count.
    pub text_prefix: bool,
}

/// Why a body could not be read. Every variant is a client error (HTTP 400).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RequestError {
    EmptyBody,
    InvalidJson {
        detail: String,
    },
    NotAnObject,
    /// A known field with a value of the wrong type or out of range.
    BadField {
        field: &'static str,
        detail: String,
    },
    /// `prompt` is an array of prompts; the filter routes one prompt per request.
    BatchedPrompt,
    /// A hint list longer than [`ParseOptions::max_hint_items`].
    TooManyItems {
        field: &'static str,
        max: usize,
    },
}

impl LlmRequest {
    /// The number of token ids (read or not), `None` without token ids.
    pub fn token_count(&self) -> Option<usize> {
        match (&self.token_ids, &self.token_span) {
            (Some(ids), _) => Some(ids.len()),
            (None, Some(span)) => span.count(),
            (None, None) => None,
        }
    }

    /// The request carries token ids (read or not).
    pub fn has_token_ids(&self) -> bool {
        self.token_ids.is_some() || self.token_span.is_some()
    }
}

impl RequestError {
    pub fn http_status(&self) -> u32 {
        400
    }
}

impl fmt::Display for RequestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RequestError::EmptyBody => write!(f, "request body is empty; expected a JSON object"),
            RequestError::InvalidJson { detail } => write!(f, "request body is not valid JSON: {detail}"),
            RequestError::NotAnObject => write!(f, "request body must be a JSON object"),
            RequestError::BadField { field, detail } => write!(f, "{field}: {detail}"),
            RequestError::BatchedPrompt => write!(
                f,
                "prompt: batched prompts (an array of prompts) are not supported by the router; send one prompt per request"
            ),
            RequestError::TooManyItems { field, max } => {
                write!(f, "{field}: more than {max} items")
            }
        }
    }
}

impl std::error::Error for RequestError {}

/// Parses a request body for `endpoint` with [`ParseOptions::default`] (hints read, lists
/// capped at [`DEFAULT_MAX_HINT_ITEMS`]). See the module docs for the fields read.
pub fn parse_request(body: &[u8], endpoint: Endpoint) -> Result<LlmRequest, RequestError> {
    parse_request_with(body, endpoint, &ParseOptions::default())
}

/// Parses a request body for `endpoint`, reading the routing hints as `opts` says.
pub fn parse_request_with(
    body: &[u8],
    endpoint: Endpoint,
    opts: &ParseOptions,
) -> Result<LlmRequest, RequestError> {
    check_object_start(body)?;
    // The fast pass only ever returns what the serde pass would; when it gives up (no token
    // array to cut, or any error), the serde pass reads the original body.
    match parse_fast(body, endpoint, opts) {
        Some(req) => Ok(req),
        None => parse_object(body, endpoint, None, opts),
    }
}

/// The reference parser: the serde visitors for every field (no fast path). Public only for the
/// fuzz targets' differential check against the fast path.
#[cfg(any(test, feature = "fuzzing"))]
pub fn parse_request_serde(body: &[u8], endpoint: Endpoint) -> Result<LlmRequest, RequestError> {
    check_object_start(body)?;
    parse_object(body, endpoint, None, &ParseOptions::default())
}

/// An empty body, or one whose first value is not an object, gets its own error.
fn check_object_start(body: &[u8]) -> Result<(), RequestError> {
    let first = body.iter().find(|b| !b.is_ascii_whitespace());
    match first {
        None => Err(RequestError::EmptyBody),
        Some(b'{') => Ok(()),
        Some(_) => match serde_json::from_slice::<IgnoredAny>(body) {
            Ok(_) => Err(RequestError::NotAnObject),
            Err(e) => Err(RequestError::InvalidJson {
                detail: e.to_string(),
            }),
        },
    }
}

#[cfg(test)]
#[allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
mod tests {
    use super::fast::{array_end, count_token_ids, mask_run, parse_token_id, scan_token_ids};
    use super::*;

    fn completions(body: &str) -> Result<LlmRequest, RequestError> {
        parse_request(body.as_bytes(), Endpoint::Completions)
    }
    fn chat(body: &str) -> Result<LlmRequest, RequestError> {
        parse_request(body.as_bytes(), Endpoint::ChatCompletions)
    }

    #[test]
    fn completions_with_token_ids_and_every_nvext_field() {
        let r = completions(
            r#"{"model": "llama", "prompt": [1, 2, 4294967295], "stream": true, "max_tokens": 5,
                "nvext": {"backend_instance_id": 7, "dp_rank": 1, "allowed_worker_ids": [7, 8],
                          "required_taints": ["a100"], "preferred_taints": {"fast": 0.5, "eu": -1},
                          "agent_hints": {"osl": 256, "other": true}, "lora_name": "sql",
                          "unknown_ext": {"x": 1}}}"#,
        )
        .unwrap();
        assert_eq!(r.model.as_deref(), Some("llama"));
        assert_eq!(r.token_ids, Some(vec![1, 2, u32::MAX]));
        assert!(r.stream);
        assert_eq!(
            r.pin,
            Pin {
                worker_id: Some(7),
                dp_rank: Some(1)
            }
        );
        assert_eq!(r.allowed_worker_ids, Some(vec![7, 8]));
        assert_eq!(r.required_taints, vec!["a100".to_string()]);
        assert_eq!(
            r.preferred_taints,
            vec![("fast".to_string(), 0.5), ("eu".to_string(), -1.0)]
        );
        assert_eq!(r.osl_hint_tokens, Some(256));
        assert_eq!(r.lora_name.as_deref(), Some("sql"));
        assert_eq!(r.text_chars, 0);
        assert_eq!(r.max_tokens, Some(5));
    }

    #[test]
    fn the_output_limit_is_a_hint_never_a_reason_to_refuse() {
        let limit = |body: &str| completions(body).unwrap().max_tokens;
        assert_eq!(limit(r#"{"prompt": [1], "max_tokens": 300}"#), Some(300));
        assert_eq!(limit(r#"{"prompt": "hi", "max_tokens": 300}"#), Some(300));
        assert_eq!(limit(r#"{"prompt": [1], "max_tokens": 1e12}"#), None);
        assert_eq!(
            limit(r#"{"prompt": [1], "max_tokens": 99999999999}"#),
            Some(u32::MAX)
        );
        for bad in [
            "-1",
            "2.5",
            "\"300\"",
            "null",
            "[1]",
            "{\"a\": [1]}",
            "true",
        ] {
            let body = format!(r#"{{"prompt": [1, 2], "max_tokens": {bad}, "model": "m"}}"#);
            let r = completions(&body).unwrap();
            assert_eq!(
                (r.max_tokens, r.model.as_deref()),
                (None, Some("m")),
                "{bad}"
            );
        }
        // Chat's newer name wins over the older one, in either order.
        let chat_limit = |body: &str| chat(body).unwrap().max_tokens;
        let both = r#"{"messages": [], "max_completion_tokens": 7, "max_tokens": 9}"#;
        assert_eq!(chat_limit(both), Some(7));
        let both = r#"{"messages": [], "max_tokens": 9, "max_completion_tokens": 7}"#;
        assert_eq!(chat_limit(both), Some(7));
        assert_eq!(chat_limit(r#"{"messages": [], "max_tokens": 9}"#), Some(9));
    }

    #[test]
    fn text_prompt_and_messages_count_characters() {
        let r = completions(r#"{"prompt": "héllo world", "model": null}"#).unwrap();
        assert_eq!(r.token_ids, None);
        assert_eq!(r.model, None);
        assert_eq!(r.text_chars, 11);
        let r = chat(
            r#"{"messages": [{"role": "user", "content": "abcd"},
                            {"role": "assistant", "content": [{"type": "text", "text": "xy"}]}],
                "prompt": [1, 2]}"#,
        )
        .unwrap();
        // "user" + "abcd" + "assistant" + "text" + "xy"; `prompt` is ignored on chat.
        assert_eq!(r.text_chars, 4 + 4 + 9 + 4 + 2);
        assert_eq!(r.token_ids, None);
        // `messages` is ignored on completions.
        assert_eq!(
            completions(r#"{"messages": [{"content": "abcd"}]}"#)
                .unwrap()
                .text_chars,
            0
        );
    }

    #[test]
    fn token_data_wins_over_prompt_ids_in_any_order() {
        let r = completions(r#"{"nvext": {"token_data": [9, 9]}, "prompt": [1]}"#).unwrap();
        assert_eq!(r.token_ids, Some(vec![9, 9]));
        let r = completions(r#"{"prompt": [1], "nvext": {"token_data": [9, 9]}}"#).unwrap();
        assert_eq!(r.token_ids, Some(vec![9, 9]));
        let r = chat(r#"{"messages": [], "nvext": {"token_data": [3]}}"#).unwrap();
        assert_eq!(r.token_ids, Some(vec![3]));
        assert_eq!(
            completions(r#"{"prompt": []}"#).unwrap().token_ids,
            Some(vec![])
        );
    }

    fn ids(n: usize) -> String {
        (0..n).map(|i| i.to_string()).collect::<Vec<_>>().join(",")
    }

    /// Every client list is capped; one item over is an error naming the field, on the fast
    /// path (token ids present) and the serde path alike.
    #[test]
    fn hint_lists_are_capped() {
        let opts = ParseOptions {
            read_hints: true,
            max_hint_items: 3,
            lazy_token_ids: false,
        };
        let parse =
            |body: String| parse_request_with(body.as_bytes(), Endpoint::Completions, &opts);
        for prompt in [r#""text""#, "[1, 2, 3]"] {
            let ok = parse(format!(
                r#"{{"prompt": {prompt}, "nvext": {{"allowed_worker_ids": [{}], "required_taints": ["a", "b", "c"], "preferred_taints": {{"a": 1, "b": 1, "c": 1}}}}}}"#,
                ids(3)
            ))
            .unwrap();
            assert_eq!(ok.allowed_worker_ids.map(|l| l.len()), Some(3));
            assert!(ok.routing_hints);
            let over = |field: &str, value: &str| {
                parse(format!(
                    r#"{{"prompt": {prompt}, "nvext": {{"{field}": {value}}}}}"#
                ))
            };
            let huge = format!("[{}]", ids(200_000));
            assert_eq!(
                over("allowed_worker_ids", &huge),
                Err(RequestError::TooManyItems {
                    field: "nvext.allowed_worker_ids",
                    max: 3
                })
            );
            assert_eq!(
                over("required_taints", r#"["a", "b", "c", "d"]"#),
                Err(RequestError::TooManyItems {
                    field: "nvext.required_taints",
                    max: 3
                })
            );
            assert_eq!(
                over("preferred_taints", r#"{"a": 1, "b": 1, "c": 1, "d": 1}"#),
                Err(RequestError::TooManyItems {
                    field: "nvext.preferred_taints",
                    max: 3
                })
            );
        }
        let e = RequestError::TooManyItems {
            field: "nvext.allowed_worker_ids",
            max: 64,
        };
        assert_eq!(
            e.to_string(),
            "nvext.allowed_worker_ids: more than 64 items"
        );
        assert_eq!(e.http_status(), 400);
    }

    /// Untrusted clients: hints are skipped unread (no cap applies, nothing is allocated), and
    /// their presence is noted; `null` counts as absent.
    #[test]
    fn unread_hints_are_only_noted() {
        let opts = ParseOptions {
            read_hints: false,
            max_hint_items: 3,
            lazy_token_ids: false,
        };
        let parse =
            |body: &str| parse_request_with(body.as_bytes(), Endpoint::Completions, &opts).unwrap();
        let huge = format!(
            r#"{{"prompt": [1, 2], "nvext": {{"backend_instance_id": 2, "dp_rank": 1, "allowed_worker_ids": [{}], "required_taints": ["x"], "preferred_taints": {{"y": 1}}, "lora_name": "l"}}}}"#,
            ids(200_000)
        );
        let r = parse(&huge);
        assert!(r.routing_hints);
        assert_eq!(r.pin, Pin::default());
        assert_eq!(r.allowed_worker_ids, None);
        assert!(r.required_taints.is_empty() && r.preferred_taints.is_empty());
        assert_eq!(r.token_ids, Some(vec![1, 2]));
        assert_eq!(r.lora_name.as_deref(), Some("l"), "not a routing hint");
        for field in [
            "backend_instance_id",
            "dp_rank",
            "allowed_worker_ids",
            "required_taints",
            "preferred_taints",
        ] {
            let r = parse(&format!(
                r#"{{"prompt": "x", "nvext": {{"{field}": [1]}}}}"#
            ));
            assert!(r.routing_hints, "{field}");
            let r = parse(&format!(
                r#"{{"prompt": "x", "nvext": {{"{field}": null}}}}"#
            ));
            assert!(!r.routing_hints, "{field}: null is absent");
        }
        assert!(
            !parse(r#"{"prompt": "x", "nvext": {"lora_name": "a", "agent_hints": {"osl": 3}}}"#)
                .routing_hints
        );
    }

    #[test]
    fn batched_prompts_are_rejected() {
        assert_eq!(
            completions(r#"{"prompt": [[1, 2], [3]]}"#),
            Err(RequestError::BatchedPrompt)
        );
        assert_eq!(
            completions(r#"{"prompt": ["a", "b"]}"#),
            Err(RequestError::BatchedPrompt)
        );
    }

    #[test]
    fn bad_fields_are_named() {
        let field_of = |body: &str| match completions(body) {
            Err(RequestError::BadField { field, .. }) => field,
            other => panic!("expected BadField for {body}, got {other:?}"),
        };
        assert_eq!(field_of(r#"{"prompt": [1, 4294967296]}"#), "prompt");
        assert_eq!(field_of(r#"{"prompt": [4294967296]}"#), "prompt");
        assert_eq!(field_of(r#"{"prompt": [-1]}"#), "prompt");
        assert_eq!(field_of(r#"{"prompt": [1, "a"]}"#), "prompt");
        assert_eq!(field_of(r#"{"prompt": 5}"#), "prompt");
        assert_eq!(field_of(r#"{"model": 5}"#), "model");
        assert_eq!(field_of(r#"{"stream": "yes"}"#), "stream");
        assert_eq!(
            field_of(r#"{"nvext": {"token_data": [1.5]}}"#),
            "nvext.token_data"
        );
        assert_eq!(field_of(r#"{"nvext": {"dp_rank": "1"}}"#), "nvext.dp_rank");
        assert_eq!(
            field_of(r#"{"nvext": {"backend_instance_id": -3}}"#),
            "nvext.backend_instance_id"
        );
        assert_eq!(
            field_of(r#"{"nvext": {"preferred_taints": {"a": "x"}}}"#),
            "nvext.preferred_taints"
        );
        assert_eq!(
            field_of(r#"{"nvext": {"agent_hints": {"osl": -1}}}"#),
            "nvext.agent_hints"
        );
        assert_eq!(field_of(r#"{"nvext": 3}"#), "nvext");
        let e = completions(r#"{"prompt": [1, 4294967296]}"#).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("prompt: invalid value: integer `4294967296`"),
            "{e}"
        );
    }

    #[test]
    fn structural_errors() {
        assert_eq!(completions(""), Err(RequestError::EmptyBody));
        assert_eq!(completions(" \n"), Err(RequestError::EmptyBody));
        assert_eq!(completions("[1]"), Err(RequestError::NotAnObject));
        assert_eq!(completions("\"x\""), Err(RequestError::NotAnObject));
        assert!(matches!(
            completions("{\"prompt\": [1,"),
            Err(RequestError::InvalidJson { .. })
        ));
        assert!(matches!(
            completions("{} x"),
            Err(RequestError::InvalidJson { .. })
        ));
        assert!(matches!(
            completions("nope"),
            Err(RequestError::InvalidJson { .. })
        ));
        assert_eq!(RequestError::BatchedPrompt.http_status(), 400);
    }

    #[test]
    fn nulls_mean_absent() {
        let r = completions(
            r#"{"prompt": null, "stream": null, "nvext": {"token_data": null, "dp_rank": null,
                "required_taints": null, "preferred_taints": null, "agent_hints": null}}"#,
        )
        .unwrap();
        assert_eq!(r, LlmRequest::default());
        assert_eq!(
            completions(r#"{"nvext": null}"#).unwrap(),
            LlmRequest::default()
        );
    }

    #[test]
    fn large_token_prompt_parses() {
        let ids: Vec<String> = (0..200_000u32).map(|i| (i * 7).to_string()).collect();
        let body = format!("{{\"prompt\": [{}]}}", ids.join(","));
        let r = completions(&body).unwrap();
        let got = r.token_ids.unwrap();
        assert_eq!(got.len(), 200_000);
        assert_eq!(got[199_999], 199_999 * 7);
    }

    #[test]
    fn endpoint_from_path() {
        let paths = vec![
            "/v1/completions".to_string(),
            "/v1/chat/completions".to_string(),
        ];
        assert_eq!(
            Endpoint::from_path("/v1/completions", &paths),
            Some(Endpoint::Completions)
        );
        assert_eq!(
            Endpoint::from_path("/v1/chat/completions?x=1", &paths),
            Some(Endpoint::ChatCompletions)
        );
        assert_eq!(Endpoint::from_path("/v1/models", &paths), None);
        assert_eq!(Endpoint::from_path("/v1/completions/", &paths), None);
    }

    #[test]
    fn header_pin_parsing_and_merge() {
        let h = parse_header_pin(Some(" 12 "), Some("3")).unwrap();
        assert_eq!(
            h,
            Pin {
                worker_id: Some(12),
                dp_rank: Some(3)
            }
        );
        assert!(matches!(
            parse_header_pin(Some("abc"), None),
            Err(RequestError::BadField {
                field: HEADER_WORKER_ID,
                ..
            })
        ));
        assert!(matches!(
            parse_header_pin(None, Some("-1")),
            Err(RequestError::BadField {
                field: HEADER_DP_RANK,
                ..
            })
        ));
        let body = Pin {
            worker_id: Some(1),
            dp_rank: Some(5),
        };
        // A header worker id replaces the body pin entirely.
        let header = Pin {
            worker_id: Some(2),
            dp_rank: None,
        };
        assert_eq!(Pin::merge(header, body), header);
        // A header rank alone overrides the body's rank only.
        let header = Pin {
            worker_id: None,
            dp_rank: Some(0),
        };
        assert_eq!(
            Pin::merge(header, body),
            Pin {
                worker_id: Some(1),
                dp_rank: Some(0)
            }
        );
        assert_eq!(Pin::merge(Pin::default(), body), body);
    }

    // ---- fast path: token ids read by the structural scan, checked against the serde pass ----

    /// `parse_request` and the reference serde pass agree on `body` for both endpoints.
    fn same_as_serde(body: &str) -> Result<LlmRequest, RequestError> {
        for endpoint in [Endpoint::Completions, Endpoint::ChatCompletions] {
            assert_eq!(
                parse_request(body.as_bytes(), endpoint),
                parse_request_serde(body.as_bytes(), endpoint),
                "{endpoint:?}: {body}"
            );
        }
        completions(body)
    }

    /// The fast pass answered (rather than handing the body to the serde pass).
    fn fast_ids(body: &str) -> Option<Vec<u32>> {
        let r = parse_fast(
            body.as_bytes(),
            Endpoint::Completions,
            &ParseOptions::default(),
        )
        .expect(body);
        assert_eq!(Ok(r.clone()), completions(body), "{body}");
        r.token_ids
    }

    #[test]
    fn fast_path_whitespace_everywhere_and_empty_arrays() {
        let ws = " \t\n\r";
        let body = format!(
            "{ws}{{{ws}\"prompt\"{ws}:{ws}[{ws}1{ws},{ws}22{ws},{ws}333{ws}]{ws},{ws}\"model\"{ws}:{ws}\"m\"{ws}}}{ws}"
        );
        assert_eq!(fast_ids(&body), Some(vec![1, 22, 333]));
        let body = format!(
            "{{\"nvext\"{ws}:{ws}{{{ws}\"token_data\"{ws}:{ws}[{ws}7{ws}]{ws}}}{ws},\"prompt\":[1,2]}}"
        );
        assert_eq!(fast_ids(&body), Some(vec![7]));
        assert_eq!(fast_ids(r#"{"prompt": [1,2,3]}"#), Some(vec![1, 2, 3]));
        assert_eq!(
            fast_ids(r#"{"prompt": [0, 0,10,100]}"#),
            Some(vec![0, 0, 10, 100])
        );
        // Empty arrays are scanned (an empty cut still meets its `[]`).
        assert_eq!(fast_ids(r#"{"prompt": []}"#), Some(vec![]));
        assert_eq!(fast_ids("{\"prompt\": [ \n ]}"), Some(vec![]));
        assert_eq!(
            fast_ids(r#"{"nvext": {"token_data": []}, "prompt": [5]}"#),
            Some(vec![])
        );
        for body in [
            "{ \"prompt\" : [ 1 , 2 ] }",
            "{\"prompt\":[\t1\t]\t}",
            "{\"prompt\":[]}",
            "{\"prompt\":[ ]}",
        ] {
            same_as_serde(body).unwrap();
        }
    }

    #[test]
    fn fast_path_u32_bounds() {
        assert_eq!(
            fast_ids(r#"{"prompt": [4294967295, 0, 4294967295]}"#),
            Some(vec![u32::MAX, 0, u32::MAX])
        );
        for body in [
            r#"{"prompt": [4294967296]}"#,
            r#"{"prompt": [1, 4294967296]}"#,
            r#"{"prompt": [1, 99999999999]}"#,
            r#"{"prompt": [1, 18446744073709551616]}"#,
            r#"{"nvext": {"token_data": [1, 4294967296]}}"#,
        ] {
            assert!(parse_fast(
                body.as_bytes(),
                Endpoint::Completions,
                &ParseOptions::default()
            )
            .is_none());
            assert!(matches!(
                same_as_serde(body),
                Err(RequestError::BadField { .. })
            ));
        }
        // Exactly the messages (and positions) of the serde pass.
        assert_eq!(
            completions(r#"{"prompt": [1, 4294967296]}"#)
                .unwrap_err()
                .to_string(),
            "prompt: invalid value: integer `4294967296`, expected u32 at line 1 column 25"
        );
        assert_eq!(
            completions(r#"{"prompt": [4294967296]}"#).unwrap_err().to_string(),
            "prompt: invalid value: integer `4294967296`, expected a token id (u32) at line 1 column 22"
        );
        assert_eq!(
            completions(r#"{"nvext": {"token_data": [1, 4294967296]}}"#)
                .unwrap_err()
                .to_string(),
            "nvext.token_data: invalid value: integer `4294967296`, expected u32 at line 1 column 39"
        );
    }

    #[test]
    fn fast_path_leaves_everything_unusual_to_serde() {
        for body in [
            r#"{"prompt": [1e3]}"#,
            r#"{"prompt": [1E3]}"#,
            r#"{"prompt": [1, 1e3]}"#,
            r#"{"prompt": [-1]}"#,
            r#"{"prompt": [1, -1]}"#,
            r#"{"prompt": [-0]}"#,
            r#"{"prompt": [1.0]}"#,
            r#"{"prompt": [1, 2.5]}"#,
            r#"{"prompt": [01]}"#,
            r#"{"prompt": [1, 00]}"#,
            r#"{"prompt": [[1, 2], [3]]}"#,
            r#"{"prompt": [1, [2]]}"#,
            r#"{"prompt": ["a", "b"]}"#,
            r#"{"prompt": [1, "a"]}"#,
            r#"{"prompt": [1, null]}"#,
            r#"{"prompt": [1,]}"#,
            r#"{"prompt": [1 2]}"#,
            r#"{"prompt": [,1]}"#,
            r#"{"prompt": [1"#,
            r#"{"prompt": [1]"#,
            r#"{"prompt": [1]} x"#,
            r#"{"prompt": [1], }"#,
            r#"{"prompt": [1] "model": "m"}"#,
            r#"{"prompt": 5}"#,
            r#"{"nvext": {"token_data": [1.5]}}"#,
            r#"{"nvext": {"token_data": [[1]]}}"#,
            r#"{"nvext": {"token_data": "x"}}"#,
            r#"{"nvext": {"token_data": [1], "dp_rank": "1"}}"#,
            r#"{"prompt": [1], "nvext": 3}"#,
            r#"{"prompt": [1], "model": 5}"#,
            r#"{"prompt": [1], "stream": "yes"}"#,
            r#"{"prompt": [1], "x": [1, 2}"#,
            r#"{"prompt": [1], "x": tru}"#,
            "{\"prompt\": [1], \"x\": \"\u{1}\"}",
            r#"{"prompt": [1], "x": "\q"}"#,
        ] {
            assert!(same_as_serde(body).is_err(), "{body}");
        }
        assert_eq!(
            same_as_serde(r#"{"prompt": [[1, 2], [3]]}"#),
            Err(RequestError::BatchedPrompt)
        );
        assert_eq!(
            same_as_serde(r#"{"prompt": ["a"], "nvext": {"token_data": [1]}}"#),
            Err(RequestError::BatchedPrompt)
        );
        // Fine values the scan does not take: serde reads them as before.
        for body in [
            r#"{"prompt": "a [1, 2] \"b\" \\"}"#,
            r#"{"prompt": null, "nvext": {"token_data": null}}"#,
            r#"{"pro\u006dpt": [1, 2]}"#,
            r#"{"prompt": [1], "pro\u006dpt": [2]}"#,
            r#"{"nvext": {"token_d\u0061ta": [3]}, "prompt": [1]}"#,
        ] {
            same_as_serde(body).unwrap();
        }
        assert_eq!(
            completions(r#"{"pro\u006dpt": [1, 2]}"#).unwrap().token_ids,
            Some(vec![1, 2])
        );
    }

    #[test]
    fn fast_path_follows_the_visitors_field_rules() {
        // Duplicate keys: the last one wins, text after ids keeps the ids (as the serde pass).
        for body in [
            r#"{"prompt": [1], "prompt": [2, 3]}"#,
            r#"{"prompt": [1], "prompt": "abc"}"#,
            r#"{"prompt": "abc", "prompt": [4]}"#,
            r#"{"prompt": [1], "prompt": null}"#,
            r#"{"nvext": {"token_data": [1]}, "nvext": {"token_data": [2]}}"#,
            r#"{"nvext": {"token_data": [1], "token_data": null}, "prompt": [9]}"#,
            r#"{"nvext": null, "prompt": [9]}"#,
            r#"{"x": {"prompt": [5], "nvext": {"token_data": [6]}}, "prompt": [1]}"#,
            r#"{"x": "\"prompt\": [5]", "prompt": [1], "y": ["]", "{"]}"#,
            r#"{"messages": [{"role": "user", "content": "hi"}], "prompt": [1, 2]}"#,
        ] {
            same_as_serde(body).unwrap();
        }
        let r = completions(r#"{"prompt": [1], "prompt": "abc"}"#).unwrap();
        assert_eq!((r.token_ids, r.text_chars), (Some(vec![1]), 3));
        assert_eq!(
            fast_ids(r#"{"x": "\"prompt\": [5]", "prompt": [1], "y": ["]", "{"]}"#),
            Some(vec![1])
        );
        // Chat reads no `prompt` (the fast pass has nothing to cut there).
        let r = chat(r#"{"prompt": [1, 2], "nvext": {"token_data": [3]}}"#).unwrap();
        assert_eq!(r.token_ids, Some(vec![3]));
    }

    /// The client's `priority` (a routing hint the filter may remove): every top-level member,
    /// by its value's place in the body, on the fast path (ranges mapped back past the cut
    /// arrays, ids read or left in the body) as on the serde path.
    #[test]
    fn the_clients_priority_is_recorded_where_it_is() {
        let lazy = ParseOptions {
            lazy_token_ids: true,
            ..ParseOptions::default()
        };
        for (body, expected) in [
            (r#"{"priority": 5, "prompt": [1, 2, 3]}"#, &["5"][..]),
            (r#"{"prompt": [1, 2, 3], "priority": -5}"#, &["-5"]),
            (
                r#"{"prompt": [1, 2, 3], "nvext": {"token_data": [4, 5]}, "priority" : "x" }"#,
                &["\"x\""],
            ),
            (
                r#"{"prompt": [1,2,3], "priority": 1, "x": [[]], "pr\u0069ority": null}"#,
                &["1", "null"],
            ),
            (
                r#"{"prompt": "text", "priority": {"a": [1]}, "priority": 2}"#,
                &["{\"a\": [1]}", "2"],
            ),
            (r#"{"messages": [], "priority": 3.5}"#, &["3.5"]),
        ] {
            let parsed = same_as_serde(body).unwrap();
            let values: Vec<&str> = parsed
                .client_priority
                .iter()
                .map(|r| &body[r.clone()])
                .collect();
            assert_eq!(values, expected, "{body}");
            if body.contains("\"prompt\": [") && !body.contains("\\u") {
                let fast = parse_fast(body.as_bytes(), Endpoint::Completions, &lazy);
                assert_eq!(fast.unwrap().client_priority, parsed.client_priority);
                fast_ids(body);
            }
        }
        // Nested ones are not the request's; `null` is recorded (the engine would read it).
        for body in [
            r#"{"prompt": [1], "nvext": {"priority": 1}}"#,
            r#"{"prompt": "a", "x": {"priority": 1}, "y": ["priority", 2]}"#,
        ] {
            assert!(
                same_as_serde(body).unwrap().client_priority.is_empty(),
                "{body}"
            );
        }
        assert_eq!(
            completions(r#"{"priority":null}"#).unwrap().client_priority,
            vec![12..16]
        );
        // A priority that is not UTF-8 cannot be located: the body is not read.
        assert!(parse_request(b"{\"priority\": \"\xff\"}", Endpoint::Completions).is_err());
    }

    #[test]
    fn large_token_prompt_matches_serde() {
        let ids: Vec<u32> = (0..200_000u32)
            .map(|i| i.wrapping_mul(2_654_435_761) >> (i % 32))
            .collect();
        let text: Vec<String> = ids.iter().map(u32::to_string).collect();
        for sep in [",", ", ", " ,\n "] {
            let body = format!(
                "{{\"model\": \"m\", \"prompt\": [{}], \"stream\": true}}",
                text.join(sep)
            );
            assert_eq!(fast_ids(&body), Some(ids.clone()));
            assert_eq!(
                completions(&body),
                parse_request_serde(body.as_bytes(), Endpoint::Completions)
            );
        }
    }

    #[test]
    fn token_id_literals() {
        let mut cases: Vec<String> = Vec::new();
        for digits in 1..=12 {
            for lead in ["1", "4", "9", "0"] {
                cases.push(format!("{lead}{}", "0".repeat(digits - 1)));
                cases.push(format!("{lead}{}", "9".repeat(digits - 1)));
                cases.push(format!("{lead}{}", &"1234567890123"[..digits - 1]));
            }
        }
        cases.extend(["4294967295", "4294967296", "429496729", "42949672950"].map(String::from));
        for case in &cases {
            let expected = if case.len() > 1 && case.starts_with('0') {
                None
            } else {
                case.parse::<u32>().ok().map(|v| (v, case.len()))
            };
            // Every follower a token can have, with and without 8 bytes left to read.
            for follow in ["", "]", ",", " ", ", 1, 2, 3, 4, 5]", "]}}}}}}}}}}"] {
                let text = format!("{case}{follow}");
                assert_eq!(parse_token_id(text.as_bytes()), expected, "{text:?}");
            }
            for follow in [".5", "e3", "E3", ".0, 1, 2, 3, 4"] {
                let text = format!("[{case}{follow}]");
                assert_eq!(scan_token_ids(text.as_bytes()), None, "{text:?}");
            }
        }
        for bad in ["", "-1", "a", "+1", " 1", "/", ":", "]"] {
            assert_eq!(parse_token_id(bad.as_bytes()), None, "{bad:?}");
        }
    }

    /// Random request bodies for the differential test: token arrays with odd elements and
    /// whitespace, decoy `prompt`s, escaped keys, duplicates, and some damage.
    struct BodyGen(crate::rng::Rng);

    impl BodyGen {
        const WS: &'static [&'static str] = &["", "", "", " ", "\n", "\t", "\r\n", "  "];
        const ATOMS: &'static [&'static str] = &[
            "0",
            "7",
            "42",
            "128000",
            "99999999",
            "123456789",
            "4294967295",
            "4294967296",
            "18446744073709551615",
            "01",
            "-1",
            "-0",
            "1.0",
            "1e3",
            "1E+2",
            "\"a\"",
            "[1]",
            "[]",
            "null",
            "true",
            "{}",
            "0.5",
        ];

        fn pick(&mut self, n: usize) -> usize {
            self.0.index(n)
        }

        fn ws(&mut self) -> &'static str {
            Self::WS[self.pick(Self::WS.len())]
        }

        fn token_array(&mut self) -> String {
            let mut a = format!("[{}", self.ws());
            let n = self.pick(12);
            let odd = self.pick(4) == 0;
            for i in 0..n {
                if i > 0 {
                    let (w1, w2) = (self.ws(), self.ws());
                    a.push_str(&format!("{w1},{w2}"));
                }
                if odd && self.pick(6) == 0 {
                    a.push_str(Self::ATOMS[self.pick(Self::ATOMS.len())]);
                } else {
                    let bits = self.pick(33) as u32;
                    a.push_str(&(self.0.next_u64() % (1u64 << bits).max(1)).to_string());
                }
            }
            a.push_str(self.ws());
            a.push(']');
            a
        }

        /// A token array, by `round % 5`: cut short, one byte replaced, more body after it, or
        /// left whole.
        fn damaged_token_array(&mut self, round: usize) -> String {
            let mut text = self.token_array();
            match round % 5 {
                0 => text.truncate(self.pick(text.len() + 1)),
                1 => {
                    let at = self.pick(text.len());
                    let by = ["[", "]", ",", " ", "0", "5", "-", ".", "e", "\\"][self.pick(10)];
                    text.replace_range(at..at + 1, by);
                }
                2 => text.push_str([", \"max_tokens\": 1}", "]}", "", "1234567"][self.pick(4)]),
                _ => {}
            }
            text
        }

        fn field(&mut self) -> String {
            match self.pick(10) {
                0..=2 => format!("\"prompt\":{}{}", self.ws(), self.token_array()),
                3 => {
                    let extra = [", \"dp_rank\": 1", ", \"x\": [[]]", ""][self.pick(3)];
                    format!(
                        "\"nvext\":{}{{\"token_data\":{}{}{extra}}}",
                        self.ws(),
                        self.ws(),
                        self.token_array()
                    )
                }
                4 => [
                    "\"prompt\": \"tx\\\"t\"",
                    "\"prompt\": null",
                    "\"prompt\": \"[1]\"",
                ][self.pick(3)]
                .to_string(),
                5 => ["\"model\": \"m\"", "\"stream\": true", "\"max_tokens\": 5"][self.pick(3)]
                    .to_string(),
                6 => format!(
                    "\"x\": {{\"prompt\": {}, \"s\": \"}}]\\\\\"}}",
                    self.token_array()
                ),
                7 => format!("\"pro\\u006dpt\": {}", self.token_array()),
                8 => format!(
                    "{}:{}{}",
                    ["\"priority\"", "\"pr\\u0069ority\"", "\"priority \""][self.pick(3)],
                    self.ws(),
                    Self::ATOMS[self.pick(Self::ATOMS.len())]
                ),
                _ => format!(
                    "\"messages\": [{{\"content\": \"ab\"}}], \"n\": {}",
                    self.token_array()
                ),
            }
        }

        fn body(&mut self, round: usize) -> String {
            let fields: Vec<String> = (0..self.pick(5) + 1).map(|_| self.field()).collect();
            let sep = format!("{},{}", self.ws(), self.ws());
            let (w1, w2, w3, w4) = (self.ws(), self.ws(), self.ws(), self.ws());
            let mut body = format!("{w1}{{{w2}{}{w3}}}{w4}", fields.join(&sep));
            match round % 10 {
                0 => body.truncate(self.pick(body.len())),
                1 => {
                    let at = self.pick(body.len());
                    let by = ["[", "]", ",", "\"", "{", "}", "\\", "5", "-", "."][self.pick(10)];
                    body.replace_range(at..at + 1, by); // bodies are ASCII
                }
                _ => {}
            }
            body
        }
    }

    /// The scanner before its one-load-per-id fast path (the reference for the test below).
    fn reference_scan(text: &[u8]) -> Option<(Vec<u32>, usize)> {
        let ws = |b: u8| matches!(b, b' ' | b'\t' | b'\n' | b'\r');
        let skip = |mut i: usize| {
            while text.get(i).copied().is_some_and(ws) {
                i += 1;
            }
            i
        };
        if text.first() != Some(&b'[') {
            return None;
        }
        let mut ids = Vec::new();
        let mut i = skip(1);
        if text.get(i) == Some(&b']') {
            return Some((ids, i + 1));
        }
        loop {
            let (id, len) = parse_token_id(text.get(i..)?)?;
            ids.push(id);
            i = skip(i + len);
            match text.get(i)? {
                b',' => i = skip(i + 1),
                b']' => return Some((ids, i + 1)),
                _ => return None,
            }
        }
    }

    /// Random arrays (ids of every length, odd elements, whitespace, cut short, damaged, with
    /// the rest of a body after them): the scanner's answer is the reference scanner's.
    #[test]
    fn scan_agrees_with_the_reference_scanner() {
        let mut g = BodyGen(crate::rng::Rng::new(0x5ca9));
        let mut accepted = 0;
        for round in 0..50_000 {
            let text = g.damaged_token_array(round);
            let got = scan_token_ids(text.as_bytes());
            assert_eq!(got, reference_scan(text.as_bytes()), "{text:?}");
            accepted += usize::from(got.is_some());
        }
        assert!(accepted > 20_000, "{accepted}");
        // Long arrays in the formats clients send.
        for sep in [",", ", ", " , ", ",\n  "] {
            let ids: Vec<u32> = (0..3000u32)
                .map(|i| i.wrapping_mul(2_654_435_761))
                .collect();
            let text = format!(
                "[{}]",
                ids.iter().map(u32::to_string).collect::<Vec<_>>().join(sep)
            );
            let got = scan_token_ids(text.as_bytes());
            assert_eq!(got, Some((ids, text.len())));
            assert_eq!(got, reference_scan(text.as_bytes()));
        }
    }

    /// Long arrays in the shapes the comma run reads (`,` and `, `) with one or two damaged or
    /// unusual spots (a tab, a space before a comma, two spaces, long ids, leading zeros, a
    /// missing id, the end of the body early): the scanner's answer is the reference scanner's.
    #[test]
    fn long_arrays_agree_with_the_reference_scanner() {
        let mut rng = crate::rng::Rng::new(0x10a6);
        let odd = [
            "\t",
            "  ",
            " ,",
            ",,",
            "01",
            "00",
            "0",
            "12345678",
            "123456789",
            "4294967295",
            "4294967296",
            "99999999",
            "1.5",
            "-3",
            "]",
            "[",
            "\"",
            "e",
            "\n",
            "x",
            "é",
        ];
        for round in 0..4_000 {
            let n = 1 + rng.index(60);
            let sep = [",", ", "][rng.index(2)];
            let mut text = String::from("[");
            for k in 0..n {
                if k > 0 {
                    text.push_str(sep);
                }
                let digits = 1 + rng.index(8);
                let id = rng.next_u64() % 10u64.pow(digits as u32);
                text.push_str(&id.to_string());
            }
            text.push(']');
            for _ in 0..(round % 3) {
                let at = 1 + rng.index(text.len() - 1);
                if text.is_char_boundary(at) {
                    text.insert_str(at, odd[rng.index(odd.len())]);
                }
            }
            if round % 7 == 0 {
                text.truncate(rng.index(text.len() + 1));
            }
            text.push_str([", \"max_tokens\": 1}", "}", "", ",1,2,3,4,5,6,7,8"][rng.index(4)]);
            assert_eq!(
                scan_token_ids(text.as_bytes()),
                reference_scan(text.as_bytes()),
                "{text:?}"
            );
        }
    }

    /// The 16-byte run at every offset of its chunks: arrays shifted by 0 to 31 bytes (so that
    /// commas, spaces and the end of the array land on every position of a 16-byte load, and
    /// fewer than 16 or 24 bytes are left at every point), ids of 1 to 10 digits, `,` and `, `,
    /// and one odd spot (leading zeros, long ids, whitespace variants, damage) at each position:
    /// the scanner's answer is the reference scanner's.
    #[test]
    fn chunk_boundaries_agree_with_the_reference_scanner() {
        let mut rng = crate::rng::Rng::new(0xc4a2);
        let odd = [
            "",
            " ",
            "\t",
            "\n",
            "\r",
            "  ",
            " ,",
            ", ",
            ",,",
            "0",
            "00",
            "01",
            "007",
            "12345678",
            "99999999",
            "123456789",
            "4294967295",
            "4294967296",
            "]",
            "[",
            "-",
            ".",
            "e",
            "x",
            "\"",
        ];
        let mut accepted = 0;
        for round in 0..400 {
            let sep = [",", ", "][round % 2];
            let ids: Vec<String> = (0..12)
                .map(|_| {
                    let digits = 1 + rng.index(if round % 3 == 0 { 10 } else { 7 });
                    let id = rng.next_u64() % 10u64.pow(digits as u32);
                    id.min(u64::from(u32::MAX)).to_string()
                })
                .collect();
            let array = format!("[{}]", ids.join(sep));
            let shift = round % 32;
            for at in 0..=array.len() {
                let spot = odd[(round + at) % odd.len()];
                let mut text = " ".repeat(shift);
                text.push_str(&array);
                text.insert_str(shift + at, spot);
                text.push_str([", \"max_tokens\": 1}", "}", ""][at % 3]);
                // The scanner starts at the array's `[`.
                let text = &text.as_bytes()[shift..];
                let got = scan_token_ids(text);
                assert_eq!(
                    got,
                    reference_scan(text),
                    "{:?}",
                    String::from_utf8_lossy(text)
                );
                accepted += usize::from(got.is_some());
            }
        }
        assert!(accepted > 5_000, "{accepted}");
        // Every array length from empty to several chunks, compact and spaced, all 1-digit to
        // all 8-digit ids.
        for digits in 1..=8u32 {
            for sep in [",", ", "] {
                for n in 0..40u32 {
                    let ids: Vec<u32> = (0..n)
                        .map(|k| 10u32.pow(digits - 1) + k * 7 % 10u32.pow(digits - 1).max(1))
                        .collect();
                    let list: Vec<String> = ids.iter().map(u32::to_string).collect();
                    let text = format!("[{}]", list.join(sep));
                    assert_eq!(
                        scan_token_ids(text.as_bytes()),
                        Some((ids, text.len())),
                        "{text}"
                    );
                }
            }
        }
    }

    #[test]
    fn fast_path_differential() {
        let mut g = BodyGen(crate::rng::Rng::new(0xfa57));
        let mut fast_answers = 0;
        let rounds = 20_000;
        for round in 0..rounds {
            let body = g.body(round);
            if let Ok(r) = same_as_serde(&body) {
                // The structural search of the fallback rule finds what the parse records.
                let found = crate::priority::find_client_priority(body.as_bytes());
                assert_eq!(found.as_ref(), Some(&r.client_priority), "{body}");
                let edit = crate::priority::replace_client_priority(
                    body.as_bytes(),
                    &r.client_priority,
                    Some(1),
                )
                .expect(&body);
                let mut out = edit.insert;
                out.extend_from_slice(&body.as_bytes()[edit.drain..]);
                let v: serde_json::Value = serde_json::from_slice(&out).expect(&body);
                assert_eq!(v["priority"], 1, "{body}");
            }
            if parse_fast(
                body.as_bytes(),
                Endpoint::Completions,
                &ParseOptions::default(),
            )
            .is_some()
            {
                fast_answers += 1;
            }
        }
        // The fast pass answered for a good part of the bodies (the rest went to serde).
        assert!(fast_answers > rounds / 4, "{fast_answers}");
    }

    /// A lazy parse (ids left in the body) with its span's ids read back into `token_ids`, or,
    /// when they are not an array of ids, the body parsed again eagerly (as the filter does):
    /// the eager parse's answer, field for field, error for error.
    fn lazy_as_eager(body: &[u8], endpoint: Endpoint) -> Result<LlmRequest, RequestError> {
        let opts = ParseOptions {
            lazy_token_ids: true,
            ..ParseOptions::default()
        };
        let mut r = parse_request_with(body, endpoint, &opts)?;
        if let Some(span) = r.token_span.take() {
            assert!(r.token_ids.is_none());
            match span.ids(body) {
                Some(ids) => {
                    assert_eq!(span.check(body), Some(ids.len()));
                    r.token_ids = Some(ids);
                }
                None => return parse_request(body, endpoint),
            }
        }
        Ok(r)
    }

    fn lazy_agrees(body: &[u8]) -> bool {
        let mut lazy = false;
        for endpoint in [Endpoint::Completions, Endpoint::ChatCompletions] {
            assert_eq!(
                lazy_as_eager(body, endpoint),
                parse_request(body, endpoint),
                "{endpoint:?}: {}",
                String::from_utf8_lossy(body)
            );
            let opts = ParseOptions {
                lazy_token_ids: true,
                ..ParseOptions::default()
            };
            lazy |= parse_request_with(body, endpoint, &opts)
                .is_ok_and(|r| r.token_span.is_some_and(|s| s.check(body).is_some()));
        }
        lazy
    }

    /// The reader (in blocks of every size, then `finish`) and the counter agree with
    /// `scan_token_ids` on `text` (an array at its `[`): the same ids, count and refusals.
    /// Whether the counter took the array.
    fn count_agrees(text: &[u8]) -> bool {
        let want = scan_token_ids(text);
        let span = TokenSpan {
            open: 0,
            count: None,
        };
        assert_eq!(
            span.check(text),
            want.as_ref().map(|(ids, _)| ids.len()),
            "{}",
            String::from_utf8_lossy(text)
        );
        assert_eq!(span.ids(text), want.as_ref().map(|(ids, _)| ids.clone()));
        for block in [1, 3, 64] {
            let mut reader = span.reader(text);
            let mut got = Vec::new();
            let mut buf = vec![0u32; block];
            // Stop early, check the rest.
            for _ in 0..2 {
                if reader.read_block(buf.as_mut_slice()).is_some() {
                    got.extend_from_slice(&buf);
                }
            }
            let total = reader.finish();
            assert_eq!(total, want.as_ref().map(|(ids, _)| ids.len()));
            while reader.read_block(buf.as_mut_slice()).is_some() {
                got.extend_from_slice(&buf);
            }
            if let Some((ids, _)) = &want {
                assert_eq!(got.len(), ids.len() / block * block);
                assert_eq!(got[..], ids[..got.len()]);
            }
        }
        let Some((first, close, count)) = count_token_ids(text) else {
            return false;
        };
        let (ids, len) = want.expect("an accepted array is a valid one");
        assert_eq!((close + 1, count), (len, ids.len()));
        assert_eq!(first, skip_ws_for_test(text));
        assert_eq!(array_end(text), Some(close));
        true
    }

    fn skip_ws_for_test(text: &[u8]) -> usize {
        1 + text[1..]
            .iter()
            .take_while(|b| matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
            .count()
    }

    /// Random arrays (every BodyGen shape, cut short, damaged, with more body after them) and
    /// whole bodies: the lazy parse's answer is the eager one, and the counter's is the scanner's.
    #[test]
    fn lazy_parse_agrees_with_the_eager_parse() {
        let mut g = BodyGen(crate::rng::Rng::new(0x1a2e));
        let mut counted = 0;
        for round in 0..30_000 {
            let text = g.damaged_token_array(round);
            counted += usize::from(count_agrees(text.as_bytes()));
        }
        assert!(counted > 400, "{counted}");
        let mut lazy = 0;
        for round in 0..20_000 {
            let body = g.body(round);
            lazy += usize::from(lazy_agrees(body.as_bytes()));
        }
        assert!(lazy > 150, "{lazy}");
    }

    /// Long arrays in the shapes clients send (`,` and `, `, ids of 1 to 7 digits), shifted so
    /// that every byte lands on every position of the 64-byte masks, with one odd spot (leading
    /// zeros, 8-10-digit and over-u32 ids, whitespace variants, damage, the end early) at every
    /// position: the lazy parse's answer is the eager one.
    #[test]
    fn lazy_parse_with_an_odd_spot_at_every_position() {
        let mut rng = crate::rng::Rng::new(0x0dd5);
        let odd = [
            "",
            " ",
            "\t",
            "\n",
            "  ",
            " ,",
            ", ",
            ",,",
            "0",
            "00",
            "01",
            "007",
            "1234567",
            "12345678",
            "99999999",
            "123456789",
            "4294967295",
            "4294967296",
            "]",
            "[",
            "-",
            "-0",
            ".",
            "e",
            "x",
            "\"",
            "é",
        ];
        let mut lazy = 0;
        for round in 0..60 {
            let sep = [",", ", "][round % 2];
            let n = 30 + rng.index(30);
            let ids: Vec<String> = (0..n)
                .map(|_| {
                    let digits = 1 + rng.index(7);
                    (rng.next_u64() % 10u64.pow(digits as u32)).to_string()
                })
                .collect();
            let array = format!("[{}]", ids.join(sep));
            let pad = "x".repeat(round % 64);
            for at in 0..=array.len() {
                let spot = odd[(round + at) % odd.len()];
                let mut a = array.clone();
                if !a.is_char_boundary(at) {
                    continue;
                }
                a.insert_str(at, spot);
                let tail = [", \"max_tokens\": 1}", "}", ""][at % 3];
                let body = format!("{{\"model\": \"{pad}\", \"prompt\": {a}{tail}");
                lazy += usize::from(lazy_agrees(body.as_bytes()));
                let body = format!("{{\"nvext\": {{\"token_data\": {a}}}, \"model\": \"{pad}\"}}");
                lazy += usize::from(lazy_agrees(body.as_bytes()));
                // The array alone, ending where the body ends.
                count_agrees(a.as_bytes());
            }
        }
        assert!(lazy > 2_000, "{lazy}");
        // Every length from empty to a few hundred ids, at the end of the body or not.
        for digits in 1..=7u32 {
            for sep in [",", ", "] {
                for n in (0..300u32).step_by(7) {
                    let ids: Vec<u32> = (0..n)
                        .map(|k| 10u32.pow(digits - 1) + k * 7 % 10u32.pow(digits - 1).max(1))
                        .collect();
                    let list: Vec<String> = ids.iter().map(u32::to_string).collect();
                    let text = format!("[{}]", list.join(sep));
                    assert_eq!(count_agrees(text.as_bytes()), n > 0, "{text}");
                    let body = format!("{{\"prompt\": {text}}}");
                    assert!(lazy_agrees(body.as_bytes()), "{body}");
                }
            }
        }
    }

    /// Reads `text` (an array at its `[`) with the reader in blocks of `block` ids, into both
    /// outputs (`[u32]` and the little-endian bytes that are hashed), then `finish`: the ids and
    /// count of the reference scanner (for a refused array: no more than it would read).
    fn blocks_agree(text: &[u8], block: usize) {
        let want = reference_scan(text);
        let span = TokenSpan {
            open: 0,
            count: None,
        };
        let mut ids = span.reader(text);
        let mut bytes = span.reader(text);
        let mut buf = vec![0u32; block];
        let mut le = vec![[0u8; 4]; block];
        let mut got = Vec::new();
        loop {
            let a = ids.read_block(buf.as_mut_slice());
            let b = bytes.read_block(le.as_mut_slice());
            assert_eq!(a, b, "{}", String::from_utf8_lossy(text));
            if a.is_none() {
                break;
            }
            let from_bytes: Vec<u32> = le.iter().map(|b| u32::from_le_bytes(*b)).collect();
            assert_eq!(from_bytes, buf);
            got.extend_from_slice(&buf);
        }
        assert_eq!(ids.finish(), want.as_ref().map(|(ids, _)| ids.len()));
        match &want {
            Some((all, _)) => {
                assert_eq!(got.len(), all.len() / block * block);
                assert_eq!(
                    got[..],
                    all[..got.len()],
                    "{}",
                    String::from_utf8_lossy(text)
                );
            }
            None => assert!(ids.finish().is_none()),
        }
    }

    /// The 64-byte mask run: on a clean array it reads every id whose comma is at least 72
    /// bytes before the end (the rest is left to the one-id-at-a-time runs), with the values
    /// and the stopping point of the reference scanner; stopped by a full output mid-window, it
    /// resumes exactly where it stopped.
    #[test]
    fn mask_run_reads_clean_arrays_and_stops_where_it_should() {
        for sep in [",", ", "] {
            for digits in 1..=7u32 {
                let ids: Vec<u32> = (0..400u32)
                    .map(|k| {
                        let low = if digits == 1 {
                            0
                        } else {
                            10u32.pow(digits - 1)
                        };
                        low + k.wrapping_mul(2_654_435_761) % (10u32.pow(digits) - low)
                    })
                    .collect();
                let list: Vec<String> = ids.iter().map(u32::to_string).collect();
                let text = format!("[{}]", list.join(sep));
                let bytes = text.as_bytes();
                let mut out = vec![0u32; ids.len()];
                let (i, n) = mask_run(bytes, 1, out.as_mut_slice(), 0);
                assert!(n > 0 && i + 72 > bytes.len(), "{digits} {sep:?}: {i} {n}");
                assert!(n < ids.len());
                assert_eq!(out[..n], ids[..n]);
                // Where the (n+1)-th id starts.
                let prefix = format!("[{}{sep}", list[..n].join(sep));
                assert_eq!(i, prefix.len());
                // A small output: full mid-window, then resumed.
                let mut small = vec![[0u8; 4]; 5];
                let (mut at, mut read) = (1, 0);
                let mut got = Vec::new();
                loop {
                    let (i2, n2) = mask_run(bytes, at, small.as_mut_slice(), 0);
                    if n2 == 0 {
                        break;
                    }
                    got.extend(small[..n2].iter().map(|b| u32::from_le_bytes(*b)));
                    read += n2;
                    at = i2;
                }
                assert_eq!(got[..], ids[..read]);
                // It stopped for the end of the array only.
                assert!(at + 72 > bytes.len() && read > 5, "{read} {n}");
            }
        }
    }

    /// Long arrays (hundreds of ids, so that the 64-byte mask run reads most of them) with ids of
    /// every length from 1 to 10 digits, odd ids (leading zeros, negatives, floats, exponents,
    /// over `u32::MAX`) and whitespace variants mixed in at random, read in blocks that split
    /// ids across block boundaries: the reference scanner's ids and refusals.
    #[test]
    fn long_arrays_read_in_blocks_agree_with_the_reference_scanner() {
        let mut rng = crate::rng::Rng::new(0xb10c);
        let odd = [
            "0",
            "00",
            "01",
            "-1",
            "-0",
            "1.5",
            "1e3",
            "1E+2",
            "4294967295",
            "4294967296",
            "99999999999",
            "12345678",
            "123456789",
            "1234567890",
            "x",
            "\"1\"",
            "[1]",
            "",
        ];
        let seps = [",", ", ", " ,", ",  ", ",\t", ",\n", "\n,", ",,", " "];
        let mut accepted = 0;
        for round in 0..1_500 {
            let n = 50 + rng.index(300);
            let max_digits = 1 + rng.index(10);
            let clean = round % 3 == 0;
            let mut text = String::from("[");
            for k in 0..n {
                if k > 0 {
                    let odd_sep = !clean && rng.index(200) == 0;
                    text.push_str(if odd_sep {
                        seps[rng.index(seps.len())]
                    } else {
                        [",", ", "][round % 2]
                    });
                }
                if !clean && rng.index(300) == 0 {
                    text.push_str(odd[rng.index(odd.len())]);
                } else {
                    let digits = 1 + rng.index(max_digits);
                    let id = rng.next_u64() % 10u64.pow(digits as u32);
                    text.push_str(&id.min(u64::from(u32::MAX)).to_string());
                }
            }
            text.push(']');
            if round % 11 == 0 {
                text.truncate(rng.index(text.len() + 1));
            }
            let want = reference_scan(text.as_bytes());
            assert_eq!(scan_token_ids(text.as_bytes()), want, "{text:?}");
            accepted += usize::from(want.is_some());
            for block in [1, 2, 7, 64, 100] {
                blocks_agree(text.as_bytes(), block);
            }
        }
        assert!(accepted > 600, "{accepted}");
    }
}
