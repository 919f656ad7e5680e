//! The engine's replay socket (ZMQ ROUTER), read with a DEALER.
//!
//! Request: `[b"", start_seq as 8-byte big-endian]`. Replies, one message per buffered batch with
//! `seq >= start_seq`, oldest first: vLLM sends `[b"", topic, seq, payload]`, SGLang
//! `[b"", seq, payload]`; the end marker carries seq -1 (`ff` x 8) and an empty payload. A fresh
//! DEALER per replay keeps a late reply of an abandoned replay from mixing into the next one.

use std::time::Duration;

use bytes::Bytes;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use kv_router_protocol::vllm::{seq_from_frame, DecodeError, END_SEQ};

/// One reply message of the replay socket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReplayReply {
    Batch { seq: u64, payload: Bytes },
    End,
}

/// Why a replay did not complete.
#[derive(Debug)]
pub enum ReplayError {
    Connect(String),
    Send(String),
    Recv(String),
    /// No reply within the timeout.
    Timeout,
    /// A reply that is not a replay message.
    Malformed(DecodeError),
    /// More batches than `max_batches`.
    TooLong {
        max_batches: usize,
    },
    /// The bridge is shutting down.
    Cancelled,
}

impl std::fmt::Display for ReplayError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Connect(e) => write!(f, "cannot connect to the replay socket: {e}"),
            Self::Send(e) => write!(f, "cannot send the replay request: {e}"),
            Self::Recv(e) => write!(f, "replay receive failed: {e}"),
            Self::Timeout => f.write_str("replay socket did not answer in time"),
            Self::Malformed(e) => write!(f, "malformed replay reply: {e}"),
            Self::TooLong { max_batches } => write!(f, "replay longer than {max_batches} batches"),
            Self::Cancelled => f.write_str("cancelled by shutdown"),
        }
    }
}

/// Parses one reply (frames as received by the DEALER, leading empty delimiter included or not).
pub fn parse_reply(frames: &[Bytes]) -> Result<ReplayReply, DecodeError> {
    let frames = match frames.split_first() {
        // The ROUTER's empty delimiter, unless it is vLLM's empty topic of a 3-frame remainder.
        Some((first, rest)) if first.is_empty() && rest.len() >= 2 => rest,
        _ => frames,
    };
    let (seq, payload) = match frames {
        [_topic, seq, payload] => (seq, payload),
        [seq, payload] => (seq, payload),
        _ => return Err(DecodeError::FrameCount { got: frames.len() }),
    };
    if seq.as_ref() == END_SEQ {
        return Ok(ReplayReply::End);
    }
    Ok(ReplayReply::Batch {
        seq: seq_from_frame(seq)?,
        payload: payload.clone(),
    })
}

/// An open replay: yields batches until the end marker.
pub struct Replay {
    socket: DealerSocket,
    timeout: Duration,
    max_batches: usize,
    received: usize,
    done: bool,
}

impl Replay {
    /// Connects and asks for every buffered batch from `start_seq`.
    pub async fn start(
        endpoint: &str,
        start_seq: u64,
        timeout: Duration,
        max_batches: usize,
    ) -> Result<Replay, ReplayError> {
        let mut socket = DealerSocket::new();
        match tokio::time::timeout(timeout, socket.connect(endpoint)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(ReplayError::Connect(e.to_string())),
            Err(_) => return Err(ReplayError::Timeout),
        }
        let request = ZmqMessage::try_from(vec![
            Bytes::new(),
            Bytes::copy_from_slice(&start_seq.to_be_bytes()),
        ])
        .map_err(|e| ReplayError::Send(e.to_string()))?;
        match tokio::time::timeout(timeout, socket.send(request)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(ReplayError::Send(e.to_string())),
            Err(_) => return Err(ReplayError::Timeout),
        }
        Ok(Replay {
            socket,
            timeout,
            max_batches,
            received: 0,
            done: false,
        })
    }

    /// The next batch `(seq, payload)`, or `None` after the end marker.
    pub async fn next(&mut self) -> Result<Option<(u64, Bytes)>, ReplayError> {
        if self.done {
            return Ok(None);
        }
        let message = match tokio::time::timeout(self.timeout, self.socket.recv()).await {
            Ok(Ok(m)) => m,
            Ok(Err(e)) => return Err(ReplayError::Recv(e.to_string())),
            Err(_) => return Err(ReplayError::Timeout),
        };
        match parse_reply(&message.into_vec()).map_err(ReplayError::Malformed)? {
            ReplayReply::End => {
                self.done = true;
                Ok(None)
            }
            ReplayReply::Batch { seq, payload } => {
                self.received += 1;
                if self.received > self.max_batches {
                    return Err(ReplayError::TooLong {
                        max_batches: self.max_batches,
                    });
                }
                Ok(Some((seq, payload)))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(s: &[u8]) -> Bytes {
        Bytes::copy_from_slice(s)
    }

    #[test]
    fn vllm_and_sglang_replies_and_end_markers() {
        let seq = 7u64.to_be_bytes();
        let batch = ReplayReply::Batch {
            seq: 7,
            payload: b(b"P"),
        };
        // vLLM: [b"", topic, seq, payload]
        assert_eq!(
            parse_reply(&[b(b""), b(b"kv"), b(&seq), b(b"P")]).unwrap(),
            batch
        );
        // vLLM with an empty topic
        assert_eq!(
            parse_reply(&[b(b""), b(b""), b(&seq), b(b"P")]).unwrap(),
            batch
        );
        // SGLang: [b"", seq, payload]
        assert_eq!(parse_reply(&[b(b""), b(&seq), b(b"P")]).unwrap(), batch);
        // End markers
        let end = [0xffu8; 8];
        assert_eq!(
            parse_reply(&[b(b""), b(b""), b(&end), b(b"")]).unwrap(),
            ReplayReply::End
        );
        assert_eq!(
            parse_reply(&[b(b""), b(&end), b(b"")]).unwrap(),
            ReplayReply::End
        );
        // Garbage
        assert_eq!(
            parse_reply(&[b(b"x")]),
            Err(DecodeError::FrameCount { got: 1 })
        );
        assert_eq!(
            parse_reply(&[b(b""), b(b"kv"), b(b"123"), b(b"P")]),
            Err(DecodeError::SeqFrame { len: 3 })
        );
    }
}
