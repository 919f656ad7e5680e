//! One task per engine endpoint: the live ZMQ SUB stream, sequence tracking, replay.
//!
//! The rule is "never silently wrong": the mirror holds a block only if the events seen say the
//! engine holds it. So
//! * a gap in sequence numbers is filled from the replay socket, or the endpoint's ranks are
//!   cleared (an `AllBlocksCleared` per rank on the page) and rebuilt from what follows;
//! * every replay starts at the last batch already applied and checks that batch's digest: a
//!   different payload (or none) means the engine restarted, so its ranks are cleared and
//!   rebuilt from its whole replay buffer. This catches restarts that sequence numbers alone
//!   cannot (a new engine whose counter already passed ours);
//! * the zeromq crate does not report a publisher that went away (the SUB socket just stays
//!   silent), so a stream silent for `idle_probe` is probed: a subscription message is written
//!   to the publisher, which fails on a closed connection. Only then is the socket replaced, and
//!   the reconnection verifies the anchor as above. (Replacing a live SUB socket instead would
//!   leak its connection: the zeromq crate keeps a socket whose receive was pending alive.)

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeSet, HashMap};
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use log::{debug, error, info, warn};
use tokio::sync::watch;
use zeromq::{Socket, SocketRecv, SubSocket, ZmqMessage};

use crate::core::Refusal;
use crate::mirror::DpRank;
use crate::replay::{Replay, ReplayError};
use crate::state::Shared;
use kv_router_protocol::vllm::{decode_batch, split_frames, EngineEvent};

/// One engine endpoint from the command line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineSpec {
    pub index: usize,
    pub endpoint: String,
    pub replay: Option<String>,
    pub topic: String,
    /// Rank for every batch of this endpoint; `None`: the batch's own, else the position.
    pub dp_rank: Option<DpRank>,
}

/// Timeouts and bounds of the engine tasks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineTiming {
    pub connect_timeout: Duration,
    pub idle_probe: Duration,
    pub replay_timeout: Duration,
    pub replay_max_batches: usize,
    pub max_payload_bytes: usize,
    pub reconnect_backoff_max: Duration,
}

/// What a live sequence number means given what was applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Observed {
    /// The next batch.
    Apply,
    /// Already applied through a replay.
    Duplicate,
    /// Batches `expected..seq` were missed.
    Gap { expected: u64 },
    /// The sequence went back: the engine restarted (or the stream is not the one we know).
    Back { expected: u64 },
    /// Nothing applied yet and the stream does not start at 0.
    Unanchored,
}

/// Sequence state of one endpoint (pure; unit-tested).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SeqTracker {
    /// The next sequence number expected; `None` before the first batch (or after a reset).
    pub next: Option<u64>,
    /// Digest of batch `next - 1`, to recognise the same engine after a reconnection.
    pub anchor_digest: Option<u64>,
    /// Live batches up to this one were already applied by a replay.
    pub skip_through: Option<u64>,
}

impl SeqTracker {
    /// `payload_digest`: the batch's [`digest`]. The last applied batch (the anchor) seen again
    /// with another payload is a new incarnation, not a duplicate: an engine restarted after a
    /// replay (an idle stream's reconnection replays too) numbers its batches from 0 again.
    pub fn observe(&self, seq: u64, payload_digest: u64) -> Observed {
        match self.next {
            None if seq == 0 => Observed::Apply,
            None => Observed::Unanchored,
            Some(n) if seq == n => Observed::Apply,
            Some(n) if seq > n => Observed::Gap { expected: n },
            Some(n) => {
                let other_anchor = self
                    .anchor()
                    .is_some_and(|(at, d)| at == seq && d != payload_digest);
                if self.skip_through.is_some_and(|s| seq <= s) && !other_anchor {
                    Observed::Duplicate
                } else {
                    Observed::Back { expected: n }
                }
            }
        }
    }

    pub fn applied(&mut self, seq: u64, digest: u64) {
        self.next = Some(seq.saturating_add(1));
        self.anchor_digest = Some(digest);
        if self.skip_through.is_some_and(|s| seq > s) {
            self.skip_through = None;
        }
    }

    /// After a replay: live batches up to the last one applied are duplicates.
    pub fn replayed(&mut self) {
        self.skip_through = self.next.and_then(|n| n.checked_sub(1));
    }

    pub fn reset(&mut self) {
        *self = SeqTracker::default();
    }

    /// The last applied batch and its digest.
    pub fn anchor(&self) -> Option<(u64, u64)> {
        let seq = self.next?.checked_sub(1)?;
        Some((seq, self.anchor_digest?))
    }
}

/// Digest of a payload (the same bytes arrive live and from the replay buffer).
pub fn digest(payload: &[u8]) -> u64 {
    let mut h = DefaultHasher::new();
    payload.hash(&mut h);
    h.finish()
}

/// Logs a repeated condition at most once per interval, with the count it swallowed.
#[derive(Debug, Default)]
struct LogGate {
    last: HashMap<&'static str, (Instant, u64)>,
}

impl LogGate {
    const INTERVAL: Duration = Duration::from_secs(10);

    /// `Some(suppressed since the last log)` when this occurrence should be logged.
    fn allow(&mut self, key: &'static str) -> Option<u64> {
        let now = Instant::now();
        match self.last.get_mut(key) {
            Some((at, suppressed)) if now.duration_since(*at) < Self::INTERVAL => {
                *suppressed += 1;
                None
            }
            Some((at, suppressed)) => {
                let n = *suppressed;
                *at = now;
                *suppressed = 0;
                Some(n)
            }
            None => {
                self.last.insert(key, (now, 0));
                Some(0)
            }
        }
    }
}

struct EngineTask {
    shared: Arc<Shared>,
    spec: EngineSpec,
    timing: EngineTiming,
    tracker: SeqTracker,
    ranks: BTreeSet<DpRank>,
    label: String,
    gate: LogGate,
    shutdown: watch::Receiver<bool>,
}

/// Runs one endpoint until shutdown.
pub async fn run(shared: Arc<Shared>, spec: EngineSpec, timing: EngineTiming) {
    let shutdown = shared.shutdown_watch();
    let mut task = EngineTask {
        label: spec.index.to_string(),
        ranks: spec.dp_rank.into_iter().collect(),
        shared,
        spec,
        timing,
        tracker: SeqTracker::default(),
        gate: LogGate::default(),
        shutdown,
    };
    task.run().await;
}

impl EngineTask {
    async fn run(&mut self) {
        let mut backoff = Duration::from_millis(100);
        while !self.shutting_down() {
            self.status(|s| {
                s.state = "connecting";
                s.connected = false;
            });
            let sub = match self.connect().await {
                Ok(sub) => sub,
                Err(e) => {
                    self.status(|s| s.last_error = Some(e.clone()));
                    if self.gate.allow("connect").is_some() {
                        warn!(
                            "engine {}: cannot subscribe to {}: {e}",
                            self.label, self.spec.endpoint
                        );
                    }
                    self.sleep(backoff).await;
                    backoff = (backoff * 2).min(self.timing.reconnect_backoff_max);
                    continue;
                }
            };
            backoff = Duration::from_millis(100);
            self.status(|s| {
                s.state = "connected";
                s.connected = true;
                s.last_error = None;
            });
            debug!(
                "engine {}: subscribed to {}",
                self.label, self.spec.endpoint
            );
            if self.spec.replay.is_some() {
                // Catch up with what was published while we were away (or before we started),
                // and check that this is still the engine we knew.
                if let Err(e) = self.catch_up("connect").await {
                    self.replay_failed("connect", &e);
                }
            }
            self.read(sub).await;
            self.shared
                .metrics
                .inc("kv_bridge_resubscribes_total", &[("engine", &self.label)]);
        }
    }

    fn shutting_down(&self) -> bool {
        *self.shutdown.borrow()
    }

    async fn sleep(&mut self, d: Duration) {
        let mut shutdown = self.shutdown.clone();
        tokio::select! {
            _ = tokio::time::sleep(d) => {}
            _ = shutdown.wait_for(|&s| s) => {}
        }
    }

    fn status(&self, f: impl FnOnce(&mut crate::state::EngineStatus)) {
        self.shared.update_engine(self.spec.index, f);
    }

    async fn connect(&self) -> Result<SubSocket, String> {
        let mut sub = SubSocket::new();
        sub.subscribe(&self.spec.topic)
            .await
            .map_err(|e| e.to_string())?;
        match tokio::time::timeout(
            self.timing.connect_timeout,
            sub.connect(&self.spec.endpoint),
        )
        .await
        {
            Ok(Ok(())) => Ok(sub),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err("connect timed out".to_owned()),
        }
    }

    /// Reads the live stream until it is idle too long, fails, or shutdown.
    async fn read(&mut self, mut sub: SubSocket) {
        let mut shutdown = self.shutdown.clone();
        loop {
            let received = tokio::select! {
                r = tokio::time::timeout(self.timing.idle_probe, sub.recv()) => r,
                _ = shutdown.wait_for(|&s| s) => return,
            };
            match received {
                Err(_) => {
                    if self.probe(&mut sub).await {
                        continue;
                    }
                    warn!(
                        "engine {}: the publisher at {} went away; reconnecting",
                        self.label, self.spec.endpoint
                    );
                    return;
                }
                Ok(Err(e)) => {
                    warn!(
                        "engine {}: live stream failed: {e}; resubscribing",
                        self.label
                    );
                    self.status(|s| s.last_error = Some(e.to_string()));
                    return;
                }
                Ok(Ok(message)) => self.on_live(message).await,
            }
        }
    }

    /// Whether the live connection still stands: writes a subscription to a topic nothing
    /// uses, and withdraws it. A closed connection fails the write (at the latest on the
    /// second probe, once the peer's reset arrived).
    async fn probe(&mut self, sub: &mut SubSocket) -> bool {
        const PROBE_TOPIC: &str = "\u{1}kv-event-bridge-liveness";
        let limit = Duration::from_secs(1);
        let alive = matches!(
            tokio::time::timeout(limit, sub.subscribe(PROBE_TOPIC)).await,
            Ok(Ok(()))
        ) && matches!(
            tokio::time::timeout(limit, sub.unsubscribe(PROBE_TOPIC)).await,
            Ok(Ok(()))
        );
        let result = if alive { "alive" } else { "dead" };
        self.shared.metrics.inc(
            "kv_bridge_idle_probes_total",
            &[("engine", &self.label), ("result", result)],
        );
        alive
    }

    async fn on_live(&mut self, message: ZmqMessage) {
        let frames = message.into_vec();
        let refs: Vec<&[u8]> = frames.iter().map(|b| b.as_ref()).collect();
        let parts = match split_frames(&refs) {
            Ok(p) => p,
            Err(e) => {
                self.bad_frame(e.label(), &e.to_string());
                return;
            }
        };
        if !self.spec.topic.is_empty() && parts.topic != self.spec.topic.as_bytes() {
            self.bad_frame(
                "topic",
                &format!("topic {:?}", String::from_utf8_lossy(parts.topic)),
            );
            return;
        }
        let seq = parts.seq;
        let payload = parts.payload;
        match self.tracker.observe(seq, digest(payload)) {
            Observed::Apply => self.apply(seq, payload),
            Observed::Duplicate => {
                self.shared
                    .metrics
                    .inc("kv_bridge_seq_duplicates_total", &[("engine", &self.label)]);
            }
            Observed::Gap { expected } => {
                self.shared
                    .metrics
                    .inc("kv_bridge_seq_gaps_total", &[("engine", &self.label)]);
                warn!(
                    "engine {}: sequence gap: expected {expected}, got {seq}",
                    self.label
                );
                self.recover("gap", seq, payload).await;
            }
            Observed::Back { expected } => {
                warn!(
                    "engine {}: sequence went back from {expected} to {seq}: engine restarted?",
                    self.label
                );
                self.recover("seq_back", seq, payload).await;
            }
            Observed::Unanchored => self.recover("late_join", seq, payload).await,
        }
    }

    /// Recovers from a gap, a restart or a late join, then handles the live batch `seq`.
    async fn recover(&mut self, cause: &'static str, seq: u64, payload: &[u8]) {
        if self.spec.replay.is_some() {
            match self.catch_up(cause).await {
                Ok(()) => match self.tracker.observe(seq, digest(payload)) {
                    Observed::Apply => return self.apply(seq, payload),
                    Observed::Duplicate => return,
                    _ => {}
                },
                Err(e) => self.replay_failed(cause, &e),
            }
        }
        // Unrecoverable: start over from this batch, knowing the history is partial.
        if self.tracker.next.is_some() {
            self.reset(if cause == "seq_back" {
                "seq_back"
            } else {
                "gap_unrecoverable"
            });
        }
        let partial = seq != 0;
        self.status(|s| s.partial_history = partial);
        if partial && self.gate.allow("partial").is_some() {
            warn!(
                "engine {}: continuing from seq {seq} without the batches before it; blocks \
                 stored earlier are unknown until the engine stores them again",
                self.label
            );
        }
        self.apply(seq, payload);
    }

    fn replay_failed(&mut self, cause: &'static str, e: &ReplayError) {
        if matches!(e, ReplayError::Cancelled) {
            return;
        }
        self.shared.metrics.inc(
            "kv_bridge_replays_total",
            &[("engine", &self.label), ("result", "failed")],
        );
        self.status(|s| s.last_error = Some(format!("replay ({cause}): {e}")));
        if self.gate.allow("replay").is_some() {
            warn!("engine {}: replay after {cause} failed: {e}", self.label);
        }
    }

    /// Replays from the anchor (the last applied batch), verifying it; on a mismatch (restart)
    /// clears this endpoint's ranks and rebuilds from the engine's whole replay buffer.
    async fn catch_up(&mut self, cause: &'static str) -> Result<(), ReplayError> {
        self.status(|s| s.state = "catching_up");
        let result = self.catch_up_inner(cause).await;
        self.tracker.replayed();
        self.status(|s| s.state = "connected");
        result
    }

    async fn catch_up_inner(&mut self, cause: &'static str) -> Result<(), ReplayError> {
        let Some(endpoint) = self.spec.replay.clone() else {
            return Ok(());
        };
        let start = self.tracker.anchor().map_or(0, |(seq, _)| seq);
        let mut replay = Replay::start(
            &endpoint,
            start,
            self.timing.replay_timeout,
            self.timing.replay_max_batches,
        )
        .await?;
        let mut first = true;
        while let Some((seq, payload)) = self.next_replayed(&mut replay).await? {
            if first {
                first = false;
                if let Some((anchor_seq, anchor_digest)) = self.tracker.anchor() {
                    if seq == anchor_seq && digest(&payload) == anchor_digest {
                        continue; // the same engine: apply what follows
                    }
                    // Another history under the same address: the engine restarted.
                    return self.rebuild(&endpoint, "restart").await;
                }
            }
            self.apply_replayed(seq, &payload);
        }
        if first {
            if self.tracker.anchor().is_some() {
                // The engine no longer has our anchor (nothing at or after it): it restarted.
                return self.rebuild(&endpoint, "restart").await;
            }
            debug!(
                "engine {}: replay after {cause}: nothing buffered",
                self.label
            );
        }
        self.replay_ok(cause);
        Ok(())
    }

    /// Clears this endpoint's ranks and applies the engine's whole replay buffer.
    async fn rebuild(&mut self, endpoint: &str, cause: &'static str) -> Result<(), ReplayError> {
        warn!(
            "engine {}: the engine's history changed ({cause}); clearing its blocks and rebuilding from its replay buffer",
            self.label
        );
        self.reset(cause);
        let mut replay = Replay::start(
            endpoint,
            0,
            self.timing.replay_timeout,
            self.timing.replay_max_batches,
        )
        .await?;
        while let Some((seq, payload)) = self.next_replayed(&mut replay).await? {
            self.apply_replayed(seq, &payload);
        }
        self.replay_ok(cause);
        Ok(())
    }

    fn replay_ok(&self, cause: &'static str) {
        self.shared.metrics.inc(
            "kv_bridge_replays_total",
            &[("engine", &self.label), ("result", "ok")],
        );
        debug!(
            "engine {}: replay after {cause} done, next seq {:?}",
            self.label, self.tracker.next
        );
    }

    async fn next_replayed(
        &mut self,
        replay: &mut Replay,
    ) -> Result<Option<(u64, Bytes)>, ReplayError> {
        let mut shutdown = self.shutdown.clone();
        tokio::select! {
            r = replay.next() => r,
            // Not the end of the replay: nothing may be concluded from a cut-off reply.
            _ = shutdown.wait_for(|&s| s) => Err(ReplayError::Cancelled),
        }
    }

    /// Applies a replayed batch in order; skips what is already applied.
    fn apply_replayed(&mut self, seq: u64, payload: &[u8]) {
        match self.tracker.next {
            Some(n) if seq < n => return,
            Some(n) if seq > n => {
                // A hole inside the replay buffer (should not happen): start over from here.
                self.reset("gap_unrecoverable");
                self.status(|s| s.partial_history = true);
            }
            None if seq > 0 => {
                self.status(|s| s.partial_history = true);
                if self.gate.allow("late").is_some() {
                    warn!(
                        "engine {}: its replay buffer starts at seq {seq}, not 0: blocks stored \
                         before it are unknown until stored again",
                        self.label
                    );
                }
            }
            _ => {}
        }
        if seq == 0 {
            self.status(|s| s.partial_history = false);
        }
        self.shared.metrics.inc(
            "kv_bridge_replayed_batches_total",
            &[("engine", &self.label)],
        );
        self.apply(seq, payload);
    }

    /// Clears every rank this endpoint fed (the page gets an `AllBlocksCleared` per rank).
    fn reset(&mut self, cause: &'static str) {
        let ranks: Vec<DpRank> = self.ranks.iter().copied().collect();
        let outcome = self.shared.with_core(|core| {
            let mut total = crate::core::ApplyOutcome::default();
            for rank in &ranks {
                let out = core.clear_rank(*rank);
                for (t, o) in total.forwarded.iter_mut().zip(out.forwarded) {
                    *t += o;
                }
            }
            total
        });
        self.shared.record(&outcome);
        self.shared.metrics.inc(
            "kv_bridge_resets_total",
            &[("engine", &self.label), ("cause", cause)],
        );
        self.tracker.reset();
        self.status(|s| {
            s.resets += 1;
            s.last_seq = None;
        });
        info!("engine {}: cleared ranks {ranks:?} ({cause})", self.label);
    }

    fn bad_frame(&mut self, reason: &'static str, detail: &str) {
        self.shared.metrics.inc(
            "kv_bridge_bad_frames_total",
            &[("engine", &self.label), ("reason", reason)],
        );
        if let Some(suppressed) = self.gate.allow(reason) {
            warn!(
                "engine {}: bad frame ({reason}): {detail} [{suppressed} similar suppressed]",
                self.label
            );
        }
    }

    /// Decodes and applies one batch, then advances the sequence.
    fn apply(&mut self, seq: u64, payload: &[u8]) {
        let digest = digest(payload);
        let batch = match decode_batch(payload, self.timing.max_payload_bytes) {
            Ok(batch) => batch,
            Err(e) => {
                self.bad_frame(e.label(), &e.to_string());
                // Whatever the batch said is lost: the mirror cannot be trusted any more.
                self.reset("bad_batch");
                self.status(|s| s.partial_history = true);
                self.tracker.applied(seq, digest);
                return;
            }
        };
        for skipped in &batch.skipped {
            self.bad_frame(skipped.label(), &skipped.to_string());
        }
        let metrics = &self.shared.metrics;
        metrics.inc("kv_bridge_batches_total", &[("engine", &self.label)]);
        for event in &batch.events {
            let kind = match event {
                EngineEvent::Stored(_) => "BlockStored",
                EngineEvent::Removed { .. } => "BlockRemoved",
                EngineEvent::AllCleared => "AllBlocksCleared",
            };
            metrics.inc("kv_bridge_engine_events_total", &[("type", kind)]);
        }
        let rank = self
            .spec
            .dp_rank
            .or(batch.dp_rank)
            .unwrap_or(u32::try_from(self.spec.index).unwrap_or(u32::MAX));
        let index = self.spec.index;
        let outcome = self
            .shared
            .with_core(|core| core.apply(index, rank, &batch.events));
        self.shared.record(&outcome);
        let rank_refused = outcome.refused.iter().any(|r| {
            matches!(
                r,
                Refusal::RankConflict { .. } | Refusal::TooManyRanks { .. }
            )
        });
        if !rank_refused {
            // The ranks this endpoint fed: a reset clears exactly these.
            self.ranks.insert(rank);
        }
        for refusal in &outcome.refused {
            self.log_refusal(refusal);
        }
        self.tracker.applied(seq, digest);
        let ranks: Vec<DpRank> = self.ranks.iter().copied().collect();
        self.status(|s| {
            s.last_seq = Some(seq);
            s.batches += 1;
            s.last_batch_at = Some(Instant::now());
            s.dp_ranks = ranks;
        });
    }

    fn log_refusal(&mut self, refusal: &Refusal) {
        let Some(suppressed) = self.gate.allow(refusal.label()) else {
            return;
        };
        match refusal {
            Refusal::BlockSizeMismatch { .. }
            | Refusal::MirrorFull { .. }
            | Refusal::RankConflict { .. }
            | Refusal::TooManyRanks { .. } => {
                error!(
                    "engine {}: event refused: {refusal} [{suppressed} similar suppressed]",
                    self.label
                )
            }
            _ => warn!(
                "engine {}: event refused: {refusal} [{suppressed} similar suppressed]",
                self.label
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tracker_classifies_sequences() {
        let mut t = SeqTracker::default();
        assert_eq!(t.observe(0, 11), Observed::Apply);
        assert_eq!(t.observe(5, 99), Observed::Unanchored);
        t.applied(0, 11);
        assert_eq!(t.anchor(), Some((0, 11)));
        assert_eq!(t.observe(1, 12), Observed::Apply);
        assert_eq!(t.observe(3, 14), Observed::Gap { expected: 1 });
        assert_eq!(t.observe(0, 11), Observed::Back { expected: 1 });
        t.applied(1, 12);
        t.applied(2, 13);
        // A replay brought us to 2: live 1 and 2 still queued on the SUB socket are duplicates.
        t.replayed();
        assert_eq!(t.observe(1, 12), Observed::Duplicate);
        assert_eq!(t.observe(2, 13), Observed::Duplicate);
        // Batch 2 again with another payload: the engine restarted and reached 2 anew.
        assert_eq!(t.observe(2, 99), Observed::Back { expected: 3 });
        assert_eq!(t.observe(3, 14), Observed::Apply);
        t.applied(3, 14);
        // Past the replayed range, going back is a restart again.
        assert_eq!(t.observe(1, 12), Observed::Back { expected: 4 });
        t.reset();
        assert_eq!((t.next, t.anchor()), (None, None));
    }

    #[test]
    fn log_gate_suppresses_repeats() {
        let mut g = LogGate::default();
        assert_eq!(g.allow("a"), Some(0));
        assert_eq!(g.allow("a"), None);
        assert_eq!(g.allow("b"), Some(0));
    }
}
