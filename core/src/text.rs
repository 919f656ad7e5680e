//! Bounded excerpts of untrusted text (client bodies and headers, worker replies) for error
//! bodies and log lines: whatever a peer sends, what the filter echoes stays short.

use std::borrow::Cow;

/// Longest excerpt of untrusted text in an error body or log line, in bytes.
pub const MAX_EXCERPT_BYTES: usize = 160;

/// `text` cut to at most `max_bytes` (on a character boundary) with `…` appended when cut.
pub fn excerpt(text: &str, max_bytes: usize) -> Cow<'_, str> {
    if text.len() <= max_bytes {
        return Cow::Borrowed(text);
    }
    let mut end = max_bytes;
    while end > 0 && !text.is_char_boundary(end) {
        end -= 1;
    }
    let head = text.get(..end).unwrap_or_default();
    Cow::Owned(format!("{head}… ({} bytes)", text.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_text_is_untouched_and_long_text_is_cut_on_a_char_boundary() {
        assert_eq!(excerpt("abc", 3), "abc");
        assert_eq!(excerpt("abcdef", 3), "abc… (6 bytes)");
        // 'é' is two bytes: a cut inside it backs off to the boundary before it.
        assert_eq!(excerpt("aéb", 2), "a… (4 bytes)");
        let huge = "7,".repeat(700_000);
        assert!(excerpt(&huge, MAX_EXCERPT_BYTES).len() < MAX_EXCERPT_BYTES + 32);
    }
}
