//! Steering a decided request (destination, reason, rank, booking, counters, response-header
//! detail), the fallback rule when the filter cannot decide, and approximate mode's predictions.

use super::body_priority::{settle_priority, ClientPriority};
use super::context::{Booking, Outcome, OutcomeDetail, RequestPath};
use super::counters::{self, Fallback};
use super::host::Host;
use super::state::{worker_id, RoutingState, Sample};
use super::REASON_HEADER;
use crate::approx::Record;
use crate::config::{Config, DestinationFormat, KvPolicy, PrefillLoadModel, UnseenTraffic};
use crate::load::recent;
use crate::load_store;
use crate::prefill_work::prefill_work_tokens;
use crate::priority::{request_priority, UNPRICED_PREFILL_MS};
use crate::request::{LlmRequest, HEADER_DP_RANK};
use crate::router::Decision;
use crate::ttft::prefill_duration_ms;
use crate::types::{Overlap, SequenceHash};
use std::borrow::Cow;

impl RequestPath {
    // The load snapshot rides along from the decision to the booking (one get, one decode).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn steer(
        &mut self,
        host: &mut impl Host,
        vm: &mut RoutingState,
        config: &Config,
        decision: &Decision,
        now: u64,
        request: &LlmRequest,
        note: Option<&str>,
        load: load_store::Snapshot,
    ) {
        let Some(slot) = config.slots.get(usize::from(decision.slot)) else {
            self.fallback(host, vm, config, Fallback::NoDecision);
            return;
        };
        let Some(worker) = config.workers.get(usize::from(slot.worker)) else {
            self.fallback(host, vm, config, Fallback::NoDecision);
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
            Some(note) => Cow::Owned(format!("{}:{note}", decision.reason.as_str())),
            None => Cow::Borrowed(decision.reason.as_str()),
        };
        self.set_destination(host, config, &destination);
        host.set_request_header(REASON_HEADER, Some(&reason));
        if worker.dp_size > 1 {
            host.set_request_header(HEADER_DP_RANK, Some(&slot.dp_rank.to_string()));
        }

        let key = vm.new_request_key();
        // The request's prefill is booked as work (its attention over the cached prefix and
        // its own length included), so that a long prompt weighs on the worker's queue, and
        // decays, for as long as its engine computes it.
        let poly = worker.prefill_poly(&config.load.prefill_time_ms_poly);
        let new_tokens = f64::from(decision.prefill_tokens);
        let cached_tokens = f64::from(decision.isl_tokens.saturating_sub(decision.prefill_tokens));
        // (The seed's Dynamo cost prices tokens: under it, tokens are booked.)
        let work = match config.policy {
            KvPolicy::Dynamo => new_tokens,
            _ => prefill_work_tokens(poly, new_tokens, cached_tokens),
        };
        let booked_work = work.round().min(f64::from(u32::MAX)) as u32;
        // Its duration on the worker's engine, in the worker's steps, else the `ttft` policy's
        // (the same steps its score prices). Computed once, only when the decay or the
        // priority needs it.
        let decays = config.load.prefill_load_model == PrefillLoadModel::Polynomial;
        let prefill_ms = (decays || config.engine_priority.is_some()).then(|| {
            prefill_duration_ms(
                poly,
                new_tokens,
                cached_tokens,
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
        settle_priority(host, config, priority, client);
        let booked = load_store::update_slot_from(
            host.store(),
            config.slots.len(),
            decision.slot,
            now,
            Some(load),
            |table| {
                table.admit(
                    key,
                    decision.slot,
                    booked_work,
                    decision.prompt_blocks,
                    expected_ms,
                    now,
                )
            },
        );
        if let Ok(ticket) = booked {
            // Only a placement from scratch: one on a worker holding the prompt's prefix follows
            // the request's own history, which the other replicas' requests do not share.
            // (An Envoy that hears of no other router never reads them: not recorded.)
            let from_scratch = decision.prefill_tokens >= decision.isl_tokens;
            let others = vm.traffic_share.relayed_ratio() > 0.0;
            if config.load.unseen_traffic == UnseenTraffic::Relayed && from_scratch && others {
                let half_life = recent::half_life_ms(config.tick_ms);
                vm.recent_bookings.record(
                    config.slots.len(),
                    decision.slot,
                    f64::from(booked_work),
                    f64::from(decision.prompt_blocks),
                    now,
                    half_life,
                );
            }
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
                    prediction: decision.prediction,
                },
                first_token_ms: 0,
                chunks: 0,
            });
        } else {
            host.count("load.update_failed", 1);
        }

        // Every request's counters: kept in the VM until the tick (see `Host::count_later`).
        host.count_later(counters::routed(decision.reason), 1);
        let overlap_blocks = decision.overlap.device_blocks;
        host.count_later("overlap_blocks", u64::from(overlap_blocks));
        host.histogram("overlap_blocks_per_request", u64::from(overlap_blocks));
        let detail = config.response_headers.then(|| OutcomeDetail {
            worker: worker.id.to_string(),
            overlap_blocks,
            max_overlap_blocks: max_overlap_blocks(vm),
            costs: costs_text(config, decision),
            loads: loads_text(config, vm),
        });
        self.outcome = Some(Outcome { reason, detail });
    }

    /// The safe route when the filter cannot decide: the next worker in turn, with the reason.
    pub(super) fn fallback(
        &mut self,
        host: &mut impl Host,
        vm: &mut RoutingState,
        config: &Config,
        why: Fallback,
    ) {
        // Routable workers only (all of them without membership), without collecting them.
        let count = config.workers.iter().filter(|w| w.routable).count().max(1);
        let pick = usize::try_from(vm.new_request_key() % count as u64).unwrap_or(0);
        let reason = why.reason();
        if let Some(worker) = config.workers.iter().filter(|w| w.routable).nth(pick) {
            self.set_destination(host, config, &worker.address_text);
            self.outcome = Some(Outcome {
                reason: Cow::Borrowed(reason),
                detail: config.response_headers.then(|| OutcomeDetail {
                    worker: worker.id.to_string(),
                    overlap_blocks: 0,
                    max_overlap_blocks: 0,
                    costs: None,
                    loads: None,
                }),
            });
        }
        host.set_request_header(REASON_HEADER, Some(reason));
        host.count(why.counter(), 1);
        let priority = config
            .engine_priority
            .as_ref()
            .map(|e| request_priority(e, UNPRICED_PREFILL_MS, host.now_ms()));
        // The client's priority is looked for in the body, unless it is not all here.
        let client = if why.body_unread() {
            ClientPriority::Unreadable
        } else {
            ClientPriority::Unparsed
        };
        settle_priority(host, config, priority, client);
    }
}

/// Every candidate's cost, `worker/rank=cost` (`response_headers` only).
fn costs_text(config: &Config, decision: &Decision) -> Option<String> {
    (!decision.scores.is_empty()).then(|| {
        decision
            .scores
            .iter()
            .filter_map(|(slot, cost)| {
                let s = config.slots.get(usize::from(*slot))?;
                Some(format!(
                    "{}/{}={:.3}",
                    worker_id(config, usize::from(s.worker)),
                    s.dp_rank,
                    cost
                ))
            })
            .collect::<Vec<_>>()
            .join(",")
    })
}

/// Every slot's inputs as the decision saw them (`response_headers` only).
fn loads_text(config: &Config, vm: &RoutingState) -> Option<String> {
    (!vm.load_view.is_empty()).then(|| {
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
                    worker_id(config, usize::from(s.worker)),
                    s.dp_rank,
                    l.prefill_tokens,
                    l.active_requests,
                    o
                )
            })
            .collect::<Vec<_>>()
            .join(",")
    })
}

/// The longest device overlap of a fresh slot in this VM's index.
fn max_overlap_blocks(vm: &RoutingState) -> u32 {
    vm.overlaps
        .iter()
        .enumerate()
        .filter(|(i, _)| !vm.slot_reports.stale.get(*i).copied().unwrap_or(false))
        .map(|(_, o)| o.device_blocks)
        .max()
        .unwrap_or(0)
}

/// Raises each slot's device overlap to its predicted run: every slot for text hashes (only
/// predictions know them), only `kv_mode` approximate slots for token hashes.
pub(super) fn merge_predictions(
    vm: &RoutingState,
    config: &Config,
    hashes: &[SequenceHash],
    from_text: bool,
    now: u64,
    overlaps: &mut Vec<Overlap>,
) {
    let Some(store) = vm.predicted.as_ref() else {
        return;
    };
    let slots = config.slots.len();
    let predicted = store.overlaps(hashes, slots, now);
    overlaps.resize(slots, Overlap::default());
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
pub(super) fn record_prediction(
    host: &mut impl Host,
    vm: &mut RoutingState,
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
    if crate::approx::publish(host.store(), &record) {
        host.count("approx.published", 1);
    } else {
        host.count("approx.publish_failed", 1);
    }
    vm.sync_predictions(host, now);
}
