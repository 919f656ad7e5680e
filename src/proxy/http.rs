//! One context per HTTP request.
//!
//! Request path: pause at the headers of an LLM endpoint, buffer the body, parse it, hash the
//! prompt, look up overlaps in this VM's index replica (no host call), read the load table (one
//! shared-data get), decide, book the request's load (one CAS), set the destination header, continue.
//! Response path: the first streamed bytes end the request's prefill; the response's end releases
//! exactly what was booked (a whole response: prefill and all, in one update); `on_log`, which
//! Envoy calls for every stream however it ended, releases whatever is still booked.

use super::host::{self, HostStore};
use super::learning::Sample;
use super::vm::{worker_id, VmState};
use crate::approx::Record;
use crate::config::{
    ClientHints, Config, DestinationFormat, KvPolicy, PrefillLoadModel, RoutingMode,
};
use crate::lazy_hash::PromptHasher;
use crate::load::{output_milli_blocks, Ticket};
use crate::load_store::{self, Release};
use crate::priority::{
    find_client_priority, replace_client_priority, request_priority, UNPRICED_PREFILL_MS,
};
use crate::prompt_text::{prompt_text, render_cache_key, text_prefix_hashes};
use crate::render::{classify, parse_reply, RenderFailure};
use crate::request::{
    parse_header_pin, parse_request_with, Endpoint, LlmRequest, ParseOptions, Pin, RequestError,
    HEADER_DP_RANK, HEADER_WORKER_ID,
};
use crate::router::{decide, prompt_blocks, Decision, RouteError, RouteInput};
use crate::text::{excerpt, MAX_EXCERPT_BYTES};
use crate::ttft::prefill_duration_ms;
use crate::types::SequenceHash;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, BufferType, MapType};
use std::cell::RefCell;
use std::ops::Range;
use std::rc::Rc;
use std::time::Duration;

const REASON_HEADER: &str = "x-kv-router-reason";

/// A lazily parsed request's token array is not an array of ids (see `TokenSpan`): the body
/// must be parsed again, eagerly.
struct BadTokenIds;

/// What the response headers report about the decision: the reason always (a short word from a
/// fixed set, e.g. `kv` or `fallback:invalid_json`), the rest only with `response_headers`.
struct Outcome {
    reason: String,
    detail: Option<OutcomeDetail>,
}

/// The chosen worker, its overlap and every candidate's cost: operator debugging data that
/// clients do not get unless `response_headers` is on.
struct OutcomeDetail {
    worker: String,
    overlap_blocks: u32,
    /// The longest device overlap any fresh slot had in this VM's index (what the decision
    /// could have had): with `overlap_blocks`, tells a load trade-off from a missing index entry.
    max_overlap_blocks: u32,
    costs: Option<String>,
    /// Every slot's inputs as the decision saw them: `worker/rank=prefill_tokens:active:overlap`
    /// (booked prefill tokens, requests in flight, device overlap blocks).
    loads: Option<String>,
}

/// The load this request booked, released in `on_log`.
struct Booking {
    /// What the load table holds for this request (fixed-size table; the details live here).
    ticket: Ticket,
    address: String,
    stream: bool,
    first_token_seen: bool,
    isl_tokens: u32,
    osl_hint: Option<u32>,
    generated_tokens: u32,
    output_milli_blocks: u64,
    /// What the first token teaches about the worker's timing.
    sample: Sample,
    /// When the first token arrived (0 before), and the streamed body chunks since.
    first_token_ms: u64,
    chunks: u32,
}

pub struct RequestContext {
    vm: Rc<RefCell<VmState>>,
    endpoint: Option<Endpoint>,
    header_pin: Pin,
    header_pin_error: Option<String>,
    /// The client sent a pin header (read only with `client_routing_hints: honor`).
    header_hints: bool,
    decided: bool,
    outcome: Option<Outcome>,
    booking: Option<Booking>,
    /// A tokenizer call in flight; the request is paused until it answers.
    render: Option<PendingRender>,
    /// Host calls made by this request's callbacks (`count-host-calls` builds; 0 otherwise).
    host_calls: u64,
    /// This filter wrote the destination header (which replaces any value the client sent).
    destination_set: bool,
}

/// A text request waiting for its exact ids from the tokenizer service.
struct PendingRender {
    token: u32,
    request: LlmRequest,
    text: String,
    cache_key: u64,
    started_ms: u64,
}

impl RequestContext {
    pub fn new(vm: Rc<RefCell<VmState>>) -> Self {
        RequestContext {
            vm,
            endpoint: None,
            header_pin: Pin::default(),
            header_pin_error: None,
            header_hints: false,
            decided: false,
            outcome: None,
            booking: None,
            render: None,
            host_calls: 0,
            destination_set: false,
        }
    }

    fn config(&self) -> Option<Rc<Config>> {
        self.vm.try_borrow().ok().map(|vm| Rc::clone(&vm.config))
    }

    /// Steers the request: the header replaces any value the client sent.
    fn set_destination(&mut self, config: &Config, value: &str) {
        host::set_header(
            MapType::HttpRequestHeaders,
            &config.destination_header,
            Some(value),
        );
        self.destination_set = true;
    }

    /// Clients never choose their upstream: before an LLM request goes on without a destination
    /// of this filter's, any destination the client sent is dropped. (Removed here rather than
    /// at the headers: on the usual path the filter's own value replaces it, one host call less.)
    fn drop_client_destination(&mut self) {
        if self.destination_set {
            return;
        }
        if let Some(config) = self.config() {
            host::set_header(
                MapType::HttpRequestHeaders,
                &config.destination_header,
                None,
            );
        }
        self.destination_set = true;
    }

    /// Notes the pin headers (parsed only when client hints are honoured) and removes them: the
    /// worker sees the filter's choice (`x-dp-rank` is set again for multi-rank workers), never
    /// the client's.
    fn take_header_pin(&mut self, policy: ClientHints) {
        let worker = host::header(MapType::HttpRequestHeaders, HEADER_WORKER_ID);
        let rank = host::header(MapType::HttpRequestHeaders, HEADER_DP_RANK);
        self.header_hints = worker.is_some() || rank.is_some();
        if !self.header_hints {
            return;
        }
        host::set_header(MapType::HttpRequestHeaders, HEADER_WORKER_ID, None);
        host::set_header(MapType::HttpRequestHeaders, HEADER_DP_RANK, None);
        if policy == ClientHints::Honor {
            match parse_header_pin(worker.as_deref(), rank.as_deref()) {
                Ok(pin) => self.header_pin = pin,
                Err(err) => self.header_pin_error = Some(err.to_string()),
            }
        }
    }

    /// Decides and steers. Returns the action for the body (or headers) callback.
    fn route(&mut self, body: &[u8]) -> Action {
        self.route_parsed(body, true)
    }

    /// [`Self::route`], the token ids left in the body (`lazy`, see `TokenSpan`) or read now.
    /// A lazy parse's `Ok` is provisional: if the ids turn out not to be an array of ids, the
    /// body is parsed again eagerly, for the answer (or the error) it always had.
    fn route_parsed(&mut self, body: &[u8], lazy: bool) -> Action {
        self.decided = true;
        let Some(endpoint) = self.endpoint else {
            return Action::Continue;
        };
        let vm_rc = Rc::clone(&self.vm);
        let Ok(mut vm_guard) = vm_rc.try_borrow_mut() else {
            return Action::Continue;
        };
        // A plain `&mut` so that disjoint fields (stale flags, selector) can be borrowed together.
        let vm: &mut VmState = &mut vm_guard;
        let config = Rc::clone(&vm.config);
        if let Some(error) = self.header_pin_error.take() {
            vm.metrics.inc("rejected.bad_request");
            return reject(400, "invalid_request_error", &error, None);
        }
        let honor = config.client_routing_hints == ClientHints::Honor;
        let options = ParseOptions {
            read_hints: honor,
            max_hint_items: config.client_routing_hints_max_items,
            // Ids are read from the body only as far as blocks are hashed (lazy_hash).
            lazy_token_ids: lazy,
        };
        let request = match parse_request_with(body, endpoint, &options) {
            Ok(request) => request,
            Err(err @ RequestError::TooManyItems { .. }) => {
                vm.metrics.inc("rejected.too_many_items");
                return reject(400, "invalid_request_error", &err.to_string(), None);
            }
            Err(RequestError::BatchedPrompt) => {
                vm.metrics.inc("rejected.batched_prompt");
                return reject(
                    400,
                    "invalid_request_error",
                    "batched prompts (an array of prompts) are not supported by the KV router: send one prompt per request",
                    None,
                );
            }
            Err(err) => {
                let why = match err {
                    RequestError::EmptyBody => "empty_body",
                    RequestError::InvalidJson { .. } | RequestError::NotAnObject => "invalid_json",
                    _ => "invalid_field",
                };
                log::debug!(
                    "kv-router: cannot read the request ({err}); routing by the fallback rule"
                );
                self.fallback(vm, &config, why);
                return Action::Continue;
            }
        };
        if (request.routing_hints || self.header_hints) && !honor {
            if config.client_routing_hints == ClientHints::Reject {
                vm.metrics.inc("rejected.client_routing_hints");
                return reject(
                    403,
                    "client_routing_hints_refused",
                    "this gateway does not accept client routing hints (x-worker-instance-id, x-dp-rank, nvext.backend_instance_id, nvext.dp_rank, nvext.allowed_worker_ids, nvext.required_taints, nvext.preferred_taints)",
                    None,
                );
            }
            // Not read (the parser skipped them): the request is routed as if they were absent.
            // (Counted once: a second parse of a lazy one sees them again.)
            if lazy {
                vm.metrics.inc("client_hints.ignored");
            }
        }
        // A text request in KV mode: exact ids from the tokenizer service (the request waits for
        // them), else its text prefix hashes (approximate mode).
        let text_routing = config.tokenizer.is_some() || config.approximate.is_some();
        if config.mode == RoutingMode::Kv
            && !request.has_token_ids()
            && request.text_chars > 0
            && text_routing
        {
            if let Some(text) = prompt_text(body, endpoint) {
                return self.route_text(vm, &config, request, text, endpoint, body);
            }
        }
        match self.decide_and_steer(vm, &config, request, body, None, None) {
            Ok(action) => action,
            Err(BadTokenIds) if lazy => {
                drop(vm_guard);
                self.route_parsed(body, false)
            }
            Err(BadTokenIds) => {
                // Not from an eager parse (no span): never happens.
                self.fallback(vm, &config, "invalid_field");
                Action::Continue
            }
        }
    }

    /// A text request: the cached render, else a tokenizer call (pauses), else text hashes.
    fn route_text(
        &mut self,
        vm: &mut VmState,
        config: &Config,
        mut request: LlmRequest,
        text: String,
        endpoint: Endpoint,
        body: &[u8],
    ) -> Action {
        let Some(tokenizer) = &config.tokenizer else {
            return self.route_by_text(vm, config, request, &text, None);
        };
        let cache_key = render_cache_key(
            endpoint,
            request.model.as_deref(),
            request.lora_name.as_deref(),
            &text,
        );
        if let Some(ids) = vm.render_cache.get(cache_key) {
            vm.metrics.inc("tokenizer.cache_hit");
            request.token_ids = Some(ids.as_ref().clone());
            request.rendered = true;
            return self.decide_known_ids(vm, config, request, None, None);
        }
        vm.metrics.inc("tokenizer.cache_miss");
        let path = match endpoint {
            Endpoint::ChatCompletions => tokenizer.chat_path.as_str(),
            Endpoint::Completions => tokenizer.completions_path.as_str(),
        };
        let authority = if tokenizer.address.is_empty() {
            tokenizer.cluster.as_str()
        } else {
            tokenizer.address.as_str()
        };
        let mut headers = vec![
            (":method", "POST"),
            (":path", path),
            (":authority", authority),
            (":scheme", "http"),
            ("content-type", "application/json"),
        ];
        if !tokenizer.address.is_empty() {
            headers.push(("x-envoy-original-dst-host", authority));
        }
        match host::http_call_with_body(
            &tokenizer.cluster,
            headers,
            body,
            Duration::from_millis(tokenizer.timeout_ms),
        ) {
            Ok(token) => {
                vm.metrics.inc("tokenizer.calls");
                self.render = Some(PendingRender {
                    token,
                    request,
                    text,
                    cache_key,
                    started_ms: host::now_ms(),
                });
                Action::Pause
            }
            Err(_) => {
                self.route_by_text(vm, config, request, &text, Some(RenderFailure::Unavailable))
            }
        }
    }

    /// Routes a text request by its text prefix hashes (approximate mode), or on load alone
    /// without it; `failure` says why the tokenizer gave no ids (header and counter).
    fn route_by_text(
        &mut self,
        vm: &mut VmState,
        config: &Config,
        mut request: LlmRequest,
        text: &str,
        failure: Option<RenderFailure>,
    ) -> Action {
        if let Some(f) = failure {
            vm.metrics
                .inc(&format!("tokenizer.fallback.{}", f.as_str()));
        }
        let hashes = config.approximate.as_ref().map(|a| {
            text_prefix_hashes(
                text,
                a.text_chunk_bytes,
                request.lora_name.as_deref(),
                a.max_record_blocks,
            )
        });
        request.text_prefix = hashes.is_some();
        self.decide_known_ids(
            vm,
            config,
            request,
            hashes,
            failure.map(RenderFailure::as_str),
        )
    }

    /// The tokenizer answered (or the call failed): route with its ids, else by text; resume.
    fn render_done(&mut self, token: u32, num_headers: usize, body_size: usize) {
        if self.render.as_ref().is_none_or(|p| p.token != token) {
            return;
        }
        let Some(pending) = self.render.take() else {
            return;
        };
        let vm_rc = Rc::clone(&self.vm);
        let Ok(mut vm_guard) = vm_rc.try_borrow_mut() else {
            self.drop_client_destination();
            let _ = host::resume_request();
            return;
        };
        let vm: &mut VmState = &mut vm_guard;
        let config = Rc::clone(&vm.config);
        let elapsed_ms = host::now_ms().saturating_sub(pending.started_ms);
        vm.metrics.histogram("tokenizer.render_ms", elapsed_ms);
        let status = if num_headers == 0 {
            None
        } else {
            host::header(MapType::HttpCallResponseHeaders, ":status")
        };
        let max_bytes = config
            .tokenizer
            .as_ref()
            .map_or(0, |t| t.max_response_bytes);
        let timeout_ms = config.tokenizer.as_ref().map_or(0, |t| t.timeout_ms);
        let ids = classify(status.as_deref(), body_size, max_bytes)
            .and_then(|()| {
                host::buffer(BufferType::HttpCallResponseBody, body_size)
                    .ok_or(RenderFailure::BadReply)
            })
            .and_then(|body| parse_reply(&body))
            .map_err(|f| {
                // Envoy ends a call that ran out of time without a response.
                if f == RenderFailure::Error && status.is_none() && elapsed_ms >= timeout_ms {
                    RenderFailure::Timeout
                } else {
                    f
                }
            });
        let mut request = pending.request;
        let action = match ids {
            Ok(ids) => {
                vm.metrics.inc("tokenizer.rendered");
                let ids = Rc::new(ids);
                request.token_ids = Some(ids.as_ref().clone());
                request.rendered = true;
                vm.render_cache.insert(pending.cache_key, ids);
                self.decide_known_ids(vm, &config, request, None, None)
            }
            Err(f) => {
                log::debug!(
                    "kv-router: tokenizer call failed ({}); routing by text",
                    f.as_str()
                );
                self.route_by_text(vm, &config, request, &pending.text, Some(f))
            }
        };
        // A local reply (a rejection) already ended the stream.
        if matches!(action, Action::Continue) {
            self.drop_client_destination();
            let _ = host::resume_request();
        }
    }

    /// [`Self::decide_and_steer`] for a request whose ids (if any) are read already.
    fn decide_known_ids(
        &mut self,
        vm: &mut VmState,
        config: &Config,
        request: LlmRequest,
        text_hashes: Option<Vec<SequenceHash>>,
        note: Option<&str>,
    ) -> Action {
        self.decide_and_steer(vm, config, request, &[], text_hashes, note)
            .unwrap_or_else(|BadTokenIds| {
                // Only a span's ids are checked late, and these requests have none.
                self.fallback(vm, config, "invalid_field");
                Action::Continue
            })
    }

    /// Hashes (unless `text_hashes` are given), looks up overlaps, decides and steers. `note`
    /// is appended to the reason (`kv-text:render_timeout`). `body` is the parsed body (where
    /// `request.token_span`'s ids are; empty when the request has none). `Err` (before anything
    /// is decided or booked): the span is not an array of ids; parse the body again, eagerly.
    fn decide_and_steer(
        &mut self,
        vm: &mut VmState,
        config: &Config,
        mut request: LlmRequest,
        body: &[u8],
        text_hashes: Option<Vec<SequenceHash>>,
        note: Option<&str>,
    ) -> Result<Action, BadTokenIds> {
        let now = host::now_ms();
        // Only KV mode scores prefix overlap; the basic modes skip hashing and the index.
        let from_text = text_hashes.is_some();
        let lora = request.lora_name.as_deref();
        let mut hasher = match (&request.token_ids, &request.token_span, &text_hashes) {
            (Some(tokens), _, None) if config.mode == RoutingMode::Kv => {
                Some(PromptHasher::new(tokens, config.block_size, lora))
            }
            (None, Some(span), None) if config.mode == RoutingMode::Kv => {
                Some(PromptHasher::from_span(body, span, config.block_size, lora))
            }
            _ => None,
        };
        // Events, stale flags and reported load the poller published since this thread's last
        // tick count at once.
        if vm.replica.is_behind(&HostStore) {
            vm.sync_replica();
        }
        // The sync may have brought a new membership table (and so a new effective configuration).
        let current = Rc::clone(&vm.config);
        let config: &Config = &current;
        if vm.predicted.is_some() && (hasher.is_some() || text_hashes.is_some()) {
            vm.sync_predictions(now);
        }
        // Hash only as far as some slot (indexed or predicted) holds the prefix: overlaps stop
        // at the first block nobody holds (lazy_hash).
        if let Some(h) = hasher.as_mut() {
            let index = &vm.replica.index;
            let predicted = vm.predicted.as_ref();
            h.hash_while_held(|seq| {
                index.holds_anywhere(seq) || predicted.is_some_and(|p| p.knows(seq))
            });
        }
        // Ids left in the body: those not hashed are checked and counted now (the load terms
        // need the prompt's length); not an array of ids after all: parsed again.
        if let Some(span) = request.token_span.as_mut() {
            let count = match &hasher {
                Some(h) => h.finish(),
                None => span.check(body),
            };
            span.set_count(count.ok_or(BadTokenIds)?);
        }
        let hashes: &[SequenceHash] = match (&text_hashes, &hasher) {
            (Some(t), _) => t,
            (None, Some(h)) => h.hashes(),
            (None, None) => &[],
        };
        let mut overlaps = std::mem::take(&mut vm.overlaps);
        if hashes.is_empty() || from_text {
            overlaps.clear();
        } else {
            vm.replica.index.find_overlaps(hashes, &mut overlaps);
        }
        if vm.predicted.is_some() && !hashes.is_empty() {
            merge_predictions(vm, config, hashes, from_text, now, &mut overlaps);
        }
        // One get and decode serve both the decision and the booking's first CAS attempt.
        let mut snapshot = load_store::read_snapshot(&HostStore, config.slots.len());
        let mut load = std::mem::take(&mut vm.load_view);
        snapshot.view_with(now, &mut load, &mut vm.load_views);
        if config.load.reported_load {
            vm.slot_reports.merge_into(config, &mut load);
        }
        let kv_usage: &[Option<f64>] = if config.load.reported_load && config.ttft.is_some() {
            &vm.slot_reports.kv_usage
        } else {
            &[]
        };
        let prompt_blocks = prompt_blocks(config, &request);
        let learning = config.ttft.as_ref().is_some_and(|t| t.learn);
        // The predicted policy's adaptive compute weight needs the arrival rate.
        let arrivals_per_ms = if config.policy == KvPolicy::Predicted {
            let active: u64 = load.iter().map(|l| u64::from(l.active_requests)).sum();
            vm.arrivals_per_ms(active, load.len())
        } else {
            0.0
        };
        let input = RouteInput {
            request: &request,
            header_pin: self.header_pin,
            prompt_blocks,
            overlaps: &overlaps,
            load: &load,
            stale_slots: &vm.slot_reports.stale,
            kv_usage,
            learned: learning.then_some(&vm.learned),
            arrivals_per_ms,
        };
        let decided = decide(config, &input, &mut vm.selector);
        vm.overlaps = overlaps;
        vm.load_view = load;
        Ok(match decided {
            Ok(decision) => {
                self.steer(vm, config, &decision, now, &request, note, snapshot);
                // A record needs the leading blocks even past the first miss: hashed only now.
                let record_hashes = |max_blocks: usize| match (text_hashes, hasher) {
                    (Some(t), _) => t,
                    (None, Some(mut h)) => {
                        h.extend_to(max_blocks);
                        h.into_hashes()
                    }
                    (None, None) => Vec::new(),
                };
                record_prediction(vm, config, &decision, record_hashes, from_text, now);
                Action::Continue
            }
            Err(RouteError::NonFiniteCost { slot, cost }) => {
                // Corrupt load or overlap input: never fail the request for it.
                log::error!("kv-router: slot {slot} scored a non-finite cost ({cost}); routing by the fallback rule");
                self.fallback(vm, config, "non_finite_cost");
                Action::Continue
            }
            Err(err) => {
                vm.metrics.inc(&format!("rejected.{}", err.kind()));
                log::debug!("kv-router: request rejected: {err}");
                reject(
                    err.http_status(),
                    err.kind(),
                    &err.to_string(),
                    err.retry_after_secs(),
                )
            }
        })
    }

    // The load snapshot rides along from the decision to the booking (one get, one decode).
    #[allow(clippy::too_many_arguments)]
    fn steer(
        &mut self,
        vm: &mut VmState,
        config: &Config,
        decision: &Decision,
        now: u64,
        request: &LlmRequest,
        note: Option<&str>,
        load: load_store::Snapshot,
    ) {
        let Some(slot) = config.slots.get(usize::from(decision.slot)) else {
            self.fallback(vm, config, "no_decision");
            return;
        };
        let Some(worker) = config.workers.get(usize::from(slot.worker)) else {
            self.fallback(vm, config, "no_decision");
            return;
        };
        let mut destination = worker.address_text.clone();
        if config.destination_format == DestinationFormat::OverrideHost {
            for fallback in &decision.fallbacks {
                if let Some(w) = config
                    .slots
                    .get(usize::from(*fallback))
                    .and_then(|s| config.workers.get(usize::from(s.worker)))
                {
                    destination.push(',');
                    destination.push_str(&w.address_text);
                }
            }
        }
        let reason = match note {
            Some(note) => format!("{}:{note}", decision.reason.as_str()),
            None => decision.reason.as_str().to_string(),
        };
        self.set_destination(config, &destination);
        host::set_header(MapType::HttpRequestHeaders, REASON_HEADER, Some(&reason));
        if worker.dp_size > 1 {
            host::set_header(
                MapType::HttpRequestHeaders,
                HEADER_DP_RANK,
                Some(&slot.dp_rank.to_string()),
            );
        }

        let key = vm.new_request_key();
        // The request's prefill on the worker's engine, in the worker's steps, else the `ttft`
        // policy's (the same steps its score prices).
        // Computed once, only when the decay or the priority needs it.
        let decays = config.load.prefill_load_model == PrefillLoadModel::Polynomial;
        let prefill_ms = (decays || config.engine_priority.is_some()).then(|| {
            prefill_duration_ms(
                worker.prefill_poly(&config.load.prefill_time_ms_poly),
                decision.prefill_tokens,
                worker
                    .max_num_batched_tokens
                    .or(config.ttft.as_ref().map(|t| t.chunk_tokens)),
            )
        });
        // The booked prefill decays over those steps, at the worker's learned speed.
        let factor = match &config.ttft {
            Some(t) if t.learn => vm.learned.factor(usize::from(slot.worker)),
            _ => 1.0,
        };
        let expected_ms = prefill_ms.filter(|_| decays).map(|ms| ms * factor);
        let priority = config
            .engine_priority
            .as_ref()
            .zip(prefill_ms)
            .map(|(e, ms)| request_priority(e, ms, now));
        let client = ClientPriority::Parsed(&request.client_priority);
        settle_priority(vm, config, priority, client);
        let booked = load_store::update_slot_from(
            &HostStore,
            config.slots.len(),
            decision.slot,
            now,
            Some(load),
            |table| {
                table.admit(
                    key,
                    decision.slot,
                    decision.prefill_tokens,
                    decision.prompt_blocks,
                    expected_ms,
                    now,
                )
            },
        );
        if let Ok(ticket) = booked {
            self.booking = Some(Booking {
                ticket,
                address: worker.address_text.clone(),
                stream: request.stream,
                first_token_seen: false,
                isl_tokens: request
                    .token_count()
                    .map_or(0, |n| u32::try_from(n).unwrap_or(u32::MAX)),
                osl_hint: request.osl_hint_tokens,
                generated_tokens: 0,
                output_milli_blocks: 0,
                sample: Sample {
                    worker_index: usize::from(slot.worker),
                    routed_ms: now,
                    predicted_ms: decision.predicted_base_ms,
                },
                first_token_ms: 0,
                chunks: 0,
            });
        } else {
            vm.metrics.inc("load.update_failed");
        }

        // Every request's counters: kept in the VM until the tick (see `Metrics::add_later`).
        vm.metrics
            .add_later(&format!("routed.{}", decision.reason.as_str()), 1);
        let overlap_blocks = decision.overlap.device_blocks;
        vm.metrics
            .add_later("overlap_blocks", u64::from(overlap_blocks));
        vm.metrics
            .histogram("overlap_blocks_per_request", u64::from(overlap_blocks));
        let mut outcome = Outcome {
            reason,
            detail: None,
        };
        if config.response_headers {
            let costs = (!decision.scores.is_empty()).then(|| {
                decision
                    .scores
                    .iter()
                    .filter_map(|(slot, cost)| {
                        let s = config.slots.get(usize::from(*slot))?;
                        Some(format!(
                            "{}/{}={:.3}",
                            worker_id(config, s.worker),
                            s.dp_rank,
                            cost
                        ))
                    })
                    .collect::<Vec<_>>()
                    .join(",")
            });
            let loads = (!vm.load_view.is_empty()).then(|| {
                config
                    .slots
                    .iter()
                    .enumerate()
                    .map(|(i, s)| {
                        let l = vm.load_view.get(i).copied().unwrap_or_default();
                        let stale = vm.slot_reports.stale.get(i).copied().unwrap_or(false);
                        let o = if stale {
                            0
                        } else {
                            vm.overlaps.get(i).map_or(0, |o| o.device_blocks)
                        };
                        format!(
                            "{}/{}={:.0}:{}:{}",
                            worker_id(config, s.worker),
                            s.dp_rank,
                            l.prefill_tokens,
                            l.active_requests,
                            o
                        )
                    })
                    .collect::<Vec<_>>()
                    .join(",")
            });
            let max_overlap_blocks = vm
                .overlaps
                .iter()
                .enumerate()
                .filter(|(i, _)| !vm.slot_reports.stale.get(*i).copied().unwrap_or(false))
                .map(|(_, o)| o.device_blocks)
                .max()
                .unwrap_or(0);
            outcome.detail = Some(OutcomeDetail {
                worker: worker.id.to_string(),
                overlap_blocks,
                max_overlap_blocks,
                costs,
                loads,
            });
        }
        self.outcome = Some(outcome);
    }

    /// The safe route when the filter cannot decide: the next worker in turn, with the reason.
    fn fallback(&mut self, vm: &mut VmState, config: &Config, why: &str) {
        // Routable workers only (all of them without membership).
        let routable: Vec<&crate::config::WorkerConfig> =
            config.workers.iter().filter(|w| w.routable).collect();
        let count = routable.len().max(1);
        let pick = usize::try_from(vm.new_request_key() % count as u64).unwrap_or(0);
        let reason = format!("fallback:{why}");
        if let Some(worker) = routable.get(pick) {
            self.set_destination(config, &worker.address_text);
            self.outcome = Some(Outcome {
                reason: reason.clone(),
                detail: config.response_headers.then(|| OutcomeDetail {
                    worker: worker.id.to_string(),
                    overlap_blocks: 0,
                    max_overlap_blocks: 0,
                    costs: None,
                    loads: None,
                }),
            });
        }
        host::set_header(MapType::HttpRequestHeaders, REASON_HEADER, Some(&reason));
        vm.metrics.inc(&format!("fallback.{why}"));
        let priority = config
            .engine_priority
            .as_ref()
            .map(|e| request_priority(e, UNPRICED_PREFILL_MS, host::now_ms()));
        // The client's priority is looked for in the body, unless it is not all here.
        let client = match why {
            "body_too_large" | "body_unreadable" => ClientPriority::Unreadable,
            _ => ClientPriority::Unparsed,
        };
        settle_priority(vm, config, priority, client);
    }

    /// Envoy may have retried the request on a fallback host: move the booking (and the reported
    /// worker) to the host that actually answered.
    fn follow_retry(&mut self) {
        let Some(config) = self.config() else { return };
        let Some(booking) = self.booking.as_mut() else {
            return;
        };
        let Some(upstream) = host::property(&["upstream", "address"]) else {
            return;
        };
        if upstream == booking.address {
            return;
        }
        let Some((index, worker)) = config
            .workers
            .iter()
            .enumerate()
            .find(|(_, w)| w.address_text == upstream)
        else {
            return;
        };
        let Some(slot) = u16::try_from(index)
            .ok()
            .and_then(|i| config.worker_slots(i).next())
        else {
            return;
        };
        let ticket = booking.ticket;
        let now = host::now_ms();
        if let Ok(moved) =
            load_store::move_booking(&HostStore, config.slots.len(), ticket, slot, now)
        {
            booking.ticket = moved;
            booking.address = upstream;
            // The prediction was for the first host: nothing to learn from this response.
            booking.sample.worker_index = index;
            booking.sample.predicted_ms = None;
            if let Some(detail) = self.outcome.as_mut().and_then(|o| o.detail.as_mut()) {
                detail.worker = worker.id.to_string();
            }
            if let Ok(mut vm) = self.vm.try_borrow_mut() {
                vm.metrics.inc("load.moved_on_retry");
            }
        }
    }

    fn first_token(&mut self) {
        let Some(booking) = self.booking.as_mut() else {
            return;
        };
        if booking.first_token_seen {
            return;
        }
        booking.first_token_seen = true;
        let ticket = booking.ticket;
        let Some(slots) = self.config().map(|c| c.slots.len()) else {
            return;
        };
        let now = host::now_ms();
        if let Ok(done) = load_store::update_slot(&HostStore, slots, ticket.slot, now, |table| {
            table.first_token(&ticket, now)
        }) {
            if let Some(booking) = self.booking.as_mut() {
                booking.ticket = done;
            }
        }
        if let Some(booking) = self.booking.as_mut() {
            booking.first_token_ms = now;
        }
        let sample = self.booking.as_ref().map(|b| b.sample);
        if let (Some(sample), Ok(mut vm)) = (sample, self.vm.try_borrow_mut()) {
            vm.learn_first_token(&sample, now);
        }
    }

    /// Counts generated tokens from SSE chunks and books output blocks as they cross boundaries.
    fn track_output(&mut self, chunk: &[u8]) {
        let Some(config) = self.config() else { return };
        let Some(booking) = self.booking.as_mut() else {
            return;
        };
        let events = count_sse_tokens(chunk);
        if events == 0 {
            return;
        }
        booking.generated_tokens = booking.generated_tokens.saturating_add(events);
        let milli = output_milli_blocks(
            booking.isl_tokens,
            booking.generated_tokens,
            config.block_size,
            booking.osl_hint,
        );
        // Write only on a visible change (a boundary, or 5% of a block of weight), not every token.
        if milli.abs_diff(booking.output_milli_blocks) < 50
            && !(milli == 0 && booking.output_milli_blocks > 0)
        {
            return;
        }
        booking.output_milli_blocks = milli;
        let ticket = booking.ticket;
        let now = host::now_ms();
        if let Ok(updated) =
            load_store::update_slot(&HostStore, config.slots.len(), ticket.slot, now, |table| {
                table.set_output_milli_blocks(&ticket, milli, now)
            })
        {
            booking.ticket = updated;
        }
    }
}

/// Bytes of the body read to place the priority: the object's `{` and the start of its first
/// member (past a client's own `priority`: that much after its value). Read whole when that is
/// not enough (more whitespace than this).
const PRIORITY_HEAD_BYTES: usize = 64;

/// What the filter knows of the client's own `priority` members.
enum ClientPriority<'a> {
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
fn settle_priority(
    vm: &mut VmState,
    config: &Config,
    priority: Option<i64>,
    client: ClientPriority,
) {
    let max_bytes = config.max_body_bytes;
    if config.client_routing_hints == ClientHints::Honor {
        if matches!(client, ClientPriority::Parsed(values) if !values.is_empty()) {
            vm.metrics.add_later("priority.client_honored", 1);
        } else if let Some(priority) = priority {
            // None parsed (in a body the parse did not read, the client's would come later
            // and win).
            count_priority(vm, write_priority(Some(priority), &[], max_bytes));
        }
        return;
    }
    let found;
    let values: &[Range<usize>] = match client {
        ClientPriority::Parsed(values) => values,
        ClientPriority::Unparsed => {
            let body = host::buffer(BufferType::HttpRequestBody, max_bytes).unwrap_or_default();
            found = if body.is_empty() {
                Some(Vec::new())
            } else {
                find_client_priority(&body)
            };
            found.as_deref().unwrap_or_else(|| {
                vm.metrics.add_later("priority.unchecked", 1);
                &[]
            })
        }
        ClientPriority::Unreadable => {
            vm.metrics.add_later("priority.unchecked", 1);
            &[]
        }
    };
    if values.is_empty() {
        if let Some(priority) = priority {
            count_priority(vm, write_priority(Some(priority), &[], max_bytes));
        }
        return;
    }
    if !write_priority(priority, values, max_bytes) {
        // Sent as it is: the client's priority reaches the engine (after the filter's, if any).
        vm.metrics.add_later("priority.client_unremoved", 1);
        if let Some(priority) = priority {
            count_priority(vm, write_priority(Some(priority), &[], max_bytes));
        }
    } else if priority.is_some() {
        vm.metrics.add_later("priority.client_replaced", 1);
        count_priority(vm, true);
    } else {
        vm.metrics.add_later("priority.client_dropped", 1);
    }
}

/// Makes `"priority": P` (when given) the buffered request body's first member and removes the
/// client's own `priority` members (their values at `client`), in one edit from the body's
/// start, and corrects the `content-length`. `false` (body unchanged) when the body is not a
/// JSON object they are members of, or Envoy refuses the edit.
fn write_priority(priority: Option<i64>, client: &[Range<usize>], max_bytes: usize) -> bool {
    let reach = client
        .last()
        .map_or(0, |value| value.end)
        .saturating_add(PRIORITY_HEAD_BYTES);
    let Some(mut head) = host::buffer(BufferType::HttpRequestBody, reach) else {
        return false;
    };
    let mut splice = replace_client_priority(&head, client, priority);
    if splice.is_none() && head.len() >= reach && reach < max_bytes {
        // More whitespace than was read: the whole body.
        let Some(body) = host::buffer(BufferType::HttpRequestBody, max_bytes) else {
            return false;
        };
        head = body;
        splice = replace_client_priority(&head, client, priority);
    }
    let Some(splice) = splice else {
        return false;
    };
    if !host::replace_buffer_start(BufferType::HttpRequestBody, splice.drain, &splice.insert) {
        return false;
    }
    // A chunked body has no length to correct.
    if let Some(length) = host::header(MapType::HttpRequestHeaders, "content-length")
        .and_then(|v| v.trim().parse::<usize>().ok())
    {
        let length = length
            .saturating_add(splice.insert.len())
            .saturating_sub(splice.drain);
        host::set_header(
            MapType::HttpRequestHeaders,
            "content-length",
            Some(&length.to_string()),
        );
    }
    true
}

/// Counts whether the priority went into the body.
fn count_priority(vm: &mut VmState, written: bool) {
    // Literal names in the calls: scripts/check-deploy.sh matches docs/METRICS.md against them.
    if written {
        vm.metrics.add_later("engine_priority.written", 1);
    } else {
        vm.metrics.add_later("engine_priority.unwritten", 1);
    }
}

/// Raises each slot's device overlap to its predicted run: every slot for text hashes (only
/// predictions know them), only `kv_mode` approximate slots for token hashes.
fn merge_predictions(
    vm: &VmState,
    config: &Config,
    hashes: &[SequenceHash],
    from_text: bool,
    now: u64,
    overlaps: &mut Vec<crate::types::Overlap>,
) {
    let Some(store) = vm.predicted.as_ref() else {
        return;
    };
    let slots = config.slots.len();
    let predicted = store.overlaps(hashes, slots, now);
    overlaps.resize(slots, crate::types::Overlap::default());
    for (i, (overlap, blocks)) in overlaps.iter_mut().zip(predicted).enumerate() {
        let counts = from_text
            || config
                .slots
                .get(i)
                .and_then(|s| config.workers.get(usize::from(s.worker)))
                .is_some_and(|w| w.kv_mode.has_predictions());
        if counts && blocks > overlap.device_blocks {
            overlap.device_blocks = blocks;
        }
    }
}

/// Publishes the decision as predicted blocks on the chosen slot (approximate mode).
fn record_prediction(
    vm: &mut VmState,
    config: &Config,
    decision: &Decision,
    hashes: impl FnOnce(usize) -> Vec<SequenceHash>,
    from_text: bool,
    now: u64,
) {
    let Some(approx) = config.approximate.as_ref() else {
        return;
    };
    let predicts = from_text
        || config
            .worker_of_slot(decision.slot)
            .is_some_and(|w| w.kv_mode.has_predictions());
    if !predicts {
        return;
    }
    let mut hashes = hashes(approx.max_record_blocks);
    if hashes.is_empty() {
        return;
    }
    hashes.truncate(approx.max_record_blocks);
    let record = Record {
        slot: decision.slot,
        expires_ms: now.saturating_add(approx.ttl_ms),
        hashes,
    };
    if crate::approx::publish(&HostStore, &record) {
        vm.metrics.inc("approx.published");
    } else {
        vm.metrics.inc("approx.publish_failed");
    }
    vm.sync_predictions(now);
}

/// SSE `data:` events other than `[DONE]`: one generated token each (engines stream per token).
fn count_sse_tokens(chunk: &[u8]) -> u32 {
    let mut count = 0u32;
    for line in chunk.split(|b| *b == b'\n') {
        let line = line.strip_prefix(b"data:").map(|l| l.trim_ascii());
        if let Some(payload) = line {
            if !payload.is_empty() && payload != b"[DONE]" {
                count = count.saturating_add(1);
            }
        }
    }
    count
}

/// A local JSON error reply. The message is cut to a short excerpt: it may quote client input
/// (a model name, a header value), and an error must never echo a large body back.
fn reject(status: u32, kind: &str, message: &str, retry_after_secs: Option<u32>) -> Action {
    let message = excerpt(message, MAX_EXCERPT_BYTES);
    let body = serde_json::json!({"error": {"message": message, "type": kind, "code": status}})
        .to_string();
    let retry = retry_after_secs.map(|s| s.to_string());
    let mut headers = vec![("content-type", "application/json"), (REASON_HEADER, kind)];
    if let Some(retry) = retry.as_deref() {
        headers.push(("retry-after", retry));
    }
    host::local_reply(status, headers, body.as_bytes());
    Action::Pause
}

/// The callbacks' bodies: the trait impls below count each one's host calls around them.
impl RequestContext {
    fn request_headers(&mut self, end_of_stream: bool) -> Action {
        #[cfg(feature = "test-crash-trigger")]
        crate::proxy::crash_trigger::trap_if_asked();
        let Some(config) = self.config() else {
            // Clients never choose their upstream, on any path.
            self.drop_client_destination();
            return Action::Continue;
        };
        let path = host::header(MapType::HttpRequestHeaders, ":path").unwrap_or_default();
        self.endpoint = Endpoint::from_path(&path, &config.llm_paths);
        if self.endpoint.is_none() {
            self.drop_client_destination();
            return Action::Continue;
        }
        self.take_header_pin(config.client_routing_hints);
        if end_of_stream {
            return self.route(&[]);
        }
        Action::Pause
    }

    fn request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.endpoint.is_none() || self.decided {
            return Action::Continue;
        }
        let Some(config) = self.config() else {
            return Action::Continue;
        };
        if body_size > config.max_body_bytes {
            self.decided = true;
            if let Ok(mut vm) = Rc::clone(&self.vm).try_borrow_mut() {
                self.fallback(&mut vm, &config, "body_too_large");
            }
            return Action::Continue;
        }
        if !end_of_stream {
            return Action::Pause;
        }
        match host::buffer(BufferType::HttpRequestBody, body_size) {
            Some(body) => self.route(&body),
            None => {
                self.decided = true;
                if let Ok(mut vm) = Rc::clone(&self.vm).try_borrow_mut() {
                    self.fallback(&mut vm, &config, "body_unreadable");
                }
                Action::Continue
            }
        }
    }

    fn response_headers(&mut self, end_of_stream: bool) -> Action {
        // Where Envoy sent the request matters while the booking lasts: through a stream, or for
        // the reported worker. A whole response is released as soon as it ends (below), from
        // the slot it was booked on, so its upstream address is not read.
        let moves = self.booking.as_ref().is_some_and(|b| b.stream)
            || self.config().is_some_and(|c| c.response_headers);
        if moves {
            self.follow_retry();
        }
        if let Some(outcome) = &self.outcome {
            host::set_header(
                MapType::HttpResponseHeaders,
                REASON_HEADER,
                Some(&outcome.reason),
            );
            if let Some(detail) = &outcome.detail {
                host::set_header(
                    MapType::HttpResponseHeaders,
                    "x-kv-router-worker",
                    Some(&detail.worker),
                );
                host::set_header(
                    MapType::HttpResponseHeaders,
                    "x-kv-router-overlap-blocks",
                    Some(&detail.overlap_blocks.to_string()),
                );
                host::set_header(
                    MapType::HttpResponseHeaders,
                    "x-kv-router-max-overlap-blocks",
                    Some(&detail.max_overlap_blocks.to_string()),
                );
                if let Some(costs) = &detail.costs {
                    host::set_header(
                        MapType::HttpResponseHeaders,
                        "x-kv-router-costs",
                        Some(costs),
                    );
                }
                if let Some(loads) = &detail.loads {
                    host::set_header(
                        MapType::HttpResponseHeaders,
                        "x-kv-router-loads",
                        Some(loads),
                    );
                }
            }
        }
        // A response without a body ends here. Otherwise the first body bytes end the prefill
        // (for a whole, non-streamed response they usually come with its end: then one update
        // releases the request, prefill included).
        if end_of_stream {
            self.release_booking();
        }
        Action::Continue
    }

    fn response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.booking.is_none() {
            return Action::Continue;
        }
        // The worker is done with the request when its response ends: released now, in one
        // load-table update (first token and release at once), not at `on_log`, which may come
        // later (a slow client draining Envoy's buffer).
        if end_of_stream {
            self.release_booking();
            return Action::Continue;
        }
        // A whole (non-streamed) response is only sent once generation is over, and its end
        // follows its first bytes at once (HTTP/1.1 delivers the body, then an empty end): its
        // release above ends its prefill too, with one update instead of two.
        if body_size == 0 || self.booking.as_ref().is_some_and(|b| !b.stream) {
            return Action::Continue;
        }
        if let Some(booking) = self.booking.as_mut() {
            booking.chunks = booking.chunks.saturating_add(1);
        }
        self.first_token();
        let track = self.config().is_some_and(|c| c.load.track_output_blocks);
        if track && self.booking.as_ref().is_some_and(|b| b.stream) {
            if let Some(chunk) = host::buffer(BufferType::HttpResponseBody, body_size) {
                self.track_output(&chunk);
            }
        }
        Action::Continue
    }

    fn log(&mut self) {
        // Whatever ended the stream (reset, timeout, local reply), its booking goes.
        self.release_booking();
    }

    /// Releases exactly what the request booked (once: the booking is taken).
    fn release_booking(&mut self) {
        let Some(booking) = self.booking.take() else {
            return;
        };
        let now = host::now_ms();
        let Ok(mut vm) = self.vm.try_borrow_mut() else {
            // Never expected (no other callback runs inside on_log); release without the queue.
            if let Some(config) = self.config() {
                let ticket = booking.ticket;
                let _ = load_store::update_slot(
                    &HostStore,
                    config.slots.len(),
                    ticket.slot,
                    now,
                    |t| t.release_at(&ticket, now).then_some(()),
                );
            }
            return;
        };
        vm.learn_lifetime(booking.sample.routed_ms, now);
        if booking.stream {
            vm.record_itl(
                booking.sample.worker_index,
                booking.first_token_ms,
                booking.chunks,
                now,
            );
        }
        let slots = vm.config.slots.len();
        match vm.releases.release(&HostStore, slots, booking.ticket, now) {
            Release::Released => {}
            Release::Unknown => vm.metrics.inc("load.release_unknown"),
            Release::Deferred => vm.metrics.inc("load.release_deferred"),
        }
    }
}

impl RequestContext {
    /// Adds the host calls made since `mark` (a [`host::calls`] reading) to this request's.
    fn count_host_calls(&mut self, mark: u64) {
        self.host_calls += host::calls().saturating_sub(mark);
    }

    /// `debug.host_calls` and `debug.requests` (the `count-host-calls` build only): the host
    /// calls of every callback of this request's context, for the benchmarks.
    fn flush_host_calls(&mut self) {
        #[cfg(feature = "count-host-calls")]
        if let Ok(mut vm) = self.vm.try_borrow_mut() {
            vm.metrics.add("debug.host_calls", self.host_calls);
            vm.metrics.inc("debug.requests");
        }
    }
}

impl Context for RequestContext {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        let mark = host::calls();
        self.render_done(token_id, num_headers, body_size);
        self.count_host_calls(mark);
    }
}

impl HttpContext for RequestContext {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let mark = host::calls();
        let action = self.request_headers(end_of_stream);
        if matches!(action, Action::Continue) {
            self.drop_client_destination();
        }
        self.count_host_calls(mark);
        action
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let mark = host::calls();
        let action = self.request_body(body_size, end_of_stream);
        if matches!(action, Action::Continue) {
            self.drop_client_destination();
        }
        self.count_host_calls(mark);
        action
    }

    /// A request with trailers goes on here without a decision (the body never ended): it must
    /// not keep a destination the client sent either.
    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        let mark = host::calls();
        self.drop_client_destination();
        self.count_host_calls(mark);
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let mark = host::calls();
        let action = self.response_headers(end_of_stream);
        self.count_host_calls(mark);
        action
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let mark = host::calls();
        let action = self.response_body(body_size, end_of_stream);
        self.count_host_calls(mark);
        action
    }

    fn on_log(&mut self) {
        let mark = host::calls();
        self.log();
        self.count_host_calls(mark);
        self.flush_host_calls();
    }
}
