//! The response: reported headers, a retry's host, the first token (end of prefill, timing
//! sample), generated output, and the release of exactly what the request booked.

use super::context::{Action, RequestPath};
use super::host::Host;
use super::state::RoutingState;
use super::REASON_HEADER;
use crate::load::output_milli_blocks;
use crate::load_store::{self, Release};
use crate::store::SharedStore;

impl RequestPath {
    pub fn on_response_headers(
        &mut self,
        host: &mut impl Host,
        vm: &mut RoutingState,
        end_of_stream: bool,
    ) -> Action {
        // Where Envoy sent the request matters while the booking lasts: through a stream, or for
        // the reported worker. A whole response is released as soon as it ends (below), from
        // the slot it was booked on, so its upstream address is not read.
        let moves = self.booking.as_ref().is_some_and(|b| b.stream) || vm.config.response_headers;
        if moves {
            self.follow_retry(host, vm);
        }
        if let Some(outcome) = &self.outcome {
            host.set_response_header(REASON_HEADER, &outcome.reason);
            if let Some(detail) = &outcome.detail {
                host.set_response_header("x-kv-router-worker", &detail.worker);
                host.set_response_header(
                    "x-kv-router-overlap-blocks",
                    &detail.overlap_blocks.to_string(),
                );
                host.set_response_header(
                    "x-kv-router-max-overlap-blocks",
                    &detail.max_overlap_blocks.to_string(),
                );
                if let Some(costs) = &detail.costs {
                    host.set_response_header("x-kv-router-costs", costs);
                }
                if let Some(loads) = &detail.loads {
                    host.set_response_header("x-kv-router-loads", loads);
                }
            }
        }
        // A response without a body ends here. Otherwise the first body bytes end the prefill
        // (for a whole, non-streamed response they usually come with its end: then one update
        // releases the request, prefill included).
        if end_of_stream {
            self.release_booking(host, vm);
        }
        Action::Continue
    }

    pub fn on_response_body(
        &mut self,
        host: &mut impl Host,
        vm: &mut RoutingState,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        if self.booking.is_none() {
            return Action::Continue;
        }
        // The worker is done with the request when its response ends: released now, in one
        // load-table update (first token and release at once), not at `on_log`, which may come
        // later (a slow client draining Envoy's buffer).
        if end_of_stream {
            self.release_booking(host, vm);
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
        self.first_token(host, vm);
        if vm.config.load.track_output_blocks && self.booking.as_ref().is_some_and(|b| b.stream) {
            if let Some(chunk) = host.response_body(body_size) {
                self.track_output(host, vm, &chunk);
            }
        }
        Action::Continue
    }

    /// Whatever ended the stream (reset, timeout, local reply), its booking goes.
    pub fn on_log(&mut self, host: &mut impl Host, vm: &mut RoutingState) {
        self.release_booking(host, vm);
    }

    /// Releases exactly what the request booked (once: the booking is taken).
    fn release_booking(&mut self, host: &mut impl Host, vm: &mut RoutingState) {
        let Some(booking) = self.booking.take() else {
            return;
        };
        let now = host.now_ms();
        vm.learn_lifetime(booking.sample.routed_ms, now);
        if booking.stream {
            vm.record_itl(
                host,
                booking.sample.worker_index,
                booking.first_token_ms,
                booking.chunks,
                now,
            );
        }
        let slots = vm.config.slots.len();
        match vm
            .releases
            .release(host.store(), slots, booking.ticket, now)
        {
            Release::Released => {}
            Release::Unknown => host.count("load.release_unknown", 1),
            Release::Deferred => host.count("load.release_deferred", 1),
        }
    }

    /// The request is booked while the VM state cannot be borrowed (never expected: no other
    /// callback runs inside `on_log`): released without the deferral queue.
    pub fn release_without_state(&mut self, store: &impl SharedStore, slots: usize, now: u64) {
        let Some(booking) = self.booking.take() else {
            return;
        };
        let ticket = booking.ticket;
        let _ = load_store::update_slot(store, slots, ticket.slot, now, |t| {
            t.release_at(&ticket, now).then_some(())
        });
    }

    /// Envoy may have retried the request on a fallback host: move the booking (and the reported
    /// worker) to the host that actually answered.
    fn follow_retry(&mut self, host: &mut impl Host, vm: &RoutingState) {
        let config = &vm.config;
        let Some(booking) = self.booking.as_mut() else {
            return;
        };
        let Some(upstream) = host.upstream_address() else {
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
        let now = host.now_ms();
        if let Ok(moved) =
            load_store::move_booking(host.store(), config.slots.len(), ticket, slot, now)
        {
            booking.ticket = moved;
            booking.address = upstream;
            // The prediction was for the first host: nothing to learn from this response.
            booking.sample.worker_index = index;
            booking.sample.prediction = None;
            if let Some(detail) = self.outcome.as_mut().and_then(|o| o.detail.as_mut()) {
                detail.worker = worker.id.to_string();
            }
            host.count("load.moved_on_retry", 1);
        }
    }

    fn first_token(&mut self, host: &mut impl Host, vm: &mut RoutingState) {
        let Some(booking) = self.booking.as_mut() else {
            return;
        };
        if booking.first_token_seen {
            return;
        }
        booking.first_token_seen = true;
        let ticket = booking.ticket;
        let slots = vm.config.slots.len();
        let now = host.now_ms();
        if let Ok(done) = load_store::update_slot(host.store(), slots, ticket.slot, now, |table| {
            table.first_token(&ticket, now)
        }) {
            booking.ticket = done;
        }
        booking.first_token_ms = now;
        let sample = booking.sample;
        vm.learn_first_token(host, &sample, now);
    }

    /// Counts generated tokens from SSE chunks and books output blocks as they cross boundaries.
    fn track_output(&mut self, host: &mut impl Host, vm: &RoutingState, chunk: &[u8]) {
        let config = &vm.config;
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
        let now = host.now_ms();
        if let Ok(updated) = load_store::update_slot(
            host.store(),
            config.slots.len(),
            ticket.slot,
            now,
            |table| table.set_output_milli_blocks(&ticket, milli, now),
        ) {
            booking.ticket = updated;
        }
    }
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
