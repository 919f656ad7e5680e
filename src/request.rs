//! OpenAI request body -> [`LlmRequest`]: the few fields the router reads.
//!
//! Prompts can be 100k+ tokens, so the body is parsed in one pass by hand-written serde visitors
//! that keep only what routing needs: token ids go straight into a `Vec<u32>`, text is only
//! counted (`text_chars`), and every other value is skipped with `IgnoredAny`. No `Value` tree is
//! built. Which field was being read is tracked so that a type error names it
//! (`nvext.dp_rank: invalid type: string "1", expected u32 ...`).
//!
//! Fields (DESIGN.md "Request fields"): `model`; `prompt` (completions only: a string, an array of
//! token ids, or an array of arrays/strings = a batch, rejected); `messages` (chat only: every
//! string inside counts towards `text_chars`, since roles, contents and tool calls all reach the
//! chat template); `stream`; `nvext.token_data` (token ids, both endpoints, takes precedence over
//! `prompt` ids); `nvext.backend_instance_id` / `nvext.dp_rank` (pin); `nvext.allowed_worker_ids`;
//! `nvext.required_taints`; `nvext.preferred_taints` (`{taint: weight}`); `nvext.agent_hints.osl`;
//! `nvext.lora_name`. A top-level `lora_name` and `base:adapter` model names are not interpreted.
//! `null` means absent everywhere.

use std::cell::Cell;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;

use crate::types::{DpRank, WorkerId};

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
    let worker_id = match worker_id {
        None => None,
        Some(s) => Some(
            s.trim()
                .parse::<WorkerId>()
                .map_err(|e| RequestError::BadField {
                    field: HEADER_WORKER_ID,
                    detail: format!("\"{s}\" is not an unsigned 64-bit worker id: {e}"),
                })?,
        ),
    };
    let dp_rank = match dp_rank {
        None => None,
        Some(s) => Some(
            s.trim()
                .parse::<DpRank>()
                .map_err(|e| RequestError::BadField {
                    field: HEADER_DP_RANK,
                    detail: format!("\"{s}\" is not an unsigned 32-bit DP rank: {e}"),
                })?,
        ),
    };
    Ok(Pin { worker_id, dp_rank })
}

/// What the router needs from one request body.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LlmRequest {
    pub model: Option<String>,
    /// `nvext.token_data`, else `prompt` as token ids (completions).
    pub token_ids: Option<Vec<u32>>,
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
    /// Characters of the text prompt (completions `prompt` string) or of every string inside
    /// `messages` (chat); used to estimate `isl_tokens` when there are no token ids.
    pub text_chars: usize,
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
        }
    }
}

impl std::error::Error for RequestError {}

/// Parses a request body for `endpoint`. See the module docs for the fields read.
pub fn parse_request(body: &[u8], endpoint: Endpoint) -> Result<LlmRequest, RequestError> {
    let first = body.iter().find(|b| !b.is_ascii_whitespace());
    match first {
        None => return Err(RequestError::EmptyBody),
        Some(b'{') => {}
        Some(_) => {
            return match serde_json::from_slice::<IgnoredAny>(body) {
                Ok(_) => Err(RequestError::NotAnObject),
                Err(e) => Err(RequestError::InvalidJson {
                    detail: e.to_string(),
                }),
            }
        }
    }
    let ctx = Ctx {
        field: Cell::new("(body)"),
        batched: Cell::new(false),
    };
    let mut de = serde_json::Deserializer::from_slice(body);
    let result = TopSeed {
        ctx: &ctx,
        endpoint,
    }
    .deserialize(&mut de)
    .and_then(|req| de.end().map(|()| req));
    result.map_err(|e| {
        if ctx.batched.get() {
            return RequestError::BatchedPrompt;
        }
        match e.classify() {
            serde_json::error::Category::Data => RequestError::BadField {
                field: ctx.field.get(),
                detail: e.to_string(),
            },
            _ => RequestError::InvalidJson {
                detail: e.to_string(),
            },
        }
    })
}

/// Parse-wide state: the field being read (for error messages) and the batch marker.
struct Ctx {
    field: Cell<&'static str>,
    batched: Cell<bool>,
}

/// Resolves an object key to its index in a fixed list without allocating.
struct KeySeed(&'static [&'static str]);

impl<'de> DeserializeSeed<'de> for KeySeed {
    type Value = Option<usize>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for KeySeed {
    type Value = Option<usize>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object key")
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(self.0.iter().position(|k| *k == v))
    }
}

const TOP_KEYS: &[&str] = &["model", "prompt", "messages", "stream", "nvext"];
const NVEXT_KEYS: &[&str] = &[
    "token_data",
    "backend_instance_id",
    "dp_rank",
    "allowed_worker_ids",
    "required_taints",
    "preferred_taints",
    "agent_hints",
    "lora_name",
];

struct TopSeed<'c> {
    ctx: &'c Ctx,
    endpoint: Endpoint,
}

impl<'de> DeserializeSeed<'de> for TopSeed<'_> {
    type Value = LlmRequest;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<LlmRequest, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for TopSeed<'_> {
    type Value = LlmRequest;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a request object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<LlmRequest, A::Error> {
        let ctx = self.ctx;
        let mut req = LlmRequest::default();
        let mut prompt_tokens: Option<Vec<u32>> = None;
        let mut nvext_tokens: Option<Vec<u32>> = None;
        while let Some(key) = map.next_key_seed(KeySeed(TOP_KEYS))? {
            match key {
                Some(0) => {
                    ctx.field.set("model");
                    req.model = map.next_value()?;
                }
                Some(1) if self.endpoint == Endpoint::Completions => {
                    ctx.field.set("prompt");
                    match map.next_value_seed(PromptSeed { ctx })? {
                        Prompt::Absent => {}
                        Prompt::Text(chars) => req.text_chars = chars,
                        Prompt::Tokens(ids) => prompt_tokens = Some(ids),
                    }
                }
                Some(2) if self.endpoint == Endpoint::ChatCompletions => {
                    ctx.field.set("messages");
                    req.text_chars = map.next_value_seed(CharCount)?;
                }
                Some(3) => {
                    ctx.field.set("stream");
                    req.stream = map.next_value::<Option<bool>>()?.unwrap_or(false);
                }
                Some(4) => {
                    ctx.field.set("nvext");
                    map.next_value_seed(NvextSeed {
                        ctx,
                        req: &mut req,
                        tokens: &mut nvext_tokens,
                    })?;
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
            ctx.field.set("(body)");
        }
        req.token_ids = nvext_tokens.or(prompt_tokens);
        Ok(req)
    }
}

enum Prompt {
    Absent,
    Text(usize),
    Tokens(Vec<u32>),
}

struct PromptSeed<'c> {
    ctx: &'c Ctx,
}

impl<'de> DeserializeSeed<'de> for PromptSeed<'_> {
    type Value = Prompt;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Prompt, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for PromptSeed<'_> {
    type Value = Prompt;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string or an array of token ids")
    }
    fn visit_unit<E: de::Error>(self) -> Result<Prompt, E> {
        Ok(Prompt::Absent)
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Prompt, E> {
        Ok(Prompt::Text(v.chars().count()))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Prompt, A::Error> {
        let mut ids = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 20));
        match seq.next_element_seed(FirstPromptElement { ctx: self.ctx })? {
            None => return Ok(Prompt::Tokens(ids)),
            Some(id) => ids.push(id),
        }
        while let Some(id) = seq.next_element::<u32>()? {
            ids.push(id);
        }
        Ok(Prompt::Tokens(ids))
    }
}

/// The first element of a `prompt` array: a token id, or a string / array (a batch).
struct FirstPromptElement<'c> {
    ctx: &'c Ctx,
}

impl<'de> DeserializeSeed<'de> for FirstPromptElement<'_> {
    type Value = u32;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<u32, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for FirstPromptElement<'_> {
    type Value = u32;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a token id (u32)")
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<u32, E> {
        u32::try_from(v).map_err(|_| E::invalid_value(de::Unexpected::Unsigned(v), &self))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<u32, E> {
        u32::try_from(v).map_err(|_| E::invalid_value(de::Unexpected::Signed(v), &self))
    }
    fn visit_str<E: de::Error>(self, _v: &str) -> Result<u32, E> {
        self.ctx.batched.set(true);
        Err(E::custom("batched prompt"))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, _seq: A) -> Result<u32, A::Error> {
        self.ctx.batched.set(true);
        Err(de::Error::custom("batched prompt"))
    }
}

/// Counts the characters of every string inside a value (object keys excluded).
struct CharCount;

impl<'de> DeserializeSeed<'de> for CharCount {
    type Value = usize;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<usize, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for CharCount {
    type Value = usize;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E: de::Error>(self, _v: bool) -> Result<usize, E> {
        Ok(0)
    }
    fn visit_i64<E: de::Error>(self, _v: i64) -> Result<usize, E> {
        Ok(0)
    }
    fn visit_u64<E: de::Error>(self, _v: u64) -> Result<usize, E> {
        Ok(0)
    }
    fn visit_f64<E: de::Error>(self, _v: f64) -> Result<usize, E> {
        Ok(0)
    }
    fn visit_unit<E: de::Error>(self) -> Result<usize, E> {
        Ok(0)
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<usize, E> {
        Ok(v.chars().count())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<usize, A::Error> {
        let mut n = 0usize;
        while let Some(c) = seq.next_element_seed(CharCount)? {
            n = n.saturating_add(c);
        }
        Ok(n)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<usize, A::Error> {
        let mut n = 0usize;
        while map.next_key::<IgnoredAny>()?.is_some() {
            n = n.saturating_add(map.next_value_seed(CharCount)?);
        }
        Ok(n)
    }
}

#[derive(Deserialize)]
struct AgentHints {
    #[serde(default)]
    osl: Option<u32>,
}

struct NvextSeed<'c, 'r> {
    ctx: &'c Ctx,
    req: &'r mut LlmRequest,
    tokens: &'r mut Option<Vec<u32>>,
}

impl<'de> DeserializeSeed<'de> for NvextSeed<'_, '_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for NvextSeed<'_, '_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object")
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let ctx = self.ctx;
        let req = self.req;
        while let Some(key) = map.next_key_seed(KeySeed(NVEXT_KEYS))? {
            match key {
                Some(0) => {
                    ctx.field.set("nvext.token_data");
                    *self.tokens = map.next_value::<Option<Vec<u32>>>()?;
                }
                Some(1) => {
                    ctx.field.set("nvext.backend_instance_id");
                    req.pin.worker_id = map.next_value()?;
                }
                Some(2) => {
                    ctx.field.set("nvext.dp_rank");
                    req.pin.dp_rank = map.next_value()?;
                }
                Some(3) => {
                    ctx.field.set("nvext.allowed_worker_ids");
                    req.allowed_worker_ids = map.next_value()?;
                }
                Some(4) => {
                    ctx.field.set("nvext.required_taints");
                    req.required_taints =
                        map.next_value::<Option<Vec<String>>>()?.unwrap_or_default();
                }
                Some(5) => {
                    ctx.field.set("nvext.preferred_taints");
                    req.preferred_taints = map.next_value_seed(TaintWeights)?;
                }
                Some(6) => {
                    ctx.field.set("nvext.agent_hints");
                    req.osl_hint_tokens =
                        map.next_value::<Option<AgentHints>>()?.and_then(|h| h.osl);
                }
                Some(7) => {
                    ctx.field.set("nvext.lora_name");
                    req.lora_name = map.next_value()?;
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
            ctx.field.set("nvext");
        }
        Ok(())
    }
}

/// `{taint: weight}` in body order; `null` = none.
struct TaintWeights;

impl<'de> DeserializeSeed<'de> for TaintWeights {
    type Value = Vec<(String, f64)>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for TaintWeights {
    type Value = Vec<(String, f64)>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object mapping taint names to numeric weights")
    }
    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(Vec::new())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut out = Vec::new();
        while let Some((k, w)) = map.next_entry::<String, f64>()? {
            if !w.is_finite() {
                return Err(de::Error::custom(format_args!(
                    "weight of \"{k}\" must be finite"
                )));
            }
            out.push((k, w));
        }
        Ok(out)
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
}
