//! The rendered text of a text request and its prefix hashes, for routing text without token
//! ids (approximate mode) and as the key of the tokenizer cache.
//!
//! Chat: each message in order as `role + "\n" + content + "\n"` (content parts' `text` joined),
//! the simplest template that keeps roles and order; two conversations share a text prefix
//! exactly when they share their leading messages. Completions: the `prompt` string.
//! The text is cut into fixed `chunk_bytes` chunks, hashed as a chain (each chunk's hash seeds
//! the next), so equal hashes name equal prefixes, like KV block sequence hashes. A trailing
//! partial chunk is not hashed (as a partial KV block is not cached).

use serde::Deserialize;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::request::Endpoint;
use crate::types::SequenceHash;

/// Seed of the first chunk; keeps text hashes apart from token block hashes (seed 1337).
const TEXT_SEED: u64 = 0x7e87_7e87;

#[derive(Deserialize)]
struct ChatBody {
    #[serde(default)]
    messages: Option<Vec<Message>>,
}

#[derive(Deserialize)]
struct Message {
    #[serde(default)]
    role: Option<String>,
    #[serde(default)]
    content: Option<Content>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<Part>),
    Other(serde::de::IgnoredAny),
}

#[derive(Deserialize)]
struct Part {
    #[serde(default)]
    text: Option<String>,
}

#[derive(Deserialize)]
struct CompletionBody {
    #[serde(default)]
    prompt: Option<PromptField>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum PromptField {
    Text(String),
    Other(serde::de::IgnoredAny),
}

/// The request's text as described in the module docs; `None` when it has none (token ids, no
/// messages, unreadable body).
pub fn prompt_text(body: &[u8], endpoint: Endpoint) -> Option<String> {
    match endpoint {
        Endpoint::ChatCompletions => {
            let chat: ChatBody = serde_json::from_slice(body).ok()?;
            let messages = chat.messages?;
            let mut text = String::new();
            for m in &messages {
                text.push_str(m.role.as_deref().unwrap_or(""));
                text.push('\n');
                match &m.content {
                    Some(Content::Text(s)) => text.push_str(s),
                    Some(Content::Parts(parts)) => {
                        for p in parts {
                            text.push_str(p.text.as_deref().unwrap_or(""));
                        }
                    }
                    Some(Content::Other(_)) | None => {}
                }
                text.push('\n');
            }
            (!text.is_empty()).then_some(text)
        }
        Endpoint::Completions => {
            let c: CompletionBody = serde_json::from_slice(body).ok()?;
            match c.prompt? {
                PromptField::Text(s) if !s.is_empty() => Some(s),
                _ => None,
            }
        }
    }
}

/// Chained hashes of the text's full `chunk_bytes` chunks, salted with the LoRA name; at most
/// `max_chunks`.
pub fn text_prefix_hashes(
    text: &str,
    chunk_bytes: usize,
    lora_name: Option<&str>,
    max_chunks: usize,
) -> Vec<SequenceHash> {
    if chunk_bytes == 0 {
        return Vec::new();
    }
    let mut seed = match lora_name {
        Some(l) => xxh3_64_with_seed(l.as_bytes(), TEXT_SEED),
        None => TEXT_SEED,
    };
    let mut out = Vec::new();
    for chunk in text.as_bytes().chunks_exact(chunk_bytes).take(max_chunks) {
        seed = xxh3_64_with_seed(chunk, seed);
        out.push(SequenceHash(seed));
    }
    out
}

/// Key of one prompt in the tokenizer cache: endpoint, model, LoRA and text.
pub fn render_cache_key(
    endpoint: Endpoint,
    model: Option<&str>,
    lora: Option<&str>,
    text: &str,
) -> u64 {
    let tag: &[u8] = match endpoint {
        Endpoint::ChatCompletions => b"chat",
        Endpoint::Completions => b"cmpl",
    };
    let mut seed = xxh3_64_with_seed(tag, TEXT_SEED);
    seed = xxh3_64_with_seed(model.unwrap_or("").as_bytes(), seed);
    seed = xxh3_64_with_seed(lora.unwrap_or("").as_bytes(), seed);
    xxh3_64_with_seed(text.as_bytes(), seed)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    #[test]
    fn chat_text_keeps_roles_and_order() {
        let body = br#"{"model": "m", "messages": [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "!"}]},
            {"role": "assistant", "content": null, "tool_calls": []}]}"#;
        assert_eq!(
            prompt_text(body, Endpoint::ChatCompletions).unwrap(),
            "system\nbe brief\nuser\nhi!\nassistant\n\n"
        );
        assert_eq!(
            prompt_text(br#"{"prompt": "abc"}"#, Endpoint::Completions).unwrap(),
            "abc"
        );
        assert_eq!(
            prompt_text(br#"{"prompt": [1, 2]}"#, Endpoint::Completions),
            None
        );
        assert_eq!(
            prompt_text(br#"{"messages": 3}"#, Endpoint::ChatCompletions),
            None
        );
    }

    #[test]
    fn equal_prefixes_hash_equal_and_partial_chunks_are_skipped() {
        let a = text_prefix_hashes(&"x".repeat(10), 4, None, 100);
        let b = text_prefix_hashes(&format!("{}yy", "x".repeat(8)), 4, None, 100);
        assert_eq!(a.len(), 2);
        assert_eq!(a, b);
        let c = text_prefix_hashes(&format!("y{}", "x".repeat(9)), 4, None, 100);
        assert_ne!(a[0], c[0]);
        assert_ne!(a[1], c[1]);
        // The salt separates adapters; the cap bounds the work.
        assert_ne!(a, text_prefix_hashes(&"x".repeat(10), 4, Some("sql"), 100));
        assert_eq!(text_prefix_hashes(&"x".repeat(100), 4, None, 3).len(), 3);
    }
}
