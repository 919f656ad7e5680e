//! The load table's request path without decoding every slot: at 1,000 slots a whole decode and
//! encode costs far more than the decision itself, and each request touches one slot.
//!
//! * [`view_bytes`]: the per-slot view straight from the stored bytes (no table built).
//! * [`Window`]: one slot decoded (the others only walked to find its bytes and check their
//!   framing); the edit runs on it as on a whole table, and [`Window::encode`] splices the slot's
//!   new bytes between the untouched ones. It is only used when no time bucket is due to be
//!   reaped at the edit's time (reaping touches every slot; then the whole table is decoded, at
//!   most once per bucket width).

use super::{
    read_slot, write_slot, Counters, LoadDecodeError, LoadTable, Queued, Reader, SlotLoad, BUCKETS,
    COUNTERS_LEN, HEADER_LEN, PREFILL_QUEUE, QUEUED_LEN, SLOT_FIXED_LEN,
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
    view_bytes_at(bytes, num_slots, now_ms, out, None)
}

/// [`view_bytes`] that also records where each slot starts in `bytes` (`num_slots + 1` offsets,
/// the last one the end), for [`Window::decode_at`]. Left empty on an error.
pub fn view_bytes_at(
    bytes: &[u8],
    num_slots: usize,
    now_ms: u64,
    out: &mut Vec<SlotLoad>,
    mut offsets: Option<&mut Vec<usize>>,
) -> Result<(), LoadDecodeError> {
    out.clear();
    if let Some(o) = offsets.as_deref_mut() {
        o.clear();
    }
    if bytes.is_empty() {
        out.resize(num_slots, SlotLoad::default());
        return Ok(());
    }
    let (table, r) = LoadTable::decode_header(bytes, num_slots)?;
    let now_epoch = table.epoch_of(now_ms);
    let live = table.ring.map(|e| LoadTable::alive(e, now_epoch));
    out.reserve(num_slots);
    if let Some(o) = offsets.as_deref_mut() {
        o.reserve(num_slots + 1);
    }
    let (start, width) = (r.pos, table.bucket_ms);
    let end = match offsets.as_deref_mut() {
        Some(o) => view_slots(
            bytes,
            start,
            num_slots,
            &live,
            (now_epoch, now_ms),
            width,
            out,
            |pos| o.push(pos),
        ),
        None => view_slots(
            bytes,
            start,
            num_slots,
            &live,
            (now_epoch, now_ms),
            width,
            out,
            |_| {},
        ),
    };
    let fail = |out: &mut Vec<SlotLoad>, offsets: Option<&mut Vec<usize>>| {
        out.clear();
        if let Some(o) = offsets {
            o.clear();
        }
    };
    match end {
        None => {
            fail(out, offsets);
            return Err(LoadDecodeError::Malformed);
        }
        Some(pos) if pos != bytes.len() => {
            fail(out, offsets);
            return Err(LoadDecodeError::Truncated {
                len: bytes.len(),
                needed: pos,
            });
        }
        Some(_) => {}
    }
    Ok(())
}

/// Views `num_slots` slots from `pos` into `out`, telling `record` where each starts (and where
/// the last ends); the end, or `None` on bad framing.
#[allow(clippy::too_many_arguments)]
fn view_slots(
    bytes: &[u8],
    mut pos: usize,
    num_slots: usize,
    live: &[bool; BUCKETS],
    (now_epoch, now_ms): (u64, u64),
    bucket_ms: u64,
    out: &mut Vec<SlotLoad>,
    mut record: impl FnMut(usize),
) -> Option<usize> {
    for _ in 0..num_slots {
        record(pos);
        let (load, next) = view_slot(bytes, pos, bucket_ms, live, now_epoch, now_ms)?;
        out.push(load);
        pos = next;
    }
    record(pos);
    Some(pos)
}

/// The load of the slot encoded at `pos`, and where the next slot starts; `None` if the bytes
/// there are not a slot (same checks as `read_slot`). Reads only what the view needs, in place:
/// no [`super::Slot`] is built, each field is read from one bounds-checked fixed-size record
/// (the request path runs this once per slot, so it is kept branch-light).
#[inline(always)]
fn view_slot(
    bytes: &[u8],
    pos: usize,
    bucket_ms: u64,
    live: &[bool; BUCKETS],
    now_epoch: u64,
    now_ms: u64,
) -> Option<(SlotLoad, usize)> {
    let fixed: &[u8; SLOT_FIXED_LEN] = bytes
        .get(pos..pos.checked_add(SLOT_FIXED_LEN)?)?
        .try_into()
        .ok()?;
    let [_, _, _, _, a0, a1, a2, a3, a4, a5, a6, a7, queued, _] = *fixed;
    let anchor_since_ms = u64::from_le_bytes([a0, a1, a2, a3, a4, a5, a6, a7]);
    let queued = usize::from(queued);
    if queued > PREFILL_QUEUE {
        return None;
    }
    let queue_at = pos + 13;
    let mask_at = queue_at + queued * QUEUED_LEN;
    let mut anchor = None;
    if queued > 0 {
        let queue = bytes.get(queue_at..mask_at)?;
        for q in queue.chunks_exact(QUEUED_LEN) {
            let q: &[u8; QUEUED_LEN] = q.try_into().ok()?;
            let admitted_ms = u64::from_le_bytes(field(q, 16));
            let epoch = admitted_ms / bucket_ms.max(1);
            if LoadTable::alive(epoch, now_epoch) {
                anchor = Some(Queued {
                    key: 0,
                    epoch,
                    prefill_tokens: u32::from_le_bytes(field(q, 8)),
                    expected_prefill_ms: u32::from_le_bytes(field(q, 12)),
                    admitted_ms,
                });
                break;
            }
        }
    }
    let mask = *bytes.get(mask_at)?;
    if usize::from(mask) >> BUCKETS != 0 {
        return None;
    }
    let live_mask = live
        .iter()
        .enumerate()
        .fold(0u8, |m, (i, l)| m | (u8::from(*l) << i));
    let mut total = Counters::default();
    let mut at = mask_at + 1;
    let mut rest = mask;
    while rest != 0 {
        let bit = rest & rest.wrapping_neg();
        rest &= !bit;
        let c: &[u8; COUNTERS_LEN] = bytes.get(at..at + COUNTERS_LEN)?.try_into().ok()?;
        let c = Counters {
            prefill_tokens: u64::from_le_bytes(field(c, 0)),
            decode_milli: u64::from_le_bytes(field(c, 8)),
            active: u32::from_le_bytes(field(c, 16)),
        };
        if c == Counters::default() {
            return None;
        }
        if live_mask & bit != 0 {
            total.add(&c);
        }
        at += COUNTERS_LEN;
    }
    let load = super::load_of(&total, anchor.as_ref(), anchor_since_ms, now_ms);
    Some((load, at))
}

/// `N` bytes of a fixed-size record at `at` (`at + N <= M`: callers pass constants in range;
/// out of range reads zeros rather than panicking).
#[inline(always)]
fn field<const M: usize, const N: usize>(record: &[u8; M], at: usize) -> [u8; N] {
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
    /// The slot's byte range in the bytes it was decoded from.
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
        let Some((mut table, mut r)) = header_unless_reap_due(bytes, num_slots, now_ms)? else {
            return Ok(None);
        };
        let mut pos = r.pos;
        for _ in 0..index {
            pos = skip_slot(bytes, pos).ok_or(LoadDecodeError::Malformed)?;
        }
        let start = pos;
        r.pos = pos;
        let decoded = read_slot(&mut r, table.bucket_ms)?;
        let end = r.pos;
        pos = end;
        for _ in index + 1..num_slots {
            pos = skip_slot(bytes, pos).ok_or(LoadDecodeError::Malformed)?;
        }
        if pos != bytes.len() {
            return Err(LoadDecodeError::Truncated {
                len: bytes.len(),
                needed: pos,
            });
        }
        table.slots = vec![decoded];
        table.first = index;
        Ok(Some(Window { table, start, end }))
    }

    /// [`Window::decode`] of bytes whose slot offsets [`view_bytes_at`] recorded (the same
    /// bytes, so their framing is checked already): no walk over the other slots.
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
        let Some((mut table, mut r)) = header_unless_reap_due(bytes, num_slots, now_ms)? else {
            return Ok(None);
        };
        r.pos = start;
        let decoded = read_slot(&mut r, table.bucket_ms)?;
        if r.pos != end {
            return Err(LoadDecodeError::Malformed);
        }
        table.slots = vec![decoded];
        table.first = index;
        Ok(Some(Window { table, start, end }))
    }

    /// [`Window::encode`] in place: `bytes` (what [`Window::decode`] read) becomes the whole
    /// table after the edit. Only the header and this slot's bytes are written (and the slots
    /// after it moved when its length changed), instead of copying every slot.
    pub fn encode_into(&self, bytes: &mut Vec<u8>) {
        let mut header = Vec::with_capacity(HEADER_LEN);
        self.table.write_header(&mut header);
        let mut slot = Vec::with_capacity(
            SLOT_FIXED_LEN + PREFILL_QUEUE * QUEUED_LEN + BUCKETS * COUNTERS_LEN,
        );
        for s in &self.table.slots {
            write_slot(&mut slot, s);
        }
        let fits = header.len() == HEADER_LEN
            && HEADER_LEN <= self.start
            && self.start <= self.end
            && self.end <= bytes.len();
        match bytes.get_mut(..HEADER_LEN) {
            Some(h) if fits => {
                h.copy_from_slice(&header);
                bytes.splice(self.start..self.end, slot);
            }
            // Not the bytes this window was decoded from: the copying path.
            _ => *bytes = self.encode(bytes),
        }
    }

    /// The whole table's bytes after the edit: `bytes` (what [`Window::decode`] read) with the
    /// header and this slot rewritten.
    pub fn encode(&self, bytes: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(bytes.len() + QUEUED_LEN + COUNTERS_LEN);
        self.table.write_header(&mut out);
        out.extend_from_slice(bytes.get(HEADER_LEN..self.start).unwrap_or_default());
        for slot in &self.table.slots {
            write_slot(&mut out, slot);
        }
        out.extend_from_slice(bytes.get(self.end..).unwrap_or_default());
        out
    }
}

/// The table's header and a reader after it, or `None` when a time bucket is due for reaping at
/// `now_ms` (the edit must then decode the whole table and reap).
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

/// Where the slot encoded at `pos` ends, checking its framing (queue length and bucket mask in
/// range); `None` if it does not fit. (A slot running past the end is caught by the caller's
/// final length check.)
fn skip_slot(bytes: &[u8], pos: usize) -> Option<usize> {
    let queued = usize::from(*bytes.get(pos + 12)?);
    if queued > PREFILL_QUEUE {
        return None;
    }
    let mask_at = pos + 13 + queued * QUEUED_LEN;
    let mask = *bytes.get(mask_at)?;
    if usize::from(mask) >> BUCKETS != 0 {
        return None;
    }
    Some(mask_at + 1 + mask.count_ones() as usize * COUNTERS_LEN)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    /// A table with bookings on several slots, some decaying, one slot cleared.
    fn busy(slots: usize) -> (LoadTable, Vec<super::super::Ticket>) {
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
