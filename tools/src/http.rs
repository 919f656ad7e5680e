//! A small HTTP/1.1 client and server over `std::net`, for the mock worker, the load generator and
//! the integration tests. No async runtime: the server runs one thread per connection.
//!
//! Client: [`request`] (whole response, overall deadline), [`request_streaming`] (body pieces or
//! SSE events as they arrive, with arrival timestamps; dropping it aborts the request), [`get`],
//! [`post_json`]. Requests carry `Connection: close`; responses may be framed by Content-Length,
//! chunked transfer encoding, or the end of the connection.
//!
//! Server: [`serve`] (blocking accept loop on a listener) and [`spawn`] (background server with a
//! [`Server`] handle that can shut it down). Keep-alive and pipelining are supported (Envoy reuses
//! upstream connections); request bodies may be Content-Length or chunked; `Expect: 100-continue`
//! is answered. The handler writes through a [`ResponseWriter`]: one full response, or a chunked
//! stream (SSE) flushed chunk by chunk, with detection of a disconnected client.

use std::collections::{HashMap, VecDeque};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::Value;

/// Timeout used by [`get`] and [`post_json`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
/// Largest request or response header section accepted.
pub const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Largest request body the server accepts (413 beyond it).
pub const MAX_REQUEST_BODY_BYTES: usize = 256 << 20;
/// Largest response body [`request`] accepts.
pub const MAX_RESPONSE_BODY_BYTES: usize = 1 << 30;
const MAX_LINE_BYTES: u64 = 16 * 1024;
const MAX_PIECE_BYTES: usize = 64 * 1024;

// ---------------------------------------------------------------------------------------------
// Shared parsing
// ---------------------------------------------------------------------------------------------

fn invalid(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

fn eof(msg: &str) -> io::Error {
    io::Error::new(io::ErrorKind::UnexpectedEof, msg.to_string())
}

/// Locks a mutex, ignoring poisoning (a panicking handler must not wedge the server).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Case-insensitive header lookup; the first match wins.
pub fn find_header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

/// Reads one LF- or CRLF-terminated line without its terminator. `Ok(None)` at EOF before any byte.
fn read_line<R: BufRead>(r: &mut R) -> io::Result<Option<String>> {
    let mut buf = Vec::new();
    let n = r
        .by_ref()
        .take(MAX_LINE_BYTES)
        .read_until(b'\n', &mut buf)?;
    if n == 0 {
        return Ok(None);
    }
    if buf.last() != Some(&b'\n') {
        if n as u64 >= MAX_LINE_BYTES {
            return Err(invalid("HTTP line too long"));
        }
        return Err(eof("connection closed in the middle of a line"));
    }
    buf.pop();
    if buf.last() == Some(&b'\r') {
        buf.pop();
    }
    Ok(Some(String::from_utf8_lossy(&buf).into_owned()))
}

struct Head {
    start_line: String,
    headers: Vec<(String, String)>,
}

/// Reads a start line and header section. `Ok(None)` if the peer closed before sending anything.
fn read_head<R: BufRead>(r: &mut R) -> io::Result<Option<Head>> {
    let mut total = 0usize;
    let start_line = loop {
        match read_line(r)? {
            None => return Ok(None),
            Some(l) if l.is_empty() => {
                // Tolerate stray CRLFs between pipelined messages.
                total += 2;
                if total > MAX_HEAD_BYTES {
                    return Err(invalid("too many empty lines before the start line"));
                }
            }
            Some(l) => break l,
        }
    };
    total += start_line.len();
    let mut headers: Vec<(String, String)> = Vec::new();
    loop {
        let line =
            read_line(r)?.ok_or_else(|| eof("connection closed inside the header section"))?;
        total += line.len() + 2;
        if total > MAX_HEAD_BYTES {
            return Err(invalid("header section too large"));
        }
        if line.is_empty() {
            break;
        }
        if line.starts_with(' ') || line.starts_with('\t') {
            // Obsolete line folding: continue the previous value.
            match headers.last_mut() {
                Some((_, v)) => {
                    v.push(' ');
                    v.push_str(line.trim());
                    continue;
                }
                None => return Err(invalid("header continuation without a header")),
            }
        }
        let (name, value) = line
            .split_once(':')
            .ok_or_else(|| invalid(format!("malformed header line {line:?}")))?;
        let name = name.trim();
        if name.is_empty() || name.contains(' ') {
            return Err(invalid(format!("malformed header name in {line:?}")));
        }
        headers.push((name.to_ascii_lowercase(), value.trim().to_string()));
    }
    Ok(Some(Head {
        start_line,
        headers,
    }))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    Empty,
    Length(u64),
    Chunked,
    UntilEof,
}

/// Body framing from the headers. Requests without framing have no body; responses read to EOF.
fn framing(headers: &[(String, String)], is_response: bool) -> io::Result<Framing> {
    if let Some(te) = find_header(headers, "transfer-encoding") {
        let last = te.rsplit(',').next().unwrap_or("").trim();
        if last.eq_ignore_ascii_case("chunked") {
            return Ok(Framing::Chunked);
        }
        if is_response {
            return Ok(Framing::UntilEof);
        }
        return Err(invalid(format!("unsupported transfer-encoding {te:?}")));
    }
    if let Some(cl) = find_header(headers, "content-length") {
        // Repeated identical values ("5, 5") are tolerated.
        let mut values = cl.split(',').map(str::trim);
        let first = values.next().unwrap_or("");
        if values.any(|v| v != first) {
            return Err(invalid(format!("conflicting content-length {cl:?}")));
        }
        let n = first
            .parse::<u64>()
            .map_err(|_| invalid(format!("bad content-length {cl:?}")))?;
        return Ok(Framing::Length(n));
    }
    Ok(if is_response {
        Framing::UntilEof
    } else {
        Framing::Empty
    })
}

#[derive(Debug, Clone, Copy)]
enum BodyState {
    Length(u64),
    ChunkSize { need_crlf: bool },
    ChunkData(u64),
    UntilEof,
    Done,
}

/// Incremental body decoder over a buffered reader.
struct BodyReader<R> {
    inner: R,
    state: BodyState,
}

/// Reads whatever is buffered or arrives next, at most `max` bytes; empty at EOF.
fn read_some<R: BufRead>(r: &mut R, max: u64) -> io::Result<Vec<u8>> {
    loop {
        match r.fill_buf() {
            Ok(buf) => {
                let n = buf.len().min(usize::try_from(max).unwrap_or(usize::MAX));
                let n = n.min(MAX_PIECE_BYTES);
                let piece = buf.get(..n).unwrap_or_default().to_vec();
                r.consume(n);
                return Ok(piece);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
}

impl<R: BufRead> BodyReader<R> {
    fn new(inner: R, framing: Framing) -> Self {
        let state = match framing {
            Framing::Empty | Framing::Length(0) => BodyState::Done,
            Framing::Length(n) => BodyState::Length(n),
            Framing::Chunked => BodyState::ChunkSize { need_crlf: false },
            Framing::UntilEof => BodyState::UntilEof,
        };
        BodyReader { inner, state }
    }

    /// The next piece of the body as it arrives; `Ok(None)` at the end of the body.
    fn next_piece(&mut self) -> io::Result<Option<Vec<u8>>> {
        loop {
            match self.state {
                BodyState::Done => return Ok(None),
                BodyState::Length(remaining) => {
                    let piece = read_some(&mut self.inner, remaining)?;
                    if piece.is_empty() {
                        return Err(eof("connection closed before the end of the body"));
                    }
                    let left = remaining - piece.len() as u64;
                    self.state = if left == 0 {
                        BodyState::Done
                    } else {
                        BodyState::Length(left)
                    };
                    return Ok(Some(piece));
                }
                BodyState::UntilEof => {
                    let piece = read_some(&mut self.inner, u64::MAX)?;
                    if piece.is_empty() {
                        self.state = BodyState::Done;
                        return Ok(None);
                    }
                    return Ok(Some(piece));
                }
                BodyState::ChunkSize { need_crlf } => {
                    if need_crlf {
                        let line = read_line(&mut self.inner)?
                            .ok_or_else(|| eof("connection closed after a chunk"))?;
                        if !line.is_empty() {
                            return Err(invalid("chunk data longer than its declared size"));
                        }
                    }
                    let line = read_line(&mut self.inner)?
                        .ok_or_else(|| eof("connection closed before a chunk size"))?;
                    let size_text = line.split(';').next().unwrap_or("").trim();
                    let size = u64::from_str_radix(size_text, 16)
                        .map_err(|_| invalid(format!("bad chunk size line {line:?}")))?;
                    if size == 0 {
                        // Trailer section, ended by an empty line (tolerate EOF).
                        while let Some(l) = read_line(&mut self.inner)? {
                            if l.is_empty() {
                                break;
                            }
                        }
                        self.state = BodyState::Done;
                    } else {
                        self.state = BodyState::ChunkData(size);
                    }
                }
                BodyState::ChunkData(remaining) => {
                    let piece = read_some(&mut self.inner, remaining)?;
                    if piece.is_empty() {
                        return Err(eof("connection closed inside a chunk"));
                    }
                    let left = remaining - piece.len() as u64;
                    self.state = if left == 0 {
                        BodyState::ChunkSize { need_crlf: true }
                    } else {
                        BodyState::ChunkData(left)
                    };
                    return Ok(Some(piece));
                }
            }
        }
    }

    fn read_all(&mut self, limit: usize) -> io::Result<Vec<u8>> {
        let mut body = Vec::new();
        if let BodyState::Length(n) = self.state {
            if n > limit as u64 {
                return Err(too_large(limit));
            }
            body.reserve(usize::try_from(n).unwrap_or(0));
        }
        while let Some(piece) = self.next_piece()? {
            body.extend_from_slice(&piece);
            if body.len() > limit {
                return Err(too_large(limit));
            }
        }
        Ok(body)
    }
}

fn too_large(limit: usize) -> io::Error {
    io::Error::other(format!("body larger than {limit} bytes"))
}

fn check_header_text(s: &str) -> io::Result<()> {
    if s.bytes().any(|b| b == b'\r' || b == b'\n') {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("CR or LF in header text {s:?}"),
        ));
    }
    Ok(())
}

/// Standard reason phrase (cosmetic; clients ignore it).
pub fn reason_phrase(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        200 => "OK",
        201 => "Created",
        202 => "Accepted",
        204 => "No Content",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        409 => "Conflict",
        413 => "Payload Too Large",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "Status",
    }
}

// ---------------------------------------------------------------------------------------------
// Client
// ---------------------------------------------------------------------------------------------

/// A complete HTTP response. Header names are lowercased.
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

/// A reader that fails with `TimedOut` once an overall deadline has passed.
struct DeadlineReader {
    stream: TcpStream,
    deadline: Option<Instant>,
}

impl Read for DeadlineReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if let Some(deadline) = self.deadline {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "request deadline passed",
                ));
            }
            self.stream.set_read_timeout(Some(remaining))?;
        }
        match self.stream.read(buf) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                Err(io::Error::new(io::ErrorKind::TimedOut, "read timed out"))
            }
            other => other,
        }
    }
}

fn connect(addr: &str, timeout: Duration) -> io::Result<TcpStream> {
    let mut last_err = None;
    for sa in addr.to_socket_addrs()? {
        match TcpStream::connect_timeout(&sa, timeout) {
            Ok(s) => {
                s.set_nodelay(true)?;
                return Ok(s);
            }
            Err(e) => last_err = Some(e),
        }
    }
    Err(last_err.unwrap_or_else(|| {
        io::Error::new(io::ErrorKind::NotFound, format!("no address for {addr:?}"))
    }))
}

fn normalize_addr(addr: &str) -> &str {
    let a = addr.strip_prefix("http://").unwrap_or(addr);
    a.trim_end_matches('/')
}

fn write_request(
    stream: &mut TcpStream,
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> io::Result<()> {
    check_header_text(method)?;
    check_header_text(path)?;
    let has = |n: &str| headers.iter().any(|(k, _)| k.eq_ignore_ascii_case(n));
    let mut head = format!("{method} {path} HTTP/1.1\r\n");
    if !has("host") {
        head.push_str(&format!("Host: {addr}\r\n"));
    }
    for (k, v) in headers {
        check_header_text(k)?;
        check_header_text(v)?;
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    if !has("connection") {
        head.push_str("Connection: close\r\n");
    }
    let bodyless_method = matches!(method, "GET" | "HEAD" | "DELETE" | "OPTIONS");
    if !has("content-length") && !has("transfer-encoding") && (!body.is_empty() || !bodyless_method)
    {
        head.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    head.push_str("\r\n");
    let mut buf = head.into_bytes();
    buf.extend_from_slice(body);
    stream.write_all(&buf)?;
    stream.flush()
}

fn read_response_head<R: BufRead>(r: &mut R) -> io::Result<(u16, Vec<(String, String)>)> {
    loop {
        let head = read_head(r)?.ok_or_else(|| eof("connection closed before a response"))?;
        let mut parts = head.start_line.splitn(3, ' ');
        let version = parts.next().unwrap_or("");
        if !version.starts_with("HTTP/") {
            return Err(invalid(format!("bad status line {:?}", head.start_line)));
        }
        let status = parts
            .next()
            .and_then(|s| s.parse::<u16>().ok())
            .ok_or_else(|| invalid(format!("bad status line {:?}", head.start_line)))?;
        if (100..200).contains(&status) && status != 101 {
            continue; // interim response (100 Continue etc.)
        }
        return Ok((status, head.headers));
    }
}

fn response_framing(
    method: &str,
    status: u16,
    headers: &[(String, String)],
) -> io::Result<Framing> {
    if method.eq_ignore_ascii_case("HEAD") || status == 204 || status == 304 || status < 200 {
        return Ok(Framing::Empty);
    }
    framing(headers, true)
}

/// Sends one request and reads the whole response. `addr` is `host:port` (an `http://` prefix is
/// tolerated). `timeout` bounds the whole exchange (connect, send, receive). `Host`,
/// `Connection: close` and `Content-Length` are added unless given in `headers`.
pub fn request(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    timeout: Duration,
) -> io::Result<Response> {
    let deadline = Instant::now() + timeout;
    let addr = normalize_addr(addr);
    let mut stream = connect(addr, timeout)?;
    stream.set_write_timeout(Some(timeout))?;
    write_request(&mut stream, addr, method, path, headers, body)?;
    let mut reader = BufReader::new(DeadlineReader {
        stream,
        deadline: Some(deadline),
    });
    let (status, headers) = read_response_head(&mut reader)?;
    let framing = response_framing(method, status, &headers)?;
    let body = BodyReader::new(&mut reader, framing).read_all(MAX_RESPONSE_BODY_BYTES)?;
    Ok(Response {
        status,
        headers,
        body,
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

/// A response whose body is read incrementally. Dropping it (or [`StreamingResponse::abort`])
/// closes the connection, which the server sees as a client abort.
pub struct StreamingResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    /// When the request was about to be sent (after connecting).
    pub sent_at: Instant,
    /// When the response head had been read.
    pub headers_at: Instant,
    body: BodyReader<BufReader<DeadlineReader>>,
    control: TcpStream,
    sse_buf: Vec<u8>,
    sse_events: VecDeque<SseEvent>,
    sse_eof: bool,
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
/// connect and each individual wait for data (an idle timeout), not the whole stream.
pub fn request_streaming(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    timeout: Duration,
) -> io::Result<StreamingResponse> {
    let addr = normalize_addr(addr);
    let mut stream = connect(addr, timeout)?;
    stream.set_write_timeout(Some(timeout))?;
    stream.set_read_timeout(Some(timeout))?;
    let control = stream.try_clone()?;
    let sent_at = Instant::now();
    write_request(&mut stream, addr, method, path, headers, body)?;
    let mut reader = BufReader::new(DeadlineReader {
        stream,
        deadline: None,
    });
    let (status, headers) = read_response_head(&mut reader)?;
    let headers_at = Instant::now();
    let framing = response_framing(method, status, &headers)?;
    Ok(StreamingResponse {
        status,
        headers,
        sent_at,
        headers_at,
        body: BodyReader::new(reader, framing),
        control,
        sse_buf: Vec::new(),
        sse_events: VecDeque::new(),
        sse_eof: false,
    })
}

impl StreamingResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        find_header(&self.headers, name)
    }

    /// The next body piece as it arrives; `Ok(None)` at the end of the body. Do not mix with
    /// [`StreamingResponse::next_event`] (that one buffers partial events).
    pub fn next_chunk(&mut self) -> io::Result<Option<BodyChunk>> {
        Ok(self.body.next_piece()?.map(|data| BodyChunk {
            at: Instant::now(),
            data,
        }))
    }

    /// The next complete SSE event; `Ok(None)` at the end of the body. A final event not followed
    /// by a blank line is still returned. Events with no `data:` line (comments) are skipped.
    pub fn next_event(&mut self) -> io::Result<Option<SseEvent>> {
        loop {
            if let Some(ev) = self.sse_events.pop_front() {
                return Ok(Some(ev));
            }
            if self.sse_eof {
                return Ok(None);
            }
            match self.body.next_piece()? {
                Some(piece) => {
                    let at = Instant::now();
                    self.sse_buf
                        .extend(piece.into_iter().filter(|&b| b != b'\r'));
                    while let Some(pos) = find_subslice(&self.sse_buf, b"\n\n") {
                        let block: Vec<u8> = self.sse_buf.drain(..pos + 2).collect();
                        if let Some(ev) = parse_sse_block(&block, at) {
                            self.sse_events.push_back(ev);
                        }
                    }
                }
                None => {
                    self.sse_eof = true;
                    let rest = std::mem::take(&mut self.sse_buf);
                    if let Some(ev) = parse_sse_block(&rest, Instant::now()) {
                        self.sse_events.push_back(ev);
                    }
                }
            }
        }
    }

    /// Reads the rest of the body.
    pub fn read_to_end(mut self) -> io::Result<Vec<u8>> {
        let mut out = std::mem::take(&mut self.sse_buf);
        out.extend(self.body.read_all(MAX_RESPONSE_BODY_BYTES)?);
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
        let _ = self.control.shutdown(Shutdown::Both);
    }
}

impl Drop for StreamingResponse {
    fn drop(&mut self) {
        let _ = self.control.shutdown(Shutdown::Both);
    }
}

fn find_subslice(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn parse_sse_block(block: &[u8], at: Instant) -> Option<SseEvent> {
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

// ---------------------------------------------------------------------------------------------
// Server
// ---------------------------------------------------------------------------------------------

/// A request as the handler sees it: the body has been read in full. Header names are lowercased.
#[derive(Debug, Clone)]
pub struct Request {
    pub method: String,
    /// The path without the query string.
    pub path: String,
    /// The raw query string without `?` (empty if none).
    pub query: String,
    pub version: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub peer: Option<SocketAddr>,
}

impl Request {
    pub fn header(&self, name: &str) -> Option<&str> {
        find_header(&self.headers, name)
    }

    /// A query parameter, percent-decoded (`+` as space). The first occurrence wins.
    pub fn query_param(&self, name: &str) -> Option<String> {
        self.query.split('&').find_map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (percent_decode(k) == name).then(|| percent_decode(v))
        })
    }

    pub fn json(&self) -> serde_json::Result<Value> {
        serde_json::from_slice(&self.body)
    }
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        if b == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok());
            if let Some(v) = hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(if b == b'+' { b' ' } else { b });
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WriterState {
    Idle,
    Chunked,
    Done,
}

/// Writes the response to one request: either [`ResponseWriter::send`] once, or
/// [`ResponseWriter::start_chunked`] then [`ResponseWriter::write_chunk`]s (each flushed at once)
/// and optionally [`ResponseWriter::finish`] (called for you when the handler returns). Write
/// errors mean the client has gone; the connection is then closed.
pub struct ResponseWriter {
    stream: TcpStream,
    state: WriterState,
    keep_alive: bool,
    head_only: bool,
    broken: bool,
    default_headers: Vec<(String, String)>,
}

impl ResponseWriter {
    fn new(stream: TcpStream, keep_alive: bool, head_only: bool) -> Self {
        ResponseWriter {
            stream,
            state: WriterState::Idle,
            keep_alive,
            head_only,
            broken: false,
            default_headers: Vec::new(),
        }
    }

    /// Adds a header to whatever response is sent later (e.g. `x-worker-id`).
    pub fn add_default_header(&mut self, name: &str, value: &str) {
        self.default_headers
            .push((name.to_string(), value.to_string()));
    }

    /// Asks for the connection to be closed after this response.
    pub fn close_after(&mut self) {
        self.keep_alive = false;
    }

    /// Whether a response has been started.
    pub fn started(&self) -> bool {
        self.state != WriterState::Idle
    }

    /// Whether a write has failed (the client is gone).
    pub fn is_broken(&self) -> bool {
        self.broken
    }

    fn head(&self, status: u16, headers: &[(&str, &str)], framing: &str) -> io::Result<Vec<u8>> {
        let mut head = format!("HTTP/1.1 {status} {}\r\n", reason_phrase(status));
        let given = |n: &str| headers.iter().any(|(k, _)| k.eq_ignore_ascii_case(n));
        for (k, v) in &self.default_headers {
            if !given(k) {
                check_header_text(k)?;
                check_header_text(v)?;
                head.push_str(&format!("{k}: {v}\r\n"));
            }
        }
        for (k, v) in headers {
            check_header_text(k)?;
            check_header_text(v)?;
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str(framing);
        if !self.keep_alive {
            head.push_str("Connection: close\r\n");
        }
        head.push_str("\r\n");
        Ok(head.into_bytes())
    }

    fn write_raw(&mut self, bytes: &[u8]) -> io::Result<()> {
        let r = self
            .stream
            .write_all(bytes)
            .and_then(|()| self.stream.flush());
        if r.is_err() {
            self.broken = true;
        }
        r
    }

    fn ensure_idle(&self) -> io::Result<()> {
        if self.state != WriterState::Idle {
            return Err(io::Error::other("response already started"));
        }
        Ok(())
    }

    /// Sends a complete response with a Content-Length.
    pub fn send(&mut self, status: u16, headers: &[(&str, &str)], body: &[u8]) -> io::Result<()> {
        self.ensure_idle()?;
        let mut bytes = self.head(
            status,
            headers,
            &format!("Content-Length: {}\r\n", body.len()),
        )?;
        if !self.head_only {
            bytes.extend_from_slice(body);
        }
        self.state = WriterState::Done;
        self.write_raw(&bytes)
    }

    /// Sends a JSON response (`content-type: application/json`).
    pub fn send_json(&mut self, status: u16, body: &Value) -> io::Result<()> {
        let bytes = serde_json::to_vec(body).map_err(io::Error::other)?;
        self.send(status, &[("content-type", "application/json")], &bytes)
    }

    /// Sends a plain-text response.
    pub fn send_text(&mut self, status: u16, body: &str) -> io::Result<()> {
        self.send(
            status,
            &[("content-type", "text/plain; charset=utf-8")],
            body.as_bytes(),
        )
    }

    /// Starts a chunked response; the head is flushed immediately.
    pub fn start_chunked(&mut self, status: u16, headers: &[(&str, &str)]) -> io::Result<()> {
        self.ensure_idle()?;
        let bytes = self.head(status, headers, "Transfer-Encoding: chunked\r\n")?;
        self.state = WriterState::Chunked;
        self.write_raw(&bytes)
    }

    /// Starts a `text/event-stream` response (status 200, chunked).
    pub fn start_sse(&mut self) -> io::Result<()> {
        self.start_chunked(
            200,
            &[
                ("content-type", "text/event-stream"),
                ("cache-control", "no-cache"),
            ],
        )
    }

    /// Writes and flushes one chunk (an empty `data` is a no-op).
    pub fn write_chunk(&mut self, data: &[u8]) -> io::Result<()> {
        if self.state != WriterState::Chunked {
            return Err(io::Error::other("no chunked response in progress"));
        }
        if data.is_empty() || self.head_only {
            return Ok(());
        }
        let mut bytes = format!("{:x}\r\n", data.len()).into_bytes();
        bytes.extend_from_slice(data);
        bytes.extend_from_slice(b"\r\n");
        self.write_raw(&bytes)
    }

    /// Writes one SSE event `data: <data>\n\n` as a chunk.
    pub fn write_sse_data(&mut self, data: &str) -> io::Result<()> {
        self.write_chunk(format!("data: {data}\n\n").as_bytes())
    }

    /// Ends a chunked response.
    pub fn finish(&mut self) -> io::Result<()> {
        if self.state != WriterState::Chunked {
            return Ok(());
        }
        self.state = WriterState::Done;
        if self.head_only {
            return Ok(());
        }
        self.write_raw(b"0\r\n\r\n")
    }

    /// Whether the client has closed its connection (checked without blocking). Clients that
    /// half-close after sending are reported as disconnected too.
    pub fn is_client_disconnected(&mut self) -> bool {
        if self.broken {
            return true;
        }
        if self.stream.set_nonblocking(true).is_err() {
            return true;
        }
        let mut probe = [0u8; 1];
        let gone = match self.stream.peek(&mut probe) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => !matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
            ),
        };
        let _ = self.stream.set_nonblocking(false);
        if gone {
            self.broken = true;
        }
        gone
    }
}

/// The request handler run for every request (on the connection's thread).
pub type Handler = Arc<dyn Fn(Request, &mut ResponseWriter) + Send + Sync>;

type ConnRegistry = Arc<Mutex<HashMap<u64, TcpStream>>>;

/// Serves forever: accepts connections and runs each on its own thread.
pub fn serve(listener: TcpListener, handler: Handler) {
    serve_until(
        listener,
        handler,
        Arc::new(AtomicBool::new(false)),
        Arc::new(Mutex::new(HashMap::new())),
    );
}

fn serve_until(
    listener: TcpListener,
    handler: Handler,
    stop: Arc<AtomicBool>,
    conns: ConnRegistry,
) {
    let next_id = AtomicU64::new(0);
    for incoming in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            break;
        }
        let stream = match incoming {
            Ok(s) => s,
            Err(e) => {
                // Out of descriptors or a connection reset while queued: back off briefly.
                eprintln!("http: accept failed: {e}");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let id = next_id.fetch_add(1, Ordering::Relaxed);
        if let Ok(clone) = stream.try_clone() {
            lock(&conns).insert(id, clone);
        }
        let handler = Arc::clone(&handler);
        let conns = Arc::clone(&conns);
        let spawned = std::thread::Builder::new()
            .name(format!("http-conn-{id}"))
            .spawn(move || {
                handle_connection(stream, &handler);
                lock(&conns).remove(&id);
            });
        if let Err(e) = spawned {
            eprintln!("http: cannot spawn a connection thread: {e}");
        }
    }
}

fn write_error_and_close(stream: &mut TcpStream, status: u16, msg: &str) {
    let body = format!("{msg}\n");
    let resp = format!(
        "HTTP/1.1 {status} {}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        reason_phrase(status),
        body.len()
    );
    let _ = stream.write_all(resp.as_bytes());
    let _ = stream.flush();
}

fn handle_connection(stream: TcpStream, handler: &Handler) {
    let _ = stream.set_nodelay(true);
    let peer = stream.peer_addr().ok();
    let Ok(mut control) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(stream);
    loop {
        let head = match read_head(&mut reader) {
            Ok(Some(h)) => h,
            Ok(None) => return,
            Err(e) => {
                if e.kind() == io::ErrorKind::InvalidData {
                    write_error_and_close(&mut control, 400, &e.to_string());
                }
                return;
            }
        };
        let mut parts = head.start_line.split_whitespace();
        let (Some(method), Some(target), Some(version), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            write_error_and_close(&mut control, 400, "malformed request line");
            return;
        };
        if !version.starts_with("HTTP/1.") {
            write_error_and_close(&mut control, 400, "unsupported HTTP version");
            return;
        }
        let conn_header = find_header(&head.headers, "connection")
            .unwrap_or("")
            .to_ascii_lowercase();
        let keep_alive = if version == "HTTP/1.0" {
            conn_header.contains("keep-alive")
        } else {
            !conn_header.contains("close")
        };
        let framing = match framing(&head.headers, false) {
            Ok(f) => f,
            Err(e) => {
                write_error_and_close(&mut control, 400, &e.to_string());
                return;
            }
        };
        if let Framing::Length(n) = framing {
            if n > MAX_REQUEST_BODY_BYTES as u64 {
                write_error_and_close(&mut control, 413, "request body too large");
                return;
            }
        }
        let expects_continue = find_header(&head.headers, "expect")
            .is_some_and(|v| v.eq_ignore_ascii_case("100-continue"));
        if expects_continue
            && framing != Framing::Empty
            && framing != Framing::Length(0)
            && control.write_all(b"HTTP/1.1 100 Continue\r\n\r\n").is_err()
        {
            return;
        }
        let body = match BodyReader::new(&mut reader, framing).read_all(MAX_REQUEST_BODY_BYTES) {
            Ok(b) => b,
            Err(e) => {
                if e.kind() == io::ErrorKind::Other {
                    write_error_and_close(&mut control, 413, &e.to_string());
                } else if e.kind() == io::ErrorKind::InvalidData {
                    write_error_and_close(&mut control, 400, &e.to_string());
                }
                return;
            }
        };
        let (path, query) = match target.split_once('?') {
            Some((p, q)) => (p.to_string(), q.to_string()),
            None => (target.to_string(), String::new()),
        };
        let request = Request {
            method: method.to_string(),
            path,
            query,
            version: version.to_string(),
            headers: head.headers,
            body,
            peer,
        };
        let Ok(writer_stream) = control.try_clone() else {
            return;
        };
        let head_only = method.eq_ignore_ascii_case("HEAD");
        let mut writer = ResponseWriter::new(writer_stream, keep_alive, head_only);
        let outcome = catch_unwind(AssertUnwindSafe(|| handler(request, &mut writer)));
        match (outcome.is_err(), writer.state) {
            (_, WriterState::Idle) => {
                let msg = if outcome.is_err() {
                    "handler panicked"
                } else {
                    "handler sent no response"
                };
                writer.keep_alive = false;
                let _ = writer.send_text(500, msg);
            }
            // A panic in the middle of a stream: the response is incomplete, close.
            (true, WriterState::Chunked) => return,
            (false, WriterState::Chunked) => {
                let _ = writer.finish();
            }
            (_, WriterState::Done) => {}
        }
        if writer.broken || !writer.keep_alive {
            let _ = control.shutdown(Shutdown::Write);
            return;
        }
    }
}

/// A server running in the background (see [`spawn`]). Dropping it shuts it down.
pub struct Server {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    conns: ConnRegistry,
    thread: Option<JoinHandle<()>>,
}

/// Binds `bind` (e.g. `"127.0.0.1:0"`) and serves on a background thread.
pub fn spawn(bind: &str, handler: Handler) -> io::Result<Server> {
    let listener = TcpListener::bind(bind)?;
    let addr = listener.local_addr()?;
    let stop = Arc::new(AtomicBool::new(false));
    let conns: ConnRegistry = Arc::new(Mutex::new(HashMap::new()));
    let (s, c) = (Arc::clone(&stop), Arc::clone(&conns));
    let thread = std::thread::Builder::new()
        .name(format!("http-accept-{addr}"))
        .spawn(move || serve_until(listener, handler, s, c))?;
    Ok(Server {
        addr,
        stop,
        conns,
        thread: Some(thread),
    })
}

impl Server {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The address as `ip:port` (a wildcard bind is reported as 127.0.0.1).
    pub fn addr_string(&self) -> String {
        let mut a = self.addr;
        if a.ip().is_unspecified() {
            a.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
        }
        a.to_string()
    }

    /// Stops accepting and closes every open connection (in-flight responses fail).
    pub fn shutdown(mut self) {
        self.stop_now();
    }

    fn stop_now(&mut self) {
        if self.stop.swap(true, Ordering::SeqCst) {
            return;
        }
        // Wake the accept loop.
        let _ = TcpStream::connect_timeout(
            &self.addr_string().parse().unwrap_or(self.addr),
            Duration::from_secs(1),
        );
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        for (_, conn) in lock(&self.conns).drain() {
            let _ = conn.shutdown(Shutdown::Both);
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop_now();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    fn handler(f: impl Fn(Request, &mut ResponseWriter) + Send + Sync + 'static) -> Handler {
        Arc::new(f)
    }

    fn echo_server() -> Server {
        spawn(
            "127.0.0.1:0",
            handler(|req, w| {
                let body = serde_json::json!({
                    "method": req.method,
                    "path": req.path,
                    "q": req.query_param("after"),
                    "x": req.header("X-Test"),
                    "len": req.body.len(),
                    "body": String::from_utf8_lossy(&req.body),
                });
                w.add_default_header("x-worker-id", "7");
                w.send_json(200, &body).unwrap();
            }),
        )
        .unwrap()
    }

    fn raw_exchange(addr: &str, raw: &[u8]) -> String {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(raw).unwrap();
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        String::from_utf8_lossy(&out).into_owned()
    }

    #[test]
    fn get_and_post_round_trip() {
        let srv = echo_server();
        let addr = srv.addr_string();
        let r = request(
            &addr,
            "GET",
            "/kv/events?after=41&x=1",
            &[("X-Test", "yes")],
            &[],
            Duration::from_secs(5),
        )
        .unwrap();
        assert_eq!(r.status, 200);
        assert_eq!(r.header("X-Worker-Id"), Some("7"));
        assert_eq!(r.header("content-type"), Some("application/json"));
        let j = r.json().unwrap();
        assert_eq!(j["path"], "/kv/events");
        assert_eq!(j["q"], "41");
        assert_eq!(j["x"], "yes");

        let r = post_json(&addr, "/p", &serde_json::json!({"a": [1, 2]})).unwrap();
        let j = r.json().unwrap();
        assert_eq!(j["method"], "POST");
        assert_eq!(j["body"], r#"{"a":[1,2]}"#);
        let r = get(&format!("http://{addr}/"), "/x").unwrap();
        assert_eq!(r.status, 200);
    }

    #[test]
    fn chunked_request_body_and_keep_alive() {
        let srv = echo_server();
        let addr = srv.addr_string();
        let raw = b"POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n\
            5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nTrailer: t\r\n\r\n\
            GET /b HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
        let out = raw_exchange(&addr, raw);
        assert_eq!(out.matches("HTTP/1.1 200 OK").count(), 2, "{out}");
        assert!(out.contains(r#""body":"hello world""#), "{out}");
        assert!(out.contains(r#""path":"/b""#), "{out}");
        assert!(out.contains("Connection: close"), "{out}");
    }

    #[test]
    fn expect_continue_and_bad_requests() {
        let srv = echo_server();
        let addr = srv.addr_string();
        let out = raw_exchange(
            &addr,
            b"POST /a HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 2\r\nConnection: close\r\n\r\nhi",
        );
        assert!(
            out.starts_with("HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200"),
            "{out}"
        );
        let out = raw_exchange(&addr, b"NONSENSE\r\n\r\n");
        assert!(out.starts_with("HTTP/1.1 400"), "{out}");
        let out = raw_exchange(&addr, b"GET / HTTP/1.1\r\nbad header\r\n\r\n");
        assert!(out.starts_with("HTTP/1.1 400"), "{out}");
        // The client skips the interim 100 response.
        let r = request(
            &addr,
            "POST",
            "/",
            &[("expect", "100-continue")],
            b"zz",
            Duration::from_secs(5),
        )
        .unwrap();
        assert_eq!(r.status, 200);
    }

    #[test]
    fn client_decodes_chunked_and_until_eof_responses() {
        let srv = spawn(
            "127.0.0.1:0",
            handler(|_req, w| {
                w.start_chunked(201, &[("x-a", "b")]).unwrap();
                w.write_chunk(b"abc").unwrap();
                w.write_chunk(&[b'z'; 100_000]).unwrap();
                // finish() is implied when the handler returns
            }),
        )
        .unwrap();
        let r = request(
            &srv.addr_string(),
            "GET",
            "/",
            &[],
            &[],
            Duration::from_secs(5),
        )
        .unwrap();
        assert_eq!(r.status, 201);
        assert_eq!(r.header("x-a"), Some("b"));
        assert_eq!(r.body.len(), 100_003);
        assert_eq!(&r.body[..4], b"abcz");

        // An HTTP/1.0-style server: no length, the body ends at EOF.
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut buf = [0u8; 1024];
            let _ = s.read(&mut buf);
            s.write_all(b"HTTP/1.0 200 OK\r\nX-Y: z\r\n\r\nall of it")
                .unwrap();
        });
        let r = request(&addr, "GET", "/", &[], &[], Duration::from_secs(5)).unwrap();
        assert_eq!(r.text(), "all of it");
    }

    #[test]
    fn streaming_sse_events_arrive_incrementally() {
        let srv = spawn(
            "127.0.0.1:0",
            handler(|_req, w| {
                w.start_sse().unwrap();
                for i in 0..3 {
                    std::thread::sleep(Duration::from_millis(60));
                    w.write_sse_data(&format!("{{\"i\":{i}}}")).unwrap();
                }
                // Two events in one chunk, CRLF line endings, a comment and a multi-line event.
                w.write_chunk(b": keepalive\r\n\r\ndata: a\r\ndata: b\r\n\r\ndata: [DONE]\n\n")
                    .unwrap();
            }),
        )
        .unwrap();
        let mut s = request_streaming(
            &srv.addr_string(),
            "POST",
            "/v1/completions",
            &[],
            b"{}",
            Duration::from_secs(5),
        )
        .unwrap();
        assert_eq!(s.status, 200);
        assert_eq!(s.header("content-type"), Some("text/event-stream"));
        let mut events = Vec::new();
        while let Some(ev) = s.next_event().unwrap() {
            events.push(ev);
        }
        assert_eq!(events.len(), 5);
        assert_eq!(events[0].json().unwrap()["i"], 0);
        assert_eq!(events[3].data, "a\nb");
        assert!(events[4].is_done());
        let gap = events[2].at - events[1].at;
        assert!(
            gap >= Duration::from_millis(40),
            "events were not incremental: {gap:?}"
        );
        assert!(events[0].at - s.sent_at >= Duration::from_millis(50));
    }

    #[test]
    fn streaming_chunks_and_into_response() {
        let srv = spawn(
            "127.0.0.1:0",
            handler(|_req, w| {
                w.start_chunked(200, &[]).unwrap();
                w.write_chunk(b"one").unwrap();
                std::thread::sleep(Duration::from_millis(30));
                w.write_chunk(b"two").unwrap();
            }),
        )
        .unwrap();
        let addr = srv.addr_string();
        let mut s = request_streaming(&addr, "GET", "/", &[], &[], Duration::from_secs(5)).unwrap();
        let c = s.next_chunk().unwrap().unwrap();
        assert_eq!(c.data, b"one");
        let rest = s.into_response().unwrap();
        assert_eq!(rest.body, b"two");
    }

    #[test]
    fn server_detects_client_abort() {
        let (tx, rx) = mpsc::channel::<(bool, usize)>();
        let tx = Mutex::new(tx);
        let srv = spawn(
            "127.0.0.1:0",
            handler(move |_req, w| {
                w.start_sse().unwrap();
                let mut sent = 0;
                let deadline = Instant::now() + Duration::from_secs(5);
                let mut detected = false;
                while Instant::now() < deadline {
                    if w.is_client_disconnected() || w.write_sse_data("tick").is_err() {
                        detected = true;
                        break;
                    }
                    sent += 1;
                    std::thread::sleep(Duration::from_millis(10));
                }
                let _ = lock(&tx).send((detected, sent));
            }),
        )
        .unwrap();
        let mut s = request_streaming(
            &srv.addr_string(),
            "GET",
            "/",
            &[],
            &[],
            Duration::from_secs(5),
        )
        .unwrap();
        assert_eq!(s.next_event().unwrap().unwrap().data, "tick");
        drop(s);
        let (detected, sent) = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert!(detected);
        assert!(sent < 100, "took {sent} writes to notice");
    }

    #[test]
    fn client_timeout_is_enforced() {
        let srv = spawn(
            "127.0.0.1:0",
            handler(|_req, w| {
                std::thread::sleep(Duration::from_millis(1500));
                let _ = w.send_text(200, "late");
            }),
        )
        .unwrap();
        let t0 = Instant::now();
        let err = request(
            &srv.addr_string(),
            "GET",
            "/",
            &[],
            &[],
            Duration::from_millis(200),
        )
        .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(t0.elapsed() < Duration::from_millis(1000));
        // Connection refused is a plain error.
        let addr = srv.addr_string();
        drop(srv);
        assert!(request(&addr, "GET", "/", &[], &[], Duration::from_millis(500)).is_err());
    }

    #[test]
    fn handler_panic_or_silence_gives_500() {
        let srv = spawn(
            "127.0.0.1:0",
            handler(|req, w| {
                if req.path == "/panic" {
                    panic!("boom");
                }
                if req.path == "/head" {
                    w.send_text(200, "body not sent for HEAD").unwrap();
                }
            }),
        )
        .unwrap();
        let addr = srv.addr_string();
        assert_eq!(get(&addr, "/panic").unwrap().status, 500);
        assert_eq!(get(&addr, "/silent").unwrap().status, 500);
        let r = request(&addr, "HEAD", "/head", &[], &[], Duration::from_secs(5)).unwrap();
        assert_eq!(r.status, 200);
        assert!(r.body.is_empty());
    }

    #[test]
    fn shutdown_closes_idle_keep_alive_connections() {
        let srv = echo_server();
        let addr = srv.addr_string();
        let mut s = TcpStream::connect(&addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let mut reader = BufReader::new(s.try_clone().unwrap());
        let (status, headers) = read_response_head(&mut reader).unwrap();
        assert_eq!(status, 200);
        let f = framing(&headers, true).unwrap();
        BodyReader::new(&mut reader, f).read_all(1 << 20).unwrap();
        srv.shutdown();
        // The idle keep-alive connection is closed by the server.
        let mut buf = [0u8; 16];
        assert_eq!(reader.read(&mut buf).unwrap_or(0), 0);
    }

    #[test]
    fn query_decoding() {
        let req = Request {
            method: "GET".into(),
            path: "/".into(),
            query: "a=1&b=x%20y+z&c".into(),
            version: "HTTP/1.1".into(),
            headers: vec![],
            body: vec![],
            peer: None,
        };
        assert_eq!(req.query_param("a").as_deref(), Some("1"));
        assert_eq!(req.query_param("b").as_deref(), Some("x y z"));
        assert_eq!(req.query_param("c").as_deref(), Some(""));
        assert_eq!(req.query_param("d"), None);
    }
}
