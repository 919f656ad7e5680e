//! The load table's request path without decoding every slot: at 1,000 slots a whole decode and
//! encode costs far more than the decision itself, and each request touches one slot.
//!
//! The stored table (version 3) keeps every slot's fixed-size summary (generation, anchor time,
//! queue length, bucket mask and the sum of its buckets) ahead of the slots' variable details
//! (prefill queue, and the buckets when there are two or more):
//!
//! * [`view_bytes`]: the per-slot view straight from the stored bytes (no table built): a loop
//!   over the summaries, reading a slot's details only for its anchor when it queues prefills,
//!   or for its buckets when some ring position is due to be reaped (then not every bucket
//!   counts).
//! * [`Window`]: one slot decoded (its details found from the summaries' lengths, or from the
//!   offsets a view recorded); the edit runs on it as on a whole table, and
//!   [`Window::encode_into`] rewrites its summary in place and splices its new details between
//!   the untouched ones. It is only used when no time bucket is due to be reaped at the edit's
//!   time (reaping touches every slot; then the whole table is decoded, at most once per bucket
//!   width).

use super::{
    details_len, read_slot, write_details, write_summary, Counters, LoadDecodeError, LoadTable,
    Queued, Reader, SlotLoad, BUCKETS, COUNTERS_LEN, HEADER_LEN, PREFILL_QUEUE, QUEUED_LEN,
    SLOT_FIXED_LEN, TOTALS_AT,
};
use crate::types::SlotIdx;

/// [`LoadTable::decode`] followed by [`LoadTable::view_into`], without building the table.
/// Empty bytes (never written) view as idle slots. On an error `out` is left empty.
pub fn view_bytes(
    bytes: &[u8],
    num_slots: usize,
    now_ms: u64,
    out: &mut Vec<SlotLoad>,
) -> Result<(), LoadDecodeError> {
    out.clear();
    view_bytes_at(bytes, num_slots, now_ms, out, None).map(|_| ())
}

/// [`view_bytes`] appending to `out` (a shard's slots after the shards before it), that also
/// records where each slot's details start in `bytes` (`num_slots + 1` offsets, the last one the
/// end), for [`Window::decode_at`]. On an error `out` is as it was and the offsets are empty.
///
/// Returns until when (exclusive) the view of these bytes stays what it is now: the next time
/// a live bucket dies, or `now_ms` when a slot queues a decaying prefill (it moves every ms).
pub fn view_bytes_at(
    bytes: &[u8],
    num_slots: usize,
    now_ms: u64,
    out: &mut Vec<SlotLoad>,
    mut offsets: Option<&mut Vec<usize>>,
) -> Result<u64, LoadDecodeError> {
    let before = out.len();
    if let Some(o) = offsets.as_deref_mut() {
        o.clear();
    }
    if bytes.is_empty() {
        out.resize(before + num_slots, SlotLoad::default());
        return Ok(u64::MAX);
    }
    let (table, _) = LoadTable::decode_header(bytes, num_slots)?;
    let now_epoch = table.epoch_of(now_ms);
    let live = table.ring.map(|e| LoadTable::alive(e, now_epoch));
    // No epoch due for reaping: every bucket counts (decode refuses buckets in a position that
    // holds no epoch), so a slot's load is its summary's sum.
    let all_live = table
        .ring
        .iter()
        .zip(&live)
        .all(|(&e, &l)| l || e == u64::MAX);
    let live_mask = live
        .iter()
        .enumerate()
        .fold(0u8, |m, (i, l)| m | (u8::from(*l) << i));
    out.reserve(num_slots);
    if let Some(o) = offsets.as_deref_mut() {
        o.reserve(num_slots + 1);
    }
    // decode_header checked that every summary fits.
    let summaries = bytes
        .get(HEADER_LEN..HEADER_LEN + num_slots * SLOT_FIXED_LEN)
        .unwrap_or_default();
    let ctx = ViewContext {
        bytes,
        bucket_ms: table.bucket_ms,
        now_epoch,
        now_ms,
        live_mask: if all_live { None } else { Some(live_mask) },
    };
    let start = HEADER_LEN + summaries.len();
    let end = match offsets.as_deref_mut() {
        Some(o) => view_slots(&ctx, summaries, start, out, |pos| o.push(pos)),
        None => view_slots(&ctx, summaries, start, out, |_| {}),
    };
    let fail = |out: &mut Vec<SlotLoad>, offsets: Option<&mut Vec<usize>>| {
        out.truncate(before);
        if let Some(o) = offsets {
            o.clear();
        }
    };
    match end {
        None => {
            fail(out, offsets);
            Err(LoadDecodeError::Malformed)
        }
        Some((pos, _)) if pos != bytes.len() || out.len() - before != num_slots => {
            fail(out, offsets);
            Err(LoadDecodeError::Truncated {
                len: bytes.len(),
                needed: pos,
            })
        }
        Some((_, true)) => Ok(now_ms),
        Some((_, false)) => Ok(table
            .ring
            .iter()
            .filter(|&&e| LoadTable::alive(e, now_epoch))
            .map(|&e| {
                e.saturating_add(BUCKETS as u64)
                    .saturating_mul(table.bucket_ms)
            })
            .min()
            .unwrap_or(u64::MAX)),
    }
}

/// What every slot's view needs besides its own bytes.
struct ViewContext<'a> {
    bytes: &'a [u8],
    bucket_ms: u64,
    now_epoch: u64,
    now_ms: u64,
    /// `None`: every bucket counts (the summaries' sums are the loads). Else which ring
    /// positions still count.
    live_mask: Option<u8>,
}

/// Views the slots whose summaries are `summaries` (their details from `pos` on) into `out`,
/// telling `record` where each slot's details start (and where the last ends); the end and
/// whether any slot queues prefills, or `None` on bad framing.
#[inline(always)]
fn view_slots(
    ctx: &ViewContext<'_>,
    summaries: &[u8],
    mut pos: usize,
    out: &mut Vec<SlotLoad>,
    mut record: impl FnMut(usize),
) -> Option<(usize, bool)> {
    let mut queued = 0u8;
    for summary in summaries.chunks_exact(SLOT_FIXED_LEN) {
        let summary: &[u8; SLOT_FIXED_LEN] = summary.try_into().ok()?;
        record(pos);
        queued |= summary[12];
        let (load, next) = view_slot(ctx, summary, pos)?;
        out.push(load);
        pos = next;
    }
    record(pos);
    Some((pos, queued != 0))
}

/// The load of the slot whose summary is `summary` and whose details start at `pos`, and where
/// its details end; `None` if the bytes are not a slot (queue length or mask out of range, or
/// details past the end). Reads the details only for a queued anchor, or for the buckets when
/// not every ring position counts (the request path runs this once per slot: kept tight).
#[inline(always)]
fn view_slot(
    ctx: &ViewContext<'_>,
    summary: &[u8; SLOT_FIXED_LEN],
    pos: usize,
) -> Option<(SlotLoad, usize)> {
    let queued = usize::from(summary[12]);
    let mask = summary[13];
    if queued > PREFILL_QUEUE || usize::from(mask) >> BUCKETS != 0 {
        return None;
    }
    let end = pos + details_len(queued, mask);
    let mut total = Counters {
        prefill_tokens: u64::from_le_bytes(field(summary, TOTALS_AT)),
        decode_milli: u64::from_le_bytes(field(summary, TOTALS_AT + 8)),
        active: u32::from_le_bytes(field(summary, TOTALS_AT + 16)),
    };
    let mut anchor = None;
    let mut anchor_since_ms = u64::from_le_bytes(field(summary, 4));
    if queued > 0 || ctx.live_mask.is_some() {
        let details = ctx.bytes.get(pos..end)?;
        let (queue, buckets) = details.split_at_checked(queued * QUEUED_LEN)?;
        for q in queue.chunks_exact(QUEUED_LEN) {
            let q: &[u8; QUEUED_LEN] = q.try_into().ok()?;
            let admitted_ms = u64::from_le_bytes(field(q, 16));
            let epoch = admitted_ms / ctx.bucket_ms.max(1);
            if LoadTable::alive(epoch, ctx.now_epoch) {
                anchor = Some(Queued {
                    key: 0,
                    epoch,
                    prefill_tokens: u32::from_le_bytes(field(q, 8)),
                    expected_prefill_ms: u32::from_le_bytes(field(q, 12)),
                    admitted_ms,
                });
                break;
            }
            // Died with its bucket, not yet reaped (as `slot_load`).
            anchor_since_ms = anchor_since_ms.max(LoadTable::died_ms(epoch, ctx.bucket_ms));
        }
        if let Some(live_mask) = ctx.live_mask {
            total = live_total(total, mask, buckets, live_mask);
        }
    }
    let load = super::load_of(&total, anchor.as_ref(), anchor_since_ms, ctx.now_ms);
    Some((load, end))
}

/// A slot's counters over the live ring positions (`live_mask`) only: `sum` (its summary's) when
/// it has one bucket, else its buckets' counters from `buckets` (its details past the queue).
fn live_total(sum: Counters, mask: u8, buckets: &[u8], live_mask: u8) -> Counters {
    if mask.count_ones() < 2 {
        return if mask & live_mask != 0 {
            sum
        } else {
            Counters::default()
        };
    }
    let mut total = Counters::default();
    let mut records = buckets.chunks_exact(COUNTERS_LEN);
    for bit in (0..BUCKETS).map(|i| 1u8 << i).filter(|b| mask & b != 0) {
        let Some(c) = records.next() else {
            break;
        };
        if live_mask & bit != 0 {
            total.add(&Counters {
                prefill_tokens: u64::from_le_bytes(field(c, 0)),
                decode_milli: u64::from_le_bytes(field(c, 8)),
                active: u32::from_le_bytes(field(c, 16)),
            });
        }
    }
    total
}

/// `N` bytes of a record at `at` (callers pass constants in range; out of range reads zeros
/// rather than panicking).
#[inline(always)]
fn field<const N: usize>(record: &[u8], at: usize) -> [u8; N] {
    let mut out = [0u8; N];
    if let Some(s) = record.get(at..at + N) {
        out.copy_from_slice(s);
    }
    out
}

/// Whether a reap at `now_ms` has anything to do: a time bucket due, a table of another bucket
/// width (or bytes that do not decode, which the reap replaces). Reads the header only.
pub fn reap_due(bytes: &[u8], num_slots: usize, now_ms: u64, bucket_ms: u64) -> bool {
    if bytes.is_empty() {
        return false;
    }
    match LoadTable::decode_header(bytes, num_slots) {
        Ok((table, _)) => {
            let now_epoch = table.epoch_of(now_ms);
            table.bucket_ms != bucket_ms
                || table
                    .ring
                    .iter()
                    .any(|&e| e != u64::MAX && !LoadTable::alive(e, now_epoch))
        }
        Err(_) => true,
    }
}

/// One slot of a stored table, editable as a [`LoadTable`] (its other slots read as absent:
/// only edits of that slot succeed, and [`LoadTable::view`] shows that slot alone).
#[derive(Debug)]
pub struct Window {
    pub table: LoadTable,
    /// The slot's details' byte range in the bytes it was decoded from.
    start: usize,
    end: usize,
}

impl Window {
    /// `Ok(None)`: decode the whole table instead (empty bytes, a slot out of range, or a time
    /// bucket to reap at `now_ms`, the time the edit will use).
    pub fn decode(
        bytes: &[u8],
        num_slots: usize,
        slot: SlotIdx,
        now_ms: u64,
    ) -> Result<Option<Window>, LoadDecodeError> {
        let index = usize::from(slot);
        if bytes.is_empty() || index >= num_slots {
            return Ok(None);
        }
        let Some((table, _)) = header_unless_reap_due(bytes, num_slots, now_ms)? else {
            return Ok(None);
        };
        // decode_header checked that every summary fits.
        let summaries = bytes
            .get(HEADER_LEN..HEADER_LEN + num_slots * SLOT_FIXED_LEN)
            .unwrap_or_default();
        let (range, end) = details_range(summaries, HEADER_LEN + summaries.len(), index)?;
        if end != bytes.len() {
            return Err(LoadDecodeError::Truncated {
                len: bytes.len(),
                needed: end,
            });
        }
        let Some((start, end)) = range else {
            return Ok(None);
        };
        Window::read(bytes, table, index, start, end).map(Some)
    }

    /// [`Window::decode`] of bytes whose details' offsets [`view_bytes_at`] recorded (the same
    /// bytes, so their framing is checked already): no pass over the other slots.
    pub fn decode_at(
        bytes: &[u8],
        num_slots: usize,
        slot: SlotIdx,
        now_ms: u64,
        offsets: &[usize],
    ) -> Result<Option<Window>, LoadDecodeError> {
        let index = usize::from(slot);
        let (Some(&start), Some(&end)) = (offsets.get(index), offsets.get(index + 1)) else {
            return Ok(None);
        };
        if bytes.is_empty() || index >= num_slots || offsets.len() != num_slots + 1 {
            return Ok(None);
        }
        let Some((table, _)) = header_unless_reap_due(bytes, num_slots, now_ms)? else {
            return Ok(None);
        };
        Window::read(bytes, table, index, start, end).map(Some)
    }

    /// Slot `index` (summary at its place, details at `start..end`) into `table`.
    fn read(
        bytes: &[u8],
        mut table: LoadTable,
        index: usize,
        start: usize,
        end: usize,
    ) -> Result<Window, LoadDecodeError> {
        let mut fixed = Reader {
            bytes,
            pos: HEADER_LEN + index * SLOT_FIXED_LEN,
        };
        let mut details = Reader { bytes, pos: start };
        let decoded = read_slot(&mut fixed, &mut details, &table)?;
        if details.pos != end {
            return Err(LoadDecodeError::Malformed);
        }
        table.slots = vec![decoded];
        table.first = table.base + index;
        Ok(Window { table, start, end })
    }

    /// Where this slot's summary starts.
    fn summary_at(&self) -> usize {
        HEADER_LEN + self.table.first.saturating_sub(self.table.base) * SLOT_FIXED_LEN
    }

    /// [`Window::encode`] in place: `bytes` (what [`Window::decode`] read) becomes the whole
    /// table after the edit. Only the header, this slot's summary and its details are written
    /// (and the details after it moved when its length changed), instead of copying every slot.
    pub fn encode_into(&self, bytes: &mut Vec<u8>) {
        let mut header = Vec::with_capacity(HEADER_LEN + SLOT_FIXED_LEN);
        self.table.write_header(&mut header);
        let mut details = Vec::with_capacity(PREFILL_QUEUE * QUEUED_LEN + BUCKETS * COUNTERS_LEN);
        for s in &self.table.slots {
            write_summary(&mut header, s);
            write_details(&mut details, s);
        }
        let at = self.summary_at();
        let (head, summary) = header
            .split_at_checked(HEADER_LEN)
            .unwrap_or((header.as_slice(), &[]));
        let fits = head.len() == HEADER_LEN
            && summary.len() == SLOT_FIXED_LEN
            && at + SLOT_FIXED_LEN <= self.start
            && self.start <= self.end
            && self.end <= bytes.len();
        match (bytes.get_mut(..HEADER_LEN), fits) {
            (Some(h), true) => {
                h.copy_from_slice(head);
                if let Some(s) = bytes.get_mut(at..at + SLOT_FIXED_LEN) {
                    s.copy_from_slice(summary);
                }
                bytes.splice(self.start..self.end, details);
            }
            // Not the bytes this window was decoded from: the copying path.
            _ => *bytes = self.encode(bytes),
        }
    }

    /// The whole table's bytes after the edit: `bytes` (what [`Window::decode`] read) with the
    /// header, this slot's summary and its details rewritten.
    pub fn encode(&self, bytes: &[u8]) -> Vec<u8> {
        let at = self.summary_at();
        let mut out = Vec::with_capacity(bytes.len() + QUEUED_LEN + BUCKETS * COUNTERS_LEN);
        self.table.write_header(&mut out);
        out.extend_from_slice(bytes.get(HEADER_LEN..at).unwrap_or_default());
        for slot in &self.table.slots {
            write_summary(&mut out, slot);
        }
        out.extend_from_slice(
            bytes
                .get(at + SLOT_FIXED_LEN..self.start)
                .unwrap_or_default(),
        );
        for slot in &self.table.slots {
            write_details(&mut out, slot);
        }
        out.extend_from_slice(bytes.get(self.end..).unwrap_or_default());
        out
    }
}

/// Slot `index`'s details' byte range (`None` past the last slot) and where the last slot's
/// details end, from the summaries' lengths alone (details from `start` on). A tight pass with
/// no branch per slot: the release walks every slot before its own this way.
fn details_range(
    summaries: &[u8],
    start: usize,
    index: usize,
) -> Result<(Option<(usize, usize)>, usize), LoadDecodeError> {
    let mut malformed = false;
    let mut lens = summaries.chunks_exact(SLOT_FIXED_LEN).map(|summary| {
        let (queued, mask) = match summary.get(12..14) {
            Some(&[q, m]) => (q, m),
            _ => (u8::MAX, u8::MAX),
        };
        malformed |= usize::from(queued) > PREFILL_QUEUE || usize::from(mask) >> BUCKETS != 0;
        usize::from(queued) * QUEUED_LEN + details_len(0, mask & ((1 << BUCKETS) - 1))
    });
    let mut pos = start;
    for len in lens.by_ref().take(index) {
        pos += len;
    }
    let range = lens.next().map(|len| (pos, pos + len));
    pos = range.map_or(pos, |(_, end)| end);
    for len in lens {
        pos += len;
    }
    if malformed {
        return Err(LoadDecodeError::Malformed);
    }
    Ok((range, pos))
}

/// The table's header, or `None` when a time bucket is due for reaping at `now_ms` (the edit
/// must then decode the whole table and reap).
fn header_unless_reap_due<'a>(
    bytes: &'a [u8],
    num_slots: usize,
    now_ms: u64,
) -> Result<Option<(LoadTable, Reader<'a>)>, LoadDecodeError> {
    let (table, r) = LoadTable::decode_header(bytes, num_slots)?;
    let now_epoch = table.epoch_of(now_ms);
    let reap_due = table
        .ring
        .iter()
        .any(|&e| e != u64::MAX && !LoadTable::alive(e, now_epoch));
    Ok((!reap_due).then_some((table, r)))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
mod tests {
    use super::super::Ticket;
    use super::*;

    /// A table with bookings on several slots, some decaying, one slot cleared.
    fn busy(slots: usize) -> (LoadTable, Vec<Ticket>) {
        let mut t = LoadTable::with_timeout(slots, 60_000);
        let mut tickets = Vec::new();
        for k in 0..(slots as u64 * 3) {
            let slot = (k % slots as u64) as SlotIdx;
            let model = (k % 2 == 0).then_some(500.0);
            tickets.push(
                t.admit(k, slot, 100 + k as u32, 2, model, 1_000 + k)
                    .unwrap(),
            );
        }
        t.clear_slot(1);
        (t, tickets)
    }

    #[test]
    fn the_view_from_bytes_equals_decode_then_view() {
        let (t, _) = busy(5);
        let bytes = t.encode();
        let mut out = Vec::new();
        for now in [1_000, 1_200, 1_700, 70_000, 200_000] {
            view_bytes(&bytes, 5, now, &mut out).unwrap();
            assert_eq!(out, t.view(now));
        }
        view_bytes(&[], 3, 5, &mut out).unwrap();
        assert_eq!(out, vec![SlotLoad::default(); 3]);
        assert!(view_bytes(&bytes[..bytes.len() - 1], 5, 5, &mut out).is_err());
        assert!(out.is_empty());
        assert!(view_bytes(&bytes, 4, 5, &mut out).is_err());
    }

    #[test]
    fn the_in_place_view_equals_decode_then_view_over_random_tables() {
        // Bookings over several time buckets (so slots hold 1 to 4 of them), some decaying,
        // some past their first token or released: the in-place reader must agree on each.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        for round in 0..20 {
            let slots = 1 + next(40) as usize;
            let mut t = LoadTable::with_timeout(slots, 3_000);
            let mut tickets = Vec::new();
            for k in 0..next(200) {
                let now = k * 20;
                let slot = next(slots as u64) as SlotIdx;
                let model = (next(2) == 0).then_some(next(5_000) as f64);
                let tokens = next(5_000) as u32;
                if let Some(ticket) = t.admit(k, slot, tokens, next(64) as u32, model, now) {
                    tickets.push(ticket);
                }
                match (next(4), tickets.len()) {
                    (0, n) if n > 0 => {
                        let i = next(n as u64) as usize;
                        t.release_at(&tickets.swap_remove(i), now);
                    }
                    (1, n) if n > 0 => {
                        let i = next(n as u64) as usize;
                        if let Some(done) = t.first_token(&tickets[i], now) {
                            tickets[i] = done;
                        }
                    }
                    _ => {}
                }
            }
            let bytes = t.encode();
            let mut out = Vec::new();
            let mut offsets = Vec::new();
            for now in [0, 1_000, 2_500, 4_000, 5_200, 9_000] {
                out.clear();
                view_bytes_at(&bytes, slots, now, &mut out, Some(&mut offsets)).unwrap();
                assert_eq!(out, t.view(now), "round {round}, now {now}");
                assert_eq!(offsets.len(), slots + 1);
                assert_eq!(offsets.last(), Some(&bytes.len()));
            }
        }
    }

    #[test]
    fn an_edit_through_a_window_writes_what_the_whole_table_would() {
        let (t, tickets) = busy(6);
        let bytes = t.encode();
        let now = 1_400;
        // Book, first token, output blocks, release: each on one slot, both ways.
        for (i, ticket) in tickets.iter().enumerate() {
            let slot = ticket.slot;
            let edits: [&dyn Fn(&mut LoadTable) -> bool; 4] = [
                &|t| t.admit(99, slot, 40, 1, Some(100.0), now).is_some(),
                &|t| t.first_token(ticket, now).is_some(),
                &|t| t.set_output_milli_blocks(ticket, 2_500, now).is_some(),
                &|t| t.release_at(ticket, now),
            ];
            let edit = edits[i % edits.len()];
            let mut whole = LoadTable::decode(&bytes, 6).unwrap();
            let mut window = Window::decode(&bytes, 6, slot, now).unwrap().unwrap();
            assert_eq!(edit(&mut whole), edit(&mut window.table), "ticket {i}");
            assert_eq!(window.encode(&bytes), whole.encode(), "ticket {i}");
            let mut in_place = bytes.clone();
            window.encode_into(&mut in_place);
            assert_eq!(in_place, whole.encode(), "ticket {i}, in place");
        }
    }

    /// One edit of [`random_edits_through_windows_keep_the_bytes_equal_to_the_whole_table`].
    #[derive(Clone, Copy, Debug)]
    enum Op {
        Admit(u64, SlotIdx, u32, u32, Option<f64>),
        FirstToken(usize),
        Output(usize, u64),
        Release(usize),
        Move(usize, SlotIdx),
        Clear(SlotIdx),
        Reap,
    }

    impl Op {
        /// Whether the request path edits this through a [`Window`] (one slot).
        fn windowed(self, tickets: &[Ticket]) -> Option<SlotIdx> {
            let slot_of = |i: usize| tickets.get(i).map(|t| t.slot);
            match self {
                Op::Admit(_, slot, ..) => Some(slot),
                Op::FirstToken(i) | Op::Output(i, _) | Op::Release(i) => slot_of(i),
                Op::Move(..) | Op::Clear(_) | Op::Reap => None,
            }
        }

        /// Applies the edit; a ticket it returns replaces (or, for an admission, joins) the
        /// request's.
        fn apply(self, t: &mut LoadTable, tickets: &[Ticket], now: u64) -> Option<Ticket> {
            let ticket = |i: usize| tickets.get(i).copied();
            match self {
                Op::Admit(key, slot, tokens, blocks, model) => {
                    t.admit(key, slot, tokens, blocks, model, now)
                }
                Op::FirstToken(i) => t.first_token(&ticket(i)?, now),
                Op::Output(i, milli) => t.set_output_milli_blocks(&ticket(i)?, milli, now),
                Op::Release(i) => t.release_at(&ticket(i)?, now).then(|| ticket(i))?,
                Op::Move(i, slot) => t.move_to(&ticket(i)?, slot, now),
                Op::Clear(slot) => t.clear_slot(slot).then_some(None)?,
                Op::Reap => {
                    t.expire(now);
                    None
                }
            }
        }
    }

    #[test]
    fn random_edits_through_windows_keep_the_bytes_equal_to_the_whole_table() {
        // The request path's way (view with offsets, then a one-slot window on those bytes, or
        // walking to the slot, or the whole table when a bucket is due) against a table that is
        // never encoded: after every edit the bytes decode to it, encode like it, and view like
        // it. Time moves on so buckets open, die and are reaped; prefills queue and decay.
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m.max(1)
        };
        let mut windowed_edits = 0;
        for round in 0..40 {
            let slots = 1 + next(9) as usize;
            let mut reference = LoadTable::with_timeout(slots, 3_000);
            let mut bytes = reference.encode();
            let mut tickets: Vec<Ticket> = Vec::new();
            let (mut out, mut offsets) = (Vec::new(), Vec::new());
            let mut now = 0;
            for step in 0..250u64 {
                now += next(120);
                out.clear();
                view_bytes_at(&bytes, slots, now, &mut out, Some(&mut offsets)).unwrap();
                assert_eq!(out, reference.view(now), "round {round} step {step}");
                let slot = next(slots as u64 + 1) as SlotIdx; // sometimes out of range
                let i = next(tickets.len() as u64 + 1) as usize;
                let op = match next(12) {
                    0..=3 => {
                        let model = (next(2) == 0).then(|| next(3_000) as f64);
                        Op::Admit(step, slot, next(4_000) as u32, next(40) as u32, model)
                    }
                    4 | 5 => Op::FirstToken(i),
                    6 => Op::Output(i, next(5_000)),
                    7 | 8 => Op::Release(i),
                    9 => Op::Move(i, slot),
                    10 => Op::Clear(slot),
                    _ => Op::Reap,
                };
                let want = op.apply(&mut reference, &tickets, now);
                let window = op.windowed(&tickets).and_then(|slot| {
                    let w = if next(2) == 0 {
                        Window::decode_at(&bytes, slots, slot, now, &offsets)
                    } else {
                        Window::decode(&bytes, slots, slot, now)
                    };
                    w.unwrap()
                });
                let got = match window {
                    Some(mut w) => {
                        windowed_edits += 1;
                        let got = op.apply(&mut w.table, &tickets, now);
                        w.encode_into(&mut bytes);
                        got
                    }
                    None => {
                        let mut whole = LoadTable::decode(&bytes, slots).unwrap();
                        let got = op.apply(&mut whole, &tickets, now);
                        bytes = whole.encode();
                        got
                    }
                };
                assert_eq!(got, want, "round {round} step {step} {op:?}");
                match (op, got) {
                    (Op::Admit(..), Some(t)) => tickets.push(t),
                    (Op::Release(i), Some(_)) => {
                        tickets.swap_remove(i);
                    }
                    (_, Some(t)) => {
                        if let Some(slot) = tickets.get_mut(i) {
                            *slot = t;
                        }
                    }
                    _ => {}
                }
                assert_eq!(
                    LoadTable::decode(&bytes, slots).as_ref(),
                    Ok(&reference),
                    "round {round} step {step} {op:?}"
                );
                assert_eq!(bytes, reference.encode(), "round {round} step {step}");
            }
        }
        assert!(windowed_edits > 2_000, "{windowed_edits}");
    }

    #[test]
    fn a_table_of_version_2_is_refused() {
        let (t, _) = busy(3);
        let mut bytes = t.encode();
        bytes[4] = 2;
        let mut out = Vec::new();
        assert_eq!(
            LoadTable::decode(&bytes, 3),
            Err(LoadDecodeError::UnsupportedVersion { found: 2 })
        );
        assert!(view_bytes(&bytes, 3, 1_000, &mut out).is_err());
        assert!(Window::decode(&bytes, 3, 0, 1_000).is_err());
    }

    #[test]
    fn a_summary_that_disagrees_with_its_buckets_is_refused() {
        let mut t = LoadTable::with_timeout(2, 3_000);
        t.admit(1, 0, 100, 2, None, 0).unwrap();
        t.admit(2, 0, 50, 1, None, 1_500).unwrap();
        t.admit(3, 1, 70, 1, None, 0).unwrap();
        let bytes = t.encode();
        assert_eq!(LoadTable::decode(&bytes, 2), Ok(t));
        // Slot 0's sum of prefill tokens (two buckets): it disagrees with them.
        let mut bad = bytes.clone();
        bad[HEADER_LEN + TOTALS_AT] ^= 1;
        assert_eq!(LoadTable::decode(&bad, 2), Err(LoadDecodeError::Malformed));
        // Slot 1 has one bucket: the sum is its only copy.
        let mut one = bytes.clone();
        one[HEADER_LEN + SLOT_FIXED_LEN + TOTALS_AT] ^= 1;
        assert_eq!(
            LoadTable::decode(&one, 2).unwrap().view(0)[1].prefill_tokens,
            71.0
        );
        // A bucket in a ring position that holds no epoch.
        let mut unopened = bytes.clone();
        unopened[HEADER_LEN + SLOT_FIXED_LEN + 13] = 0b1000;
        assert_eq!(
            LoadTable::decode(&unopened, 2),
            Err(LoadDecodeError::Malformed)
        );
    }

    #[test]
    fn a_bucket_due_for_reaping_or_bad_input_needs_the_whole_table() {
        let (t, _) = busy(3);
        let bytes = t.encode();
        // Bookings at ~1 s with 20 s buckets: reaped from 80 s.
        assert!(Window::decode(&bytes, 3, 0, 79_999).unwrap().is_some());
        assert!(Window::decode(&bytes, 3, 0, 80_000).unwrap().is_none());
        assert!(Window::decode(&bytes, 3, 3, 1_000).unwrap().is_none());
        assert!(Window::decode(&[], 3, 0, 1_000).unwrap().is_none());
        assert!(Window::decode(&bytes[..bytes.len() - 1], 3, 0, 1_000).is_err());
        let mut long = bytes.clone();
        long.push(0);
        assert!(Window::decode(&long, 3, 2, 1_000).is_err());
    }
}
