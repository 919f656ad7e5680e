//! Exact prompt ids for text requests from the engine's tokenizer: the reply formats of vLLM's
//! render and tokenize endpoints, and the bounded per-VM cache of rendered prompts.
//!
//! Replies (vLLM 0.32): `/v1/chat/completions/render` answers one `GenerateRequest`
//! `{"request_id": .., "token_ids": [..], "sampling_params": {..}, ..}`;
//! `/v1/completions/render` a list of them (one per prompt; the filter routes one prompt);
//! `/tokenize` `{"count": n, "max_model_len": m, "tokens": [..]}`.

use std::collections::VecDeque;
use std::rc::Rc;

use hashbrown::HashMap;
use serde::Deserialize;

#[derive(Deserialize)]
struct Rendered {
    #[serde(default)]
    token_ids: Option<Vec<u32>>,
    #[serde(default)]
    tokens: Option<Vec<u32>>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Reply {
    One(Rendered),
    Many(Vec<Rendered>),
}

/// Why a tokenizer reply gave no ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RenderFailure {
    /// No answer within `tokenizer.timeout_ms`.
    Timeout,
    /// A non-2xx status, or no response (connect failure, reset).
    Error,
    /// A 2xx reply that is not one of the known shapes, is empty, or is too large.
    BadReply,
    /// The call could not be sent.
    Unavailable,
}

impl RenderFailure {
    pub fn as_str(self) -> &'static str {
        match self {
            RenderFailure::Timeout => "render_timeout",
            RenderFailure::Error => "render_error",
            RenderFailure::BadReply => "render_bad_reply",
            RenderFailure::Unavailable => "render_unavailable",
        }
    }
}

/// The prompt ids in a render or tokenize reply body.
pub fn parse_reply(body: &[u8]) -> Result<Vec<u32>, RenderFailure> {
    let reply: Reply = serde_json::from_slice(body).map_err(|_| RenderFailure::BadReply)?;
    let one = match reply {
        Reply::One(r) => r,
        Reply::Many(list) => list.into_iter().next().ok_or(RenderFailure::BadReply)?,
    };
    match one.token_ids.or(one.tokens) {
        Some(ids) if !ids.is_empty() => Ok(ids),
        _ => Err(RenderFailure::BadReply),
    }
}

/// Classifies a finished call: `status` is `None` when Envoy gave no response headers.
/// Envoy answers a call that ran past its timeout with a local 504.
pub fn classify(
    status: Option<&str>,
    body_bytes: usize,
    max_bytes: usize,
) -> Result<(), RenderFailure> {
    match status {
        None => Err(RenderFailure::Error),
        Some("504") => Err(RenderFailure::Timeout),
        Some(s) if s.starts_with('2') => {
            if body_bytes == 0 || body_bytes > max_bytes {
                Err(RenderFailure::BadReply)
            } else {
                Ok(())
            }
        }
        Some(_) => Err(RenderFailure::Error),
    }
}

/// Rendered prompts by key, bounded by entries and total ids; the oldest go first.
pub struct RenderCache {
    map: HashMap<u64, Rc<Vec<u32>>>,
    order: VecDeque<u64>,
    tokens: usize,
    max_entries: usize,
    max_tokens: usize,
    pub hits: u64,
    pub misses: u64,
}

impl RenderCache {
    pub fn new(max_entries: usize, max_tokens: usize) -> RenderCache {
        RenderCache {
            map: HashMap::new(),
            order: VecDeque::new(),
            tokens: 0,
            max_entries,
            max_tokens,
            hits: 0,
            misses: 0,
        }
    }

    pub fn get(&mut self, key: u64) -> Option<Rc<Vec<u32>>> {
        let found = self.map.get(&key).cloned();
        if found.is_some() {
            self.hits += 1;
        } else {
            self.misses += 1;
        }
        found
    }

    pub fn insert(&mut self, key: u64, ids: Rc<Vec<u32>>) {
        if self.max_entries == 0 || ids.len() > self.max_tokens || self.map.contains_key(&key) {
            return;
        }
        self.tokens += ids.len();
        self.map.insert(key, ids);
        self.order.push_back(key);
        while self.map.len() > self.max_entries || self.tokens > self.max_tokens {
            let Some(old) = self.order.pop_front() else {
                break;
            };
            if let Some(ids) = self.map.remove(&old) {
                self.tokens -= ids.len();
            }
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn tokens(&self) -> usize {
        self.tokens
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn reply_shapes_of_render_and_tokenize() {
        let chat = br#"{"request_id": "x", "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 5}, "model": "m"}"#;
        assert_eq!(parse_reply(chat), Ok(vec![1, 2, 3]));
        let cmpl = br#"[{"request_id": "x", "token_ids": [4, 5], "features": null}]"#;
        assert_eq!(parse_reply(cmpl), Ok(vec![4, 5]));
        // Replies captured from vLLM 0.32 (`--enable-scale-out`, the tiny test model).
        let real_cmpl = br#"[{"request_id":"cmpl-99f40ea41e3022b7","token_ids":[0,0],"token_offsets":null,"features":null,"content_parts":null,"sampling_params":{"presence_penalty":0.0,"frequency_penalty":0.0,"repetition_penalty":1.0,"temperature":1.0,"top_p":1.0,"min_p":0.0,"stop":[],"stop_token_ids":[],"max_tokens":4,"output_kind":2,"skip_clone":true,"bad_words":[],"skip_reading_prefix_cache":false},"model":"tiny","reasoning_ended":null,"reasoning_parser_kwargs":null,"return_token_ids":null,"output_mode":"tokens","stream":false,"stream_options":null,"cache_salt":null,"priority":0,"kv_transfer_params":null,"ec_transfer_params":null}]"#;
        assert_eq!(parse_reply(real_cmpl), Ok(vec![0, 0]));
        let real_chat = br#"{"request_id":"chatcmpl-a9f0b0d6147d1c8d","token_ids":[0,0,0,0,0,0],"token_offsets":null,"features":null,"content_parts":null,"sampling_params":{"presence_penalty":0.0,"frequency_penalty":0.0,"repetition_penalty":1.0,"temperature":1.0,"top_p":1.0,"min_p":0.0,"stop":[],"stop_token_ids":[],"max_tokens":4,"output_kind":1,"skip_clone":true,"bad_words":[],"skip_reading_prefix_cache":false},"model":"tiny","reasoning_ended":null,"reasoning_parser_kwargs":null,"return_token_ids":null,"output_mode":"tokens","stream":true,"stream_options":null,"cache_salt":null,"priority":0,"kv_transfer_params":null,"ec_transfer_params":null}"#;
        assert_eq!(parse_reply(real_chat), Ok(vec![0; 6]));
        let real_tok = br#"{"count":2,"max_model_len":512,"tokens":[0,0],"token_strs":null}"#;
        assert_eq!(parse_reply(real_tok), Ok(vec![0, 0]));
        let tok = br#"{"count": 2, "max_model_len": 2048, "tokens": [6, 7]}"#;
        assert_eq!(parse_reply(tok), Ok(vec![6, 7]));
        for bad in [
            &b"[]"[..],
            b"{}",
            b"{\"token_ids\": []}",
            b"{\"token_ids\": [-1]}",
            b"nope",
        ] {
            assert_eq!(parse_reply(bad), Err(RenderFailure::BadReply));
        }
    }

    #[test]
    fn statuses() {
        assert_eq!(classify(Some("200"), 10, 100), Ok(()));
        assert_eq!(
            classify(Some("200"), 101, 100),
            Err(RenderFailure::BadReply)
        );
        assert_eq!(classify(Some("504"), 10, 100), Err(RenderFailure::Timeout));
        assert_eq!(classify(Some("500"), 10, 100), Err(RenderFailure::Error));
        assert_eq!(classify(None, 0, 100), Err(RenderFailure::Error));
    }

    #[test]
    fn cache_is_bounded_by_entries_and_tokens() {
        let mut c = RenderCache::new(2, 10);
        c.insert(1, Rc::new(vec![0; 4]));
        c.insert(2, Rc::new(vec![0; 4]));
        c.insert(3, Rc::new(vec![0; 4]));
        assert_eq!((c.len(), c.tokens()), (2, 8));
        assert!(c.get(1).is_none());
        assert!(c.get(3).is_some());
        c.insert(4, Rc::new(vec![0; 9]));
        assert_eq!((c.len(), c.tokens()), (1, 9));
        c.insert(5, Rc::new(vec![0; 11])); // larger than the whole budget: not kept
        assert_eq!(c.len(), 1);
        assert_eq!((c.hits, c.misses), (1, 1));
        let mut off = RenderCache::new(0, 10);
        off.insert(1, Rc::new(vec![1]));
        assert!(off.is_empty());
    }
}
