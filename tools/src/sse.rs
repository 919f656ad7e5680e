//! Server-sent events on the client side: an incremental parser ([`SseParser`]) and an async
//! reader over a streamed `reqwest` response ([`EventStream`]) that stamps each event with the
//! arrival time of the bytes that completed it (the load generator's TTFT and ITL come from
//! these stamps).

use std::collections::VecDeque;
use std::io;
use std::time::Instant;

use serde_json::Value;

/// Largest event (bytes between blank lines) accepted; a longer one is an error, so a broken
/// server cannot make a client buffer without bound.
pub const MAX_EVENT_BYTES: usize = 16 << 20;

/// One server-sent event: the joined `data:` lines, the optional `event:` name, and the arrival
/// time of the bytes that completed it.
#[derive(Debug, Clone)]
pub struct SseEvent {
    pub at: Instant,
    pub event: Option<String>,
    pub data: String,
}

impl SseEvent {
    /// `data: [DONE]`, the OpenAI end-of-stream marker.
    pub fn is_done(&self) -> bool {
        self.data.trim() == "[DONE]"
    }

    pub fn json(&self) -> serde_json::Result<Value> {
        serde_json::from_str(&self.data)
    }
}

/// Splits a byte stream into events. Accepts LF and CRLF line endings; blocks without a `data:`
/// line (comments, keep-alives) produce no event.
#[derive(Debug, Default)]
pub struct SseParser {
    buf: Vec<u8>,
    /// How far `buf` has been searched for a blank line.
    scanned: usize,
}

impl SseParser {
    /// Adds bytes that arrived at `at`; complete events are appended to `out`.
    pub fn feed(
        &mut self,
        bytes: &[u8],
        at: Instant,
        out: &mut VecDeque<SseEvent>,
    ) -> io::Result<()> {
        self.buf
            .extend(bytes.iter().copied().filter(|&b| b != b'\r'));
        loop {
            let from = self.scanned.saturating_sub(1);
            let Some(pos) = find_blank_line(self.buf.get(from..).unwrap_or_default()) else {
                self.scanned = self.buf.len();
                break;
            };
            let end = from + pos + 2;
            let block: Vec<u8> = self.buf.drain(..end).collect();
            self.scanned = 0;
            if let Some(ev) = parse_block(&block, at) {
                out.push_back(ev);
            }
        }
        if self.buf.len() > MAX_EVENT_BYTES {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("server-sent event larger than {MAX_EVENT_BYTES} bytes"),
            ));
        }
        Ok(())
    }

    /// The end of the stream: a final event not followed by a blank line still counts.
    pub fn finish(&mut self, at: Instant, out: &mut VecDeque<SseEvent>) {
        let rest = std::mem::take(&mut self.buf);
        self.scanned = 0;
        if let Some(ev) = parse_block(&rest, at) {
            out.push_back(ev);
        }
    }

    /// Bytes received but not yet part of a complete event.
    pub fn take_pending(&mut self) -> Vec<u8> {
        self.scanned = 0;
        std::mem::take(&mut self.buf)
    }
}

fn find_blank_line(hay: &[u8]) -> Option<usize> {
    hay.windows(2).position(|w| w == b"\n\n")
}

fn parse_block(block: &[u8], at: Instant) -> Option<SseEvent> {
    let text = String::from_utf8_lossy(block);
    let mut data: Option<String> = None;
    let mut event = None;
    for line in text.split('\n') {
        if line.is_empty() || line.starts_with(':') {
            continue;
        }
        let (field, value) = line.split_once(':').unwrap_or((line, ""));
        let value = value.strip_prefix(' ').unwrap_or(value);
        match field {
            "data" => match &mut data {
                Some(d) => {
                    d.push('\n');
                    d.push_str(value);
                }
                None => data = Some(value.to_string()),
            },
            "event" => event = Some(value.to_string()),
            _ => {}
        }
    }
    data.map(|data| SseEvent { at, event, data })
}

/// Reads the events of a streamed response as they arrive.
pub struct EventStream {
    response: Option<reqwest::Response>,
    parser: SseParser,
    pending: VecDeque<SseEvent>,
}

impl EventStream {
    pub fn new(response: reqwest::Response) -> Self {
        EventStream {
            response: Some(response),
            parser: SseParser::default(),
            pending: VecDeque::new(),
        }
    }

    /// The next complete event; `Ok(None)` at the end of the body. Cancel-safe: a call dropped
    /// while waiting loses no bytes.
    pub async fn next(&mut self) -> io::Result<Option<SseEvent>> {
        loop {
            if let Some(ev) = self.pending.pop_front() {
                return Ok(Some(ev));
            }
            let Some(response) = self.response.as_mut() else {
                return Ok(None);
            };
            match response.chunk().await.map_err(crate::util::to_io_error)? {
                Some(bytes) => self
                    .parser
                    .feed(&bytes, Instant::now(), &mut self.pending)?,
                None => {
                    self.response = None;
                    self.parser.finish(Instant::now(), &mut self.pending);
                }
            }
        }
    }

    /// The next raw body piece (ignoring event framing); `Ok(None)` at the end of the body.
    pub async fn next_chunk(&mut self) -> io::Result<Option<(Instant, bytes::Bytes)>> {
        let Some(response) = self.response.as_mut() else {
            return Ok(None);
        };
        match response.chunk().await.map_err(crate::util::to_io_error)? {
            Some(bytes) => Ok(Some((Instant::now(), bytes))),
            None => {
                self.response = None;
                Ok(None)
            }
        }
    }

    /// Bytes already received but not returned as events.
    pub fn take_pending_bytes(&mut self) -> Vec<u8> {
        self.parser.take_pending()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_all(pieces: &[&[u8]]) -> Vec<SseEvent> {
        let mut p = SseParser::default();
        let mut out = VecDeque::new();
        for piece in pieces {
            p.feed(piece, Instant::now(), &mut out).unwrap();
        }
        p.finish(Instant::now(), &mut out);
        out.into()
    }

    #[test]
    fn events_split_across_pieces_and_line_endings() {
        let evs = parse_all(&[
            b"data: {\"i\":0}\n",
            b"\ndata: a\r\ndata: b\r",
            b"\n\r\n: keepalive\n\nevent: e\ndata: x\n\ndata: [DONE]",
        ]);
        let data: Vec<&str> = evs.iter().map(|e| e.data.as_str()).collect();
        assert_eq!(data, ["{\"i\":0}", "a\nb", "x", "[DONE]"]);
        assert_eq!(evs[0].json().unwrap()["i"], 0);
        assert_eq!(evs[2].event.as_deref(), Some("e"));
        assert!(evs[3].is_done());
    }

    #[test]
    fn oversized_event_is_an_error() {
        let mut p = SseParser::default();
        let mut out = VecDeque::new();
        let big = vec![b'x'; MAX_EVENT_BYTES + 1];
        assert!(p.feed(&big, Instant::now(), &mut out).is_err());
    }
}
