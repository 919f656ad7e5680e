//! `engine_priority` in the request body, and the client's own `priority` (a routing hint).

use super::host::Host;
use crate::config::{ClientHints, Config};
use crate::priority::{find_client_priority, replace_client_priority};
use std::ops::Range;

/// Bytes of the body read to place the priority: the object's `{` and the start of its first
/// member (past a client's own `priority`: that much after its value). Read whole when that is
/// not enough (more whitespace than this).
const PRIORITY_HEAD_BYTES: usize = 64;

/// What the filter knows of the client's own `priority` members.
pub(super) enum ClientPriority<'a> {
    /// The parse's record (`LlmRequest::client_priority`; empty: none).
    Parsed(&'a [Range<usize>]),
    /// The body was not parsed: they are looked for in it.
    Unparsed,
    /// The body is not all here (over `max_body_bytes`) or could not be read.
    Unreadable,
}

/// Writes the filter's priority (`engine_priority`) and settles the client's own, a routing
/// hint: with `client_routing_hints: honor` it stays (and, where the parse saw one, the filter
/// writes none over it); otherwise the client's members go, replaced by the filter's or dropped
/// (without `engine_priority`), in the one body edit. Free for a request without either.
pub(super) fn settle_priority(
    host: &mut impl Host,
    config: &Config,
    priority: Option<i64>,
    client: ClientPriority,
) {
    let max_bytes = config.max_body_bytes;
    if config.client_routing_hints == ClientHints::Honor {
        if matches!(client, ClientPriority::Parsed(values) if !values.is_empty()) {
            host.count_later("priority.client_honored", 1);
        } else if let Some(priority) = priority {
            // None parsed (in a body the parse did not read, the client's would come later
            // and win).
            let written = write_priority(host, Some(priority), &[], max_bytes);
            count_priority(host, written);
        }
        return;
    }
    let found;
    let values: &[Range<usize>] = match client {
        ClientPriority::Parsed(values) => values,
        ClientPriority::Unparsed => {
            let body = host.request_body(max_bytes).unwrap_or_default();
            found = if body.is_empty() {
                Some(Vec::new())
            } else {
                find_client_priority(&body)
            };
            match found.as_deref() {
                Some(values) => values,
                None => {
                    host.count_later("priority.unchecked", 1);
                    &[]
                }
            }
        }
        ClientPriority::Unreadable => {
            host.count_later("priority.unchecked", 1);
            &[]
        }
    };
    if values.is_empty() {
        if let Some(priority) = priority {
            let written = write_priority(host, Some(priority), &[], max_bytes);
            count_priority(host, written);
        }
        return;
    }
    if !write_priority(host, priority, values, max_bytes) {
        // Sent as it is: the client's priority reaches the engine (after the filter's, if any).
        host.count_later("priority.client_unremoved", 1);
        if let Some(priority) = priority {
            let written = write_priority(host, Some(priority), &[], max_bytes);
            count_priority(host, written);
        }
    } else if priority.is_some() {
        host.count_later("priority.client_replaced", 1);
        count_priority(host, true);
    } else {
        host.count_later("priority.client_dropped", 1);
    }
}

/// Makes `"priority": P` (when given) the buffered request body's first member and removes the
/// client's own `priority` members (their values at `client`), in one edit from the body's
/// start, and corrects the `content-length`. `false` (body unchanged) when the body is not a
/// JSON object they are members of, or Envoy refuses the edit.
fn write_priority(
    host: &mut impl Host,
    priority: Option<i64>,
    client: &[Range<usize>],
    max_bytes: usize,
) -> bool {
    let reach = client
        .last()
        .map_or(0, |value| value.end)
        .saturating_add(PRIORITY_HEAD_BYTES);
    let Some(mut head) = host.request_body(reach) else {
        return false;
    };
    let mut splice = replace_client_priority(&head, client, priority);
    if splice.is_none() && head.len() >= reach && reach < max_bytes {
        // More whitespace than was read: the whole body.
        let Some(body) = host.request_body(max_bytes) else {
            return false;
        };
        head = body;
        splice = replace_client_priority(&head, client, priority);
    }
    let Some(splice) = splice else {
        return false;
    };
    if !host.replace_request_body_start(splice.drain, &splice.insert) {
        return false;
    }
    // A chunked body has no length to correct.
    if let Some(length) = host
        .request_header("content-length")
        .and_then(|v| v.trim().parse::<usize>().ok())
    {
        let length = length
            .saturating_add(splice.insert.len())
            .saturating_sub(splice.drain);
        host.set_request_header("content-length", Some(&length.to_string()));
    }
    true
}

/// Counts whether the priority went into the body.
fn count_priority(host: &mut impl Host, written: bool) {
    // Literal names in the calls: scripts/check-deploy.sh matches docs/METRICS.md against them.
    if written {
        host.count_later("engine_priority.written", 1);
    } else {
        host.count_later("engine_priority.unwritten", 1);
    }
}
