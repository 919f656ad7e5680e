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
    COUNTERS_LEN, HEADER_LEN, PREFILL_QUEUE, QUEUED_LEN,
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
    let mut pos = r.pos;
    for _ in 0..num_slots {
        if let Some(o) = offsets.as_deref_mut() {
            o.push(pos);
        }
        match view_slot(bytes, pos, table.bucket_ms, &live, now_epoch, now_ms) {
            Some((load, next)) => {
                out.push(load);
                pos = next;
            }
            None => {
                out.clear();
                if let Some(o) = offsets {
                    o.clear();
                }
                return Err(LoadDecodeError::Malformed);
            }
        }
    }
    if pos != bytes.len() {
        out.clear();
        if let Some(o) = offsets {
            o.clear();
        }
        return Err(LoadDecodeError::Truncated {
            len: bytes.len(),
            needed: pos,
        });
    }
    if let Some(o) = offsets {
        o.push(pos);
    }
    Ok(())
}

/// The load of the slot encoded at `pos`, and where the next slot starts; `None` if the bytes
/// there are not a slot (same checks as `read_slot`). Reads only what the view needs: no
/// [`super::Slot`] is built.
fn view_slot(
    bytes: &[u8],
    pos: usize,
    bucket_ms: u64,
    live: &[bool; BUCKETS],
    now_epoch: u64,
    now_ms: u64,
) -> Option<(SlotLoad, usize)> {
    let anchor_since_ms = le_u64(bytes, pos + 4)?;
    let queued = usize::from(*bytes.get(pos + 12)?);
    if queued > PREFILL_QUEUE {
        return None;
    }
    let queue_at = pos + 13;
    let mask_at = queue_at + queued * QUEUED_LEN;
    let mut anchor = None;
    for i in 0..queued {
        let at = queue_at + i * QUEUED_LEN;
        let admitted_ms = le_u64(bytes, at + 16)?;
        let epoch = admitted_ms / bucket_ms.max(1);
        if LoadTable::alive(epoch, now_epoch) {
            anchor = Some(Queued {
                key: 0,
                epoch,
                prefill_tokens: le_u32(bytes, at + 8)?,
                expected_prefill_ms: le_u32(bytes, at + 12)?,
                admitted_ms,
            });
            break;
        }
    }
    let mask = *bytes.get(mask_at)?;
    if usize::from(mask) >> BUCKETS != 0 {
        return None;
    }
    let mut total = Counters::default();
    let mut at = mask_at + 1;
    for (i, alive) in live.iter().enumerate() {
        if mask & (1 << i) == 0 {
            continue;
        }
        let c = Counters {
            prefill_tokens: le_u64(bytes, at)?,
            decode_milli: le_u64(bytes, at + 8)?,
            active: le_u32(bytes, at + 16)?,
        };
        if c == Counters::default() {
            return None;
        }
        if *alive {
            total.add(&c);
        }
        at += COUNTERS_LEN;
    }
    let load = super::load_of(&total, anchor.as_ref(), anchor_since_ms, now_ms);
    Some((load, at))
}

fn le_u64(bytes: &[u8], at: usize) -> Option<u64> {
    let b: [u8; 8] = bytes.get(at..at.checked_add(8)?)?.try_into().ok()?;
    Some(u64::from_le_bytes(b))
}

fn le_u32(bytes: &[u8], at: usize) -> Option<u32> {
    let b: [u8; 4] = bytes.get(at..at.checked_add(4)?)?.try_into().ok()?;
    Some(u32::from_le_bytes(b))
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
