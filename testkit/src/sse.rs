//! Server-sent events on the client side: `eventsource-stream` over reqwest's byte stream
//! ([`EventStream`]), each event stamped with the arrival time of the bytes that completed it
//! (the load generator's TTFT and ITL come from these stamps).

use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use eventsource_stream::{EventStreamError, Eventsource};
use futures_util::{stream, Stream, StreamExt};
use serde_json::Value;

use crate::util::lock;

/// Largest event (bytes between blank lines) accepted; a longer one is an error, so a broken
/// server cannot make a client buffer without bound.
pub const MAX_EVENT_BYTES: usize = 16 << 20;

/// One server-sent event: the joined `data:` lines, the `event:` name if one was given, and the
/// arrival time of the bytes that completed it.
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

/// When the last body piece arrived, and how many bytes came since the last event returned.
#[derive(Debug)]
struct Arrival {
    at: Instant,
    bytes: usize,
}

type Events = Pin<
    Box<dyn Stream<Item = Result<eventsource_stream::Event, EventStreamError<io::Error>>> + Send>,
>;

/// The events of a byte stream. Each piece stamps `arrival` as it is pulled (the parser pulls
/// the next piece only once no complete event is left, so the stamp at an event's return is that
/// of the piece that completed it); a blank line is added at the end of the body, so a final
/// event not followed by one still counts.
fn events<S>(body: S, arrival: Arc<Mutex<Arrival>>) -> Events
where
    S: Stream<Item = Result<Bytes, reqwest::Error>> + Send + 'static,
{
    let stamped = body.map(move |piece| {
        let piece = piece.map_err(crate::util::to_io_error)?;
        let mut a = lock(&arrival);
        a.at = Instant::now();
        a.bytes += piece.len();
        if a.bytes > MAX_EVENT_BYTES {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("server-sent event larger than {MAX_EVENT_BYTES} bytes"),
            ));
        }
        Ok(piece)
    });
    let end = stream::once(async { Ok(Bytes::from_static(b"\n\n")) });
    Box::pin(stamped.chain(end).eventsource())
}

/// Reads the body of a streamed response as it arrives: as raw pieces ([`EventStream::next_chunk`])
/// or as events ([`EventStream::next`]), not both.
pub struct EventStream {
    response: Option<reqwest::Response>,
    events: Option<Events>,
    arrival: Arc<Mutex<Arrival>>,
}

impl EventStream {
    pub fn new(response: reqwest::Response) -> Self {
        EventStream {
            response: Some(response),
            events: None,
            arrival: Arc::new(Mutex::new(Arrival {
                at: Instant::now(),
                bytes: 0,
            })),
        }
    }

    /// The next complete event (blocks without a `data:` line, such as comments and
    /// keep-alives, are skipped); `Ok(None)` at the end of the body. Cancel-safe: a call dropped
    /// while waiting loses no bytes.
    pub async fn next(&mut self) -> io::Result<Option<SseEvent>> {
        let arrival = &self.arrival;
        let events = match &mut self.events {
            Some(events) => events,
            slot => {
                let body = self.response.take().map(reqwest::Response::bytes_stream);
                slot.insert(events(stream::iter(body).flatten(), arrival.clone()))
            }
        };
        match events.next().await {
            None => Ok(None),
            Some(Ok(ev)) => {
                let at = {
                    let mut a = lock(arrival);
                    a.bytes = 0;
                    a.at
                };
                Ok(Some(SseEvent {
                    at,
                    event: (ev.event != "message").then_some(ev.event),
                    data: ev.data,
                }))
            }
            Some(Err(EventStreamError::Transport(e))) => Err(e),
            Some(Err(e)) => Err(io::Error::new(io::ErrorKind::InvalidData, e.to_string())),
        }
    }

    /// The next raw body piece; `Ok(None)` at the end of the body. An error once the body is
    /// read as events.
    pub async fn next_chunk(&mut self) -> io::Result<Option<(Instant, Bytes)>> {
        if self.events.is_some() {
            return Err(io::Error::other("the body is already read as events"));
        }
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
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_all(pieces: Vec<Vec<u8>>) -> Vec<io::Result<SseEvent>> {
        let arrival = Arc::new(Mutex::new(Arrival {
            at: Instant::now(),
            bytes: 0,
        }));
        let body = stream::iter(
            pieces
                .into_iter()
                .map(|p| Ok::<_, reqwest::Error>(Bytes::from(p))),
        );
        let mut s = EventStream {
            response: None,
            events: Some(events(body, arrival.clone())),
            arrival,
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(async {
            let mut out = Vec::new();
            loop {
                match s.next().await {
                    Ok(None) => break,
                    Ok(Some(ev)) => out.push(Ok(ev)),
                    Err(e) => {
                        out.push(Err(e));
                        break;
                    }
                }
            }
            out
        })
    }

    #[test]
    fn events_split_across_pieces_and_line_endings() {
        let evs: Vec<SseEvent> = parse_all(vec![
            b"data: {\"i\":0}\n".to_vec(),
            b"\ndata: a\r\ndata: b\r".to_vec(),
            b"\n\r\n: keepalive\n\nevent: e\ndata: x\n\ndata: [DONE]".to_vec(),
        ])
        .into_iter()
        .map(Result::unwrap)
        .collect();
        let data: Vec<&str> = evs.iter().map(|e| e.data.as_str()).collect();
        assert_eq!(data, ["{\"i\":0}", "a\nb", "x", "[DONE]"]);
        assert_eq!(evs[0].json().unwrap()["i"], 0);
        assert_eq!(evs[0].event, None);
        assert_eq!(evs[2].event.as_deref(), Some("e"));
        assert!(evs[3].is_done());
    }

    #[test]
    fn oversized_event_is_an_error() {
        let big = vec![b'x'; MAX_EVENT_BYTES + 1];
        let out = parse_all(vec![b"data: ".to_vec(), big]);
        assert!(matches!(out.last(), Some(Err(_))), "{out:?}");
    }
}
