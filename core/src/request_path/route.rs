//! Parse, hash, look up overlaps, read the load, decide: then steer, reject or fall back.

use super::context::{Action, RequestPath};
use super::counters::{self, Fallback};
use super::host::Host;
use super::state::RoutingState;
use super::steer::{merge_predictions, record_prediction};
use super::REASON_HEADER;
use crate::config::{ClientHints, Config, KvPolicy, RoutingMode, UnseenTraffic};
use crate::lazy_hash::PromptHasher;
use crate::load::recent;
use crate::load_store;
use crate::prompt_text::prompt_text;
use crate::request::{parse_request_with, LlmRequest, ParseOptions, RequestError};
use crate::router::{decide, isl_tokens, prompt_blocks, RouteError, RouteInput};
use crate::text::{excerpt, MAX_EXCERPT_BYTES};
use crate::types::SequenceHash;
use std::rc::Rc;

/// A lazily parsed request's token array is not an array of ids (see `TokenSpan`): the body
/// must be parsed again, eagerly.
pub(super) struct BadTokenIds;

impl RequestPath {
    /// Decides and steers. Returns the action for the body (or headers) callback.
    pub(super) fn route(
        &mut self,
        host: &mut impl Host,
        vm: &mut RoutingState,
        body: &[u8],
    ) -> Action {
        self.route_parsed(host, vm, body, true)
    }

    /// [`Self::route`], the token ids left in the body (`lazy`, see `TokenSpan`) or read now.
    /// A lazy parse's `Ok` is provisional: if the ids turn out not to be an array of ids, the
    /// body is parsed again eagerly, for the answer (or the error) it always had.
    fn route_parsed(
        &mut self,
        host: &mut impl Host,
        vm: &mut RoutingState,
        body: &[u8],
        lazy: bool,
    ) -> Action {
        self.decided = true;
        let Some(endpoint) = self.endpoint else {
            return Action::Continue;
        };
        let config = Rc::clone(&vm.config);
        if let Some(error) = self.header_pin_error.take() {
            host.count("rejected.bad_request", 1);
            return reject(host, 400, "invalid_request_error", &error, None);
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
                host.count("rejected.too_many_items", 1);
                return reject(host, 400, "invalid_request_error", &err.to_string(), None);
            }
            Err(RequestError::BatchedPrompt) => {
                host.count("rejected.batched_prompt", 1);
                return reject(
                    host,
                    400,
                    "invalid_request_error",
                    "batched prompts (an array of prompts) are not supported by the KV router: send one prompt per request",
                    None,
                );
            }
            Err(err) => {
                let why = match err {
                    RequestError::EmptyBody => Fallback::EmptyBody,
                    RequestError::InvalidJson { .. } | RequestError::NotAnObject => {
                        Fallback::InvalidJson
                    }
                    _ => Fallback::InvalidField,
                };
                log::debug!(
                    "kv-router: cannot read the request ({err}); routing by the fallback rule"
                );
                self.fallback(host, vm, &config, why);
                return Action::Continue;
            }
        };
        if (request.routing_hints || self.header_hints) && !honor {
            if config.client_routing_hints == ClientHints::Reject {
                host.count("rejected.client_routing_hints", 1);
                return reject(
                    host,
                    403,
                    "client_routing_hints_refused",
                    "this gateway does not accept client routing hints (x-worker-instance-id, x-dp-rank, nvext.backend_instance_id, nvext.dp_rank, nvext.allowed_worker_ids, nvext.required_taints, nvext.preferred_taints)",
                    None,
                );
            }
            // Not read (the parser skipped them): the request is routed as if they were absent.
            // (Counted once: a second parse of a lazy one sees them again.)
            if lazy {
                host.count("client_hints.ignored", 1);
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
                return self.route_text(host, vm, &config, request, text, endpoint, body);
            }
        }
        match self.decide_and_steer(host, vm, request, body, None, None) {
            Ok(action) => action,
            Err(BadTokenIds) if lazy => self.route_parsed(host, vm, body, false),
            Err(BadTokenIds) => {
                // Not from an eager parse (no span): never happens.
                self.fallback(host, vm, &config, Fallback::InvalidField);
                Action::Continue
            }
        }
    }

    /// [`Self::decide_and_steer`] for a request whose ids (if any) are read already.
    pub(super) fn decide_known_ids(
        &mut self,
        host: &mut impl Host,
        vm: &mut RoutingState,
        config: &Config,
        request: LlmRequest,
        text_hashes: Option<Vec<SequenceHash>>,
        note: Option<&str>,
    ) -> Action {
        self.decide_and_steer(host, vm, request, &[], text_hashes, note)
            .unwrap_or_else(|BadTokenIds| {
                // Only a span's ids are checked late, and these requests have none.
                self.fallback(host, vm, config, Fallback::InvalidField);
                Action::Continue
            })
    }

    /// Hashes (unless `text_hashes` are given), looks up overlaps, decides and steers. `note`
    /// is appended to the reason (`kv-text:render_timeout`). `body` is the parsed body (where
    /// `request.token_span`'s ids are; empty when the request has none). `Err` (before anything
    /// is decided or booked): the span is not an array of ids; parse the body again, eagerly.
    fn decide_and_steer(
        &mut self,
        host: &mut impl Host,
        vm: &mut RoutingState,
        mut request: LlmRequest,
        body: &[u8],
        text_hashes: Option<Vec<SequenceHash>>,
        note: Option<&str>,
    ) -> Result<Action, BadTokenIds> {
        let now = host.now_ms();
        let config = Rc::clone(&vm.config);
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
        if vm.replica.is_behind(host.store()) {
            vm.sync_replica(host);
        }
        // The sync may have brought a new membership table (and so a new effective configuration).
        let current = Rc::clone(&vm.config);
        let config: &Config = &current;
        if vm.predicted.is_some() && (hasher.is_some() || text_hashes.is_some()) {
            vm.sync_predictions(host, now);
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
        let mut snapshot = load_store::read_snapshot(host.store(), config.slots.len());
        let mut load = std::mem::take(&mut vm.load_view);
        snapshot.view_with(now, &mut load, &mut vm.load_views);
        if config.load.reported_load {
            // The share is sampled on every decision only when it shapes the load view this
            // way; `relayed` samples it on every tick (`sample_traffic_on_tick`); otherwise
            // only for its metric, once a second.
            let per_worker = config.load.unseen_traffic == UnseenTraffic::PerWorker;
            let relayed = config.load.unseen_traffic == UnseenTraffic::Relayed;
            let others = vm.traffic_share.relayed_ratio();
            let due = now >= vm.traffic_share_recorded_ms + 1000;
            if per_worker || (due && !relayed) {
                let share = &mut vm.traffic_share;
                vm.slot_reports.sample_share(config, share, &load, now);
            }
            if per_worker {
                vm.slot_reports
                    .add_unseen(config, &vm.traffic_share, &mut load);
            }
            if due {
                vm.traffic_share_recorded_ms = now;
                let scale = vm.traffic_share.scale();
                host.histogram("load.traffic_scale_pct", (scale * 100.0) as u64);
                if relayed {
                    host.histogram("load.relayed_ratio_pct", (others * 100.0) as u64);
                }
            }
            // With `per_worker` the unseen requests are priced above already.
            let request_tokens = if per_worker {
                0.0
            } else {
                f64::from(isl_tokens(&request))
            };
            vm.slot_reports
                .merge_into(config, &mut load, request_tokens);
            if relayed {
                let half_life = recent::half_life_ms(config.tick_ms);
                vm.recent_bookings
                    .add_inferred(others, &mut load, now, half_life);
            }
        }
        let kv_usage: &[Option<f64>] = if config.load.reported_load {
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
                self.steer(host, vm, config, &decision, now, &request, note, snapshot);
                // A record needs the leading blocks even past the first miss: hashed only now.
                let record_hashes = |max_blocks: usize| match (text_hashes, hasher) {
                    (Some(t), _) => t,
                    (None, Some(mut h)) => {
                        h.extend_to(max_blocks);
                        h.into_hashes()
                    }
                    (None, None) => Vec::new(),
                };
                record_prediction(host, vm, config, &decision, record_hashes, from_text, now);
                vm.selector.recycle(decision);
                Action::Continue
            }
            Err(RouteError::NonFiniteCost { slot, cost }) => {
                // Corrupt load or overlap input: never fail the request for it.
                log::error!("kv-router: slot {slot} scored a non-finite cost ({cost}); routing by the fallback rule");
                self.fallback(host, vm, config, Fallback::NonFiniteCost);
                Action::Continue
            }
            Err(err) => {
                host.count(counters::rejected(&err), 1);
                log::debug!("kv-router: request rejected: {err}");
                reject(
                    host,
                    err.http_status(),
                    err.kind(),
                    &err.to_string(),
                    err.retry_after_secs(),
                )
            }
        })
    }
}

/// A local JSON error reply. The message is cut to a short excerpt: it may quote client input
/// (a model name, a header value), and an error must never echo a large body back.
pub(super) fn reject(
    host: &mut impl Host,
    status: u32,
    kind: &str,
    message: &str,
    retry_after_secs: Option<u32>,
) -> Action {
    let message = excerpt(message, MAX_EXCERPT_BYTES);
    let body = serde_json::json!({"error": {"message": message, "type": kind, "code": status}})
        .to_string();
    let retry = retry_after_secs.map(|s| s.to_string());
    match retry.as_deref() {
        Some(retry) => host.send_local_reply(
            status,
            &[
                ("content-type", "application/json"),
                (REASON_HEADER, kind),
                ("retry-after", retry),
            ],
            body.as_bytes(),
        ),
        None => host.send_local_reply(
            status,
            &[("content-type", "application/json"), (REASON_HEADER, kind)],
            body.as_bytes(),
        ),
    }
    Action::Pause
}
