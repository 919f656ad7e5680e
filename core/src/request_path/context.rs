//! One request's state and the callbacks the adapter forwards to it.
//!
//! Request path: pause at the headers of an LLM endpoint, buffer the body, parse it, hash the
//! prompt, look up overlaps in this VM's index replica (no host call), read the load table (one
//! shared-data get), decide, book the request's load (one CAS), set the destination header,
//! continue. Response path: the first streamed bytes end the request's prefill; the response's
//! end releases exactly what was booked (a whole response: prefill and all, in one update);
//! `on_log`, which Envoy calls for every stream however it ended, releases whatever is still
//! booked.

use super::counters::Fallback;
use super::host::Host;
use super::state::{RoutingState, Sample};
use crate::config::{ClientHints, Config};
use crate::load::Ticket;
use crate::request::{
    parse_header_pin, Endpoint, LlmRequest, Pin, HEADER_DP_RANK, HEADER_WORKER_ID,
};
use std::borrow::Cow;
use std::rc::Rc;

/// What a callback tells the host: go on with the stream, or hold it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    Continue,
    Pause,
}

/// What the response headers report about the decision: the reason always (a short word from a
/// fixed set, e.g. `kv` or `fallback:invalid_json`), the rest only with `response_headers`.
pub(super) struct Outcome {
    pub reason: Cow<'static, str>,
    pub detail: Option<OutcomeDetail>,
}

/// The chosen worker, its overlap and every candidate's cost: operator debugging data that
/// clients do not get unless `response_headers` is on.
pub(super) struct OutcomeDetail {
    pub worker: String,
    pub overlap_blocks: u32,
    /// The longest device overlap any fresh slot had in this VM's index (what the decision
    /// could have had): with `overlap_blocks`, tells a load trade-off from a missing index entry.
    pub max_overlap_blocks: u32,
    pub costs: Option<String>,
    /// Every slot's inputs as the decision saw them: `worker/rank=prefill_tokens:active:overlap`
    /// (booked prefill tokens, requests in flight, device overlap blocks).
    pub loads: Option<String>,
}

/// The load this request booked, released at the response's end or in `on_log`.
pub(super) struct Booking {
    /// What the load table holds for this request (fixed-size table; the details live here).
    pub ticket: Ticket,
    pub address: String,
    pub stream: bool,
    pub first_token_seen: bool,
    pub isl_tokens: u32,
    pub osl_hint: Option<u32>,
    pub generated_tokens: u32,
    pub output_milli_blocks: u64,
    /// What the first token teaches about the worker's timing.
    pub sample: Sample,
    /// When the first token arrived (0 before), and the streamed body chunks since.
    pub first_token_ms: u64,
    pub chunks: u32,
}

/// A text request waiting for its exact ids from the tokenizer service.
pub(super) struct PendingRender {
    pub token: u32,
    pub request: LlmRequest,
    pub text: String,
    pub cache_key: u64,
    pub started_ms: u64,
}

/// One request's state, from its headers to its log.
#[derive(Default)]
pub struct RequestPath {
    pub(super) endpoint: Option<Endpoint>,
    pub(super) header_pin: Pin,
    pub(super) header_pin_error: Option<String>,
    /// The client sent a pin header (read only with `client_routing_hints: honor`).
    pub(super) header_hints: bool,
    pub(super) decided: bool,
    pub(super) outcome: Option<Outcome>,
    pub(super) booking: Option<Booking>,
    /// A tokenizer call in flight; the request is paused until it answers.
    pub(super) render: Option<PendingRender>,
    /// This filter wrote the destination header (which replaces any value the client sent).
    pub(super) destination_set: bool,
}

impl RequestPath {
    pub fn new() -> Self {
        Self::default()
    }

    /// Every candidate's final cost as the decision saw it (`worker/rank=cost,...`), when
    /// `response_headers` is on: what a simulator compares with a forecast.
    pub fn decision_costs(&self) -> Option<&str> {
        self.outcome.as_ref()?.detail.as_ref()?.costs.as_deref()
    }

    /// The request's headers: an LLM endpoint pauses for its body (routed at once if it has
    /// none); anything else goes on, without a client-chosen destination.
    pub fn on_request_headers(
        &mut self,
        host: &mut impl Host,
        vm: &mut RoutingState,
        end_of_stream: bool,
    ) -> Action {
        let config = Rc::clone(&vm.config);
        let path = host.request_header(":path").unwrap_or_default();
        self.endpoint = Endpoint::from_path(&path, &config.llm_paths);
        let action = if self.endpoint.is_none() {
            Action::Continue
        } else {
            self.take_header_pin(host, config.client_routing_hints);
            if end_of_stream {
                self.route(host, vm, &[])
            } else {
                Action::Pause
            }
        };
        self.continue_without_client_destination(host, &vm.config, action)
    }

    /// A body chunk (`body_size`: all buffered so far): routed at its end.
    pub fn on_request_body(
        &mut self,
        host: &mut impl Host,
        vm: &mut RoutingState,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        let action = self.request_body(host, vm, body_size, end_of_stream);
        self.continue_without_client_destination(host, &vm.config, action)
    }

    fn request_body(
        &mut self,
        host: &mut impl Host,
        vm: &mut RoutingState,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        if self.endpoint.is_none() || self.decided {
            return Action::Continue;
        }
        let config = Rc::clone(&vm.config);
        if body_size > config.max_body_bytes {
            self.decided = true;
            self.fallback(host, vm, &config, Fallback::BodyTooLarge);
            return Action::Continue;
        }
        if !end_of_stream {
            return Action::Pause;
        }
        match host.request_body(body_size) {
            Some(body) => self.route(host, vm, &body),
            None => {
                self.decided = true;
                self.fallback(host, vm, &config, Fallback::BodyUnreadable);
                Action::Continue
            }
        }
    }

    /// A request with trailers goes on here without a decision (the body never ended): it must
    /// not keep a destination the client sent either.
    pub fn on_request_trailers(&mut self, host: &mut impl Host, config: &Config) -> Action {
        self.drop_client_destination(host, config);
        Action::Continue
    }

    /// The tokenizer callout `token` answered (`num_headers` 0: it failed without a reply).
    pub fn on_call_response(
        &mut self,
        host: &mut impl Host,
        vm: &mut RoutingState,
        token: u32,
        num_headers: usize,
        body_size: usize,
    ) {
        self.render_done(host, vm, token, num_headers, body_size);
    }

    fn continue_without_client_destination(
        &mut self,
        host: &mut impl Host,
        config: &Config,
        action: Action,
    ) -> Action {
        if action == Action::Continue {
            self.drop_client_destination(host, config);
        }
        action
    }

    /// Steers the request: the header replaces any value the client sent.
    pub(super) fn set_destination(&mut self, host: &mut impl Host, config: &Config, value: &str) {
        host.set_request_header(&config.destination_header, Some(value));
        self.destination_set = true;
    }

    /// Clients never choose their upstream: before an LLM request goes on without a destination
    /// of this filter's, any destination the client sent is dropped. (Removed here rather than
    /// at the headers: on the usual path the filter's own value replaces it, one host call less.)
    pub fn drop_client_destination(&mut self, host: &mut impl Host, config: &Config) {
        if self.destination_set {
            return;
        }
        host.set_request_header(&config.destination_header, None);
        self.destination_set = true;
    }

    /// Notes the pin headers (parsed only when client hints are honoured) and removes them: the
    /// worker sees the filter's choice (`x-dp-rank` is set again for multi-rank workers), never
    /// the client's.
    fn take_header_pin(&mut self, host: &mut impl Host, policy: ClientHints) {
        let worker = host.request_header(HEADER_WORKER_ID);
        let rank = host.request_header(HEADER_DP_RANK);
        self.header_hints = worker.is_some() || rank.is_some();
        if !self.header_hints {
            return;
        }
        host.set_request_header(HEADER_WORKER_ID, None);
        host.set_request_header(HEADER_DP_RANK, None);
        if policy == ClientHints::Honor {
            match parse_header_pin(worker.as_deref(), rank.as_deref()) {
                Ok(pin) => self.header_pin = pin,
                Err(err) => self.header_pin_error = Some(err.to_string()),
            }
        }
    }
}
