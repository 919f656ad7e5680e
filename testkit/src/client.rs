//! A small blocking HTTP client for the integration tests, benches and the harness, on `reqwest`.
//!
//! [`request`] returns a whole response within an overall deadline; [`request_streaming`] returns
//! once the response head has arrived and then yields body pieces or SSE events as they arrive,
//! stamped with their arrival time; dropping it (or [`StreamingResponse::abort`]) closes the
//! connection, which the server sees as a client abort. Every request uses a fresh connection
//! (no idle pooling), so one test's connection never outlives it or meets a restarted server.
//!
//! The calls block the calling thread on a process-wide async runtime (one I/O thread), so they
//! must not be made from inside an async task.

use std::io;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::sse::EventStream;
pub use crate::sse::SseEvent;

/// Timeout used by [`get`] and [`post_json`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
/// Largest response body [`request`] accepts.
pub const MAX_RESPONSE_BODY_BYTES: usize = 1 << 30;

fn runtime() -> io::Result<&'static tokio::runtime::Runtime> {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    if let Some(rt) = RUNTIME.get() {
        return Ok(rt);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("http-client-io")
        .enable_all()
        .build()?;
    Ok(RUNTIME.get_or_init(|| rt))
}

fn client() -> io::Result<&'static reqwest::Client> {
    static CLIENT: OnceLock<reqwest::Client> = OnceLock::new();
    if let Some(c) = CLIENT.get() {
        return Ok(c);
    }
    let c = reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(0)
        .build()
        .map_err(to_io_error)?;
    Ok(CLIENT.get_or_init(|| c))
}

pub use crate::util::to_io_error;

fn timed_out(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, what.to_string())
}

/// `http://addr` from `ip:port` (an `http://` prefix and a trailing `/` are tolerated).
pub fn base_url(addr: &str) -> String {
    let a = addr.strip_prefix("http://").unwrap_or(addr);
    format!("http://{}", a.trim_end_matches('/'))
}

fn collect_headers(map: &reqwest::header::HeaderMap) -> Vec<(String, String)> {
    map.iter()
        .map(|(k, v)| {
            (
                k.as_str().to_string(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect()
}

/// Case-insensitive header lookup; the first match wins.
pub fn find_header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

async fn send(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> io::Result<reqwest::Response> {
    let method = reqwest::Method::from_bytes(method.as_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let mut req = client()?.request(method, format!("{}{path}", base_url(addr)));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    if !body.is_empty() {
        req = req.body(body.to_vec());
    }
    req.send().await.map_err(to_io_error)
}

/// A complete HTTP response. Header names are lowercase.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    /// First value of a header (case-insensitive name).
    pub fn header(&self, name: &str) -> Option<&str> {
        find_header(&self.headers, name)
    }

    /// The body parsed as JSON.
    pub fn json(&self) -> serde_json::Result<Value> {
        serde_json::from_slice(&self.body)
    }

    /// The body as (lossy) UTF-8 text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

async fn read_body(resp: &mut reqwest::Response, mut body: Vec<u8>) -> io::Result<Vec<u8>> {
    while let Some(piece) = resp.chunk().await.map_err(to_io_error)? {
        if body.len() + piece.len() > MAX_RESPONSE_BODY_BYTES {
            return Err(io::Error::other(format!(
                "response body larger than {MAX_RESPONSE_BODY_BYTES} bytes"
            )));
        }
        body.extend_from_slice(&piece);
    }
    Ok(body)
}

/// Sends one request and reads the whole response. `addr` is `host:port`; `timeout` bounds the
/// whole exchange (connect, send, receive) and fails with `ErrorKind::TimedOut`.
pub fn request(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    timeout: Duration,
) -> io::Result<Response> {
    runtime()?.block_on(async {
        let exchange = async {
            let mut resp = send(addr, method, path, headers, body).await?;
            let status = resp.status().as_u16();
            let headers = collect_headers(resp.headers());
            let body = read_body(&mut resp, Vec::new()).await?;
            Ok(Response {
                status,
                headers,
                body,
            })
        };
        tokio::time::timeout(timeout, exchange)
            .await
            .map_err(|_| timed_out("request deadline passed"))?
    })
}

/// `GET addr path` with [`DEFAULT_TIMEOUT`].
pub fn get(addr: &str, path: &str) -> io::Result<Response> {
    request(addr, "GET", path, &[], &[], DEFAULT_TIMEOUT)
}

/// `POST addr path` with a JSON body and [`DEFAULT_TIMEOUT`].
pub fn post_json(addr: &str, path: &str, body: &Value) -> io::Result<Response> {
    let bytes = serde_json::to_vec(body).map_err(io::Error::other)?;
    request(
        addr,
        "POST",
        path,
        &[("content-type", "application/json")],
        &bytes,
        DEFAULT_TIMEOUT,
    )
}

/// A piece of a streamed body with its arrival time.
#[derive(Debug, Clone)]
pub struct BodyChunk {
    pub at: Instant,
    pub data: Vec<u8>,
}

/// A response whose body is read incrementally. Dropping it (or [`StreamingResponse::abort`])
/// closes the connection, which the server sees as a client abort.
pub struct StreamingResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    /// When the request was handed to the client (before connecting).
    pub sent_at: Instant,
    /// When the response head had arrived.
    pub headers_at: Instant,
    body: EventStream,
    idle_timeout: Duration,
}

impl std::fmt::Debug for StreamingResponse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamingResponse")
            .field("status", &self.status)
            .field("headers", &self.headers)
            .finish_non_exhaustive()
    }
}

/// Sends a request and returns once the response head has arrived; the body is then read with
/// [`StreamingResponse::next_chunk`] or [`StreamingResponse::next_event`]. `timeout` bounds the
/// wait for the head and then each individual wait for body data (an idle timeout), not the
/// whole stream.
pub fn request_streaming(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    timeout: Duration,
) -> io::Result<StreamingResponse> {
    let sent_at = Instant::now();
    let resp = runtime()?.block_on(async {
        tokio::time::timeout(timeout, send(addr, method, path, headers, body))
            .await
            .map_err(|_| timed_out("no response head before the timeout"))?
    })?;
    Ok(StreamingResponse {
        status: resp.status().as_u16(),
        headers: collect_headers(resp.headers()),
        sent_at,
        headers_at: Instant::now(),
        body: EventStream::new(resp),
        idle_timeout: timeout,
    })
}

impl StreamingResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        find_header(&self.headers, name)
    }

    /// The next body piece as it arrives; `Ok(None)` at the end of the body. An error after
    /// [`StreamingResponse::next_event`] (that one buffers partial events).
    pub fn next_chunk(&mut self) -> io::Result<Option<BodyChunk>> {
        let (body, idle) = (&mut self.body, self.idle_timeout);
        let piece = runtime()?.block_on(async {
            tokio::time::timeout(idle, body.next_chunk())
                .await
                .map_err(|_| timed_out("no body data before the timeout"))?
        })?;
        Ok(piece.map(|(at, data)| BodyChunk {
            at,
            data: data.to_vec(),
        }))
    }

    /// The next complete SSE event; `Ok(None)` at the end of the body. A final event not followed
    /// by a blank line is still returned. Blocks without a `data:` line (comments) are skipped.
    pub fn next_event(&mut self) -> io::Result<Option<SseEvent>> {
        let (body, idle) = (&mut self.body, self.idle_timeout);
        runtime()?.block_on(async {
            tokio::time::timeout(idle, body.next())
                .await
                .map_err(|_| timed_out("no event before the timeout"))?
        })
    }

    /// Reads the rest of the body (an error once it is read with
    /// [`StreamingResponse::next_event`]).
    pub fn read_to_end(mut self) -> io::Result<Vec<u8>> {
        let mut out = Vec::new();
        while let Some(piece) = self.next_chunk()? {
            if out.len() + piece.data.len() > MAX_RESPONSE_BODY_BYTES {
                return Err(io::Error::other("response body too large"));
            }
            out.extend_from_slice(&piece.data);
        }
        Ok(out)
    }

    /// Reads the rest of the body into a [`Response`].
    pub fn into_response(self) -> io::Result<Response> {
        let status = self.status;
        let headers = self.headers.clone();
        let body = self.read_to_end()?;
        Ok(Response {
            status,
            headers,
            body,
        })
    }

    /// Closes the connection now (a client abort).
    pub fn abort(self) {
        drop(self);
    }
}
