//! The fast pass for token ids: a structural scan cuts plain integer arrays out of the body and
//! reads them with a hand-written loop; the rest of the body still goes through the serde pass
//! (see the `request` module docs).

use std::cell::Cell;
use std::ops::Range;

use super::visitors::{parse_object, Prefill, Tokens};
use super::{Endpoint, LlmRequest, ParseOptions, TokenSpan};

/// The fast pass. `None` = use the serde pass on the original body (nothing to gain, or the
/// fast pass failed; never a different answer).
///
/// Why an `Ok` here is the serde pass's `Ok`: each cut range holds a complete array of integers
/// (no quotes, backslashes or control bytes) and is replaced by `[]`. If serde accepts the copy,
/// that `[]` is an array value there, so the original (with the bigger array in its place) is
/// valid JSON too; on valid JSON the structural scan finds exactly the values the visitors read,
/// in the same order; and the visitors check that every recorded occurrence meets its `[]`.
pub(super) fn parse_fast(
    body: &[u8],
    endpoint: Endpoint,
    opts: &ParseOptions,
) -> Option<LlmRequest> {
    let mut scan = Scan {
        body,
        pos: 0,
        endpoint,
        lazy: opts.lazy_token_ids,
        cuts: Vec::new(),
        prompts: Vec::new(),
        token_data: Vec::new(),
    };
    scan.object(Level::Top)?;
    if scan.cuts.is_empty() {
        return None;
    }
    if scan.lazy && scan.prompts.len() + scan.token_data.len() > 1 {
        // Several token fields: only one is used, but every one must be a valid array. Rare:
        // all of them are read now.
        let eager = ParseOptions {
            lazy_token_ids: false,
            ..*opts
        };
        return parse_fast(body, endpoint, &eager);
    }
    let cut_bytes: usize = scan.cuts.iter().map(|&(start, end)| end - start).sum();
    let mut copy = Vec::with_capacity(body.len() - cut_bytes + 2 * scan.cuts.len());
    let mut at = 0;
    for &(start, end) in &scan.cuts {
        copy.extend_from_slice(body.get(at..start)?);
        copy.extend_from_slice(b"[]");
        at = end;
    }
    copy.extend_from_slice(body.get(at..)?);
    // Popped from the back, in body order.
    scan.prompts.reverse();
    scan.token_data.reverse();
    let prefill = Prefill {
        prompts: Cell::new(scan.prompts),
        token_data: Cell::new(scan.token_data),
    };
    let mut req = parse_object(&copy, endpoint, Some(&prefill), opts).ok()?;
    let drained = prefill.prompts.take().is_empty() && prefill.token_data.take().is_empty();
    // The client's `priority` values were found in the copy: where they are in the body.
    for value in &mut req.client_priority {
        *value = body_range(&scan.cuts, value);
    }
    drained.then_some(req)
}

/// Where a range of the copy (each cut array replaced by `[]`, see [`parse_fast`]) is in the
/// body: shifted by the bytes cut before it (it lies outside every `[]`).
fn body_range(cuts: &[(usize, usize)], copy: &Range<usize>) -> Range<usize> {
    let mut shift = 0usize;
    for &(start, end) in cuts {
        // The cut's `[]` ends here in the copy.
        let marker_end = start.saturating_sub(shift).saturating_add(2);
        if copy.start < marker_end {
            break;
        }
        shift = shift.saturating_add(end.saturating_sub(start).saturating_sub(2));
    }
    copy.start.saturating_add(shift)..copy.end.saturating_add(shift)
}

/// JSON whitespace (RFC 8259; what serde_json skips).
fn is_json_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

/// Token ids from JSON text that starts with an array of non-negative integers, each without
/// sign, fraction, exponent or leading zero and at most `u32::MAX`, with any JSON whitespace
/// inside. Returns the ids and the length of the array text (through its `]`). `None` for
/// anything else (that value is left to serde, which yields the value or the error it always did).
///
/// The common case (ids of up to 7 digits, each followed directly by `,` or `, `) runs in
/// [`comma_run`], which writes into the array's pre-sized buffer. Anything else (the last id,
/// whitespace, longer ids, fewer than 8 bytes left) goes through [`parse_token_id`] and the
/// general separator rules, one id at a time, then back to the run (the same answer;
/// `scan_agrees_with_the_reference_scanner` checks it).
pub(crate) fn scan_token_ids(text: &[u8]) -> Option<(Vec<u32>, usize)> {
    if text.first() != Some(&b'[') {
        return None;
    }
    // About one id per 6 bytes (5-6 digit ids and a comma): sized once for most arrays, zeroed
    // so that the run writes through a plain slice; cut to the ids read at the end.
    let mut ids = vec![0u32; text.len() / 6 + 1];
    let mut n = 0;
    let mut i = skip_ws(text, 1);
    if text.get(i) == Some(&b']') {
        ids.clear();
        return Some((ids, i + 1));
    }
    loop {
        // The run stops at an id's first byte or after a comma (whitespace may follow).
        (i, n) = mask_run(text, i, ids.as_mut_slice(), n);
        (i, n) = comma_run(text, i, ids.as_mut_slice(), n);
        i = skip_ws(text, i);
        let (id, len) = parse_token_id(text.get(i..)?)?;
        if n == ids.len() {
            // Room for the rest at one id per 2 bytes (the shortest id and its comma).
            ids.resize(n + text.len().saturating_sub(i) / 2 + 1, 0);
        }
        *ids.get_mut(n)? = id;
        n += 1;
        i += len;
        if text.get(i).copied().is_some_and(is_json_ws) {
            i = skip_ws(text, i);
        }
        match text.get(i)? {
            b',' => i = skip_ws(text, i + 1),
            b']' => {
                ids.truncate(n);
                return Some((ids, i + 1));
            }
            _ => return None, // `.`, `e`, `E`, or anything else
        }
    }
}

/// Reads ids of 1 to 7 digits (no leading zero), each followed directly by `,` (and at most one
/// space, skipped), from `text[i..]` into `out[n..]` while 8 bytes can be read and `out` has
/// room; returns where the first other id (or byte) starts and the new count. One 8-byte load
/// per id gives its digits, their value, the comma and the space; one branch per id decides.
///
/// Not inlined: on its own, the loop keeps its 64-bit constants in registers (inlined into
/// [`scan_token_ids`], four of them were reloaded for every id).
#[inline(never)]
fn comma_run<O: IdOut + ?Sized>(
    text: &[u8],
    mut i: usize,
    out: &mut O,
    mut n: usize,
) -> (usize, usize) {
    const ONES: u64 = 0x0101_0101_0101_0101;
    // `b ^ 0x30` of a comma and of a space.
    const COMMA: u8 = b',' ^ b'0';
    const SPACE: u8 = b' ' ^ b'0';
    let Some(last) = text.len().checked_sub(8) else {
        return (i, n);
    };
    let room = out.room();
    while i <= last && n < room {
        let Some(chunk) = text.get(i..).and_then(<[u8]>::first_chunk::<8>) else {
            break;
        };
        // Digit bytes become their values 0-9, every other byte something else.
        let d = u64::from_le_bytes(*chunk) ^ (0x30 * ONES);
        // Bit 7 of a byte set iff it is not a digit (exact up to the first non-digit: a carry
        // only starts at a non-digit and only reaches later bytes).
        let not_digit = (d.wrapping_add(0x76 * ONES) | d) & (0x80 * ONES);
        // 8 * the number of digits; 0 for none and for 8 (no non-digit: 64 & 0x38).
        let bits = not_digit.trailing_zeros() & 0x38;
        // The two bytes after the digits.
        let tail = d >> bits;
        // A leading zero: the first byte is `0` and the second a digit.
        let leading_zero = (d | not_digit) & 0x80FF == 0;
        if (tail as u8 != COMMA) | (bits == 0) | leading_zero {
            break;
        }
        out.put(n, eight_digits(d << (64 - bits)));
        n += 1;
        // Past the comma, and one space after it (`json.dumps` writes `, `); 7 digits: the
        // byte after the comma is not in the load (`tail >> 8` is 0), the next load sees it.
        i += (bits / 8) as usize + 1 + usize::from((tail >> 8) as u8 == SPACE);
    }
    (i, n)
}

/// Where a reader writes ids: a `[u32]`, or `[[u8; 4]]` (each id's little-endian bytes, the
/// form blocks are hashed in: no copy between reading and hashing).
pub trait IdOut {
    /// How many ids fit.
    fn room(&self) -> usize;
    /// Writes id number `n` (nothing if it does not fit).
    fn put(&mut self, n: usize, id: u32);
}

impl IdOut for [u32] {
    #[inline(always)]
    fn room(&self) -> usize {
        self.len()
    }

    #[inline(always)]
    fn put(&mut self, n: usize, id: u32) {
        if let Some(slot) = self.get_mut(n) {
            *slot = id;
        }
    }
}

impl IdOut for [[u8; 4]] {
    #[inline(always)]
    fn room(&self) -> usize {
        self.len()
    }

    #[inline(always)]
    fn put(&mut self, n: usize, id: u32) {
        if let Some(slot) = self.get_mut(n) {
            *slot = id.to_le_bytes();
        }
    }
}

/// Reads ids of 1 to 7 digits (no leading zero), each followed directly by `,` (and at most one
/// space), from `text[i..]` (an id's first digit) into `out[n..]`, 64 bytes at a time, while 72
/// bytes can be read and `out` has room; returns where it stopped (an id's first byte, or the
/// byte after a comma) and the new count, as [`comma_run`] does (which then goes on).
///
/// The shape is checked with the masks of [`count_from`] (vector compares: digits, commas,
/// spaces, zeros) up to the last comma of the 64 bytes, once for all the ids in them; the ids'
/// bounds come from the masks (the k-th id start and the k-th comma), so per id there is only an
/// 8-byte load and [`eight_digits`]. Anything unusual in the 64 bytes (another byte before the
/// last comma, a long id, a leading zero, two spaces) stops the run before them: the caller reads
/// them the general way.
#[inline(never)]
pub(super) fn mask_run<O: IdOut + ?Sized>(
    text: &[u8],
    mut i: usize,
    out: &mut O,
    mut n: usize,
) -> (usize, usize) {
    const ONES: u64 = 0x0101_0101_0101_0101;
    let room = out.room();
    // 64 bytes from `i`, and 8 more: every id's 8-byte load (from its first digit) is inside.
    while let Some(chunk) = text.get(i..).and_then(<[u8]>::first_chunk::<72>) {
        let Some(window) = chunk.first_chunk::<64>() else {
            break;
        };
        if n >= room {
            break;
        }
        let m = masks64(window);
        let other = !(m.digit | m.comma | m.space);
        // The bytes before the first other byte; the ids up to the last comma among them.
        let valid = (other & other.wrapping_neg()).wrapping_sub(1);
        let comma = m.comma & valid;
        if m.digit & 1 == 0 || comma == 0 {
            break;
        }
        let region = u64::MAX >> comma.leading_zeros();
        let digit = m.digit & region;
        let space = m.space & region;
        let digit_before = digit << 1;
        let start = digit & !digit_before;
        let run2 = digit & digit_before;
        let run4 = run2 & (run2 << 2);
        let run8 = run4 & (run4 << 4);
        // The rules of `count_from`. Every byte of the region is a digit, a comma or a space,
        // and byte 0 is an id's first digit (after a separator), so an id's first digit always
        // follows a separator: a comma must follow a digit, a space a comma; no `0` before a
        // digit at an id's start, no 8 digits in a row.
        let bad = (comma & !digit_before)
            | (space & !(comma << 1))
            | (digit & ((start & m.zero) << 1))
            | run8;
        if bad != 0 {
            break;
        }
        // The k-th start and the k-th comma bound the k-th id (1 to 7 digits).
        let (mut starts, mut commas) = (start, comma);
        let mut end = 0;
        while commas != 0 && n < room {
            let s = starts.trailing_zeros() as usize;
            end = commas.trailing_zeros() as usize;
            starts &= starts.wrapping_sub(1);
            commas &= commas.wrapping_sub(1);
            let Some(bytes) = chunk.get(s..).and_then(<[u8]>::first_chunk::<8>) else {
                return (i, n);
            };
            // Digit values, the id's last digit shifted to the top byte (the bytes after it
            // out, zeros in for the missing leading digits).
            // (1 to 7 digits, checked above: a shift of 8 to 56; wrapping, so never a panic.)
            let len = end.wrapping_sub(s) as u32;
            let shift = 64u32.wrapping_sub(len.wrapping_mul(8));
            let d = (u64::from_le_bytes(*bytes) & (0x0F * ONES)).wrapping_shl(shift);
            out.put(n, eight_digits(d));
            n += 1;
        }
        // Past the last comma read, and one space after it.
        i += end + 1 + usize::from(chunk.get(end + 1) == Some(&b' '));
    }
    (i, n)
}

/// The index of the first non-whitespace byte at or after `i`.
fn skip_ws(text: &[u8], mut i: usize) -> usize {
    while text.get(i).copied().is_some_and(is_json_ws) {
        i += 1;
    }
    i
}

/// The unsigned integer literal at the start of `s` if it is a valid JSON number on its own (no
/// leading zero) that fits in a u32, with its length in bytes. The byte after it is not a digit.
/// Up to 7 digits are read at once from 8 bytes (SWAR), without a branch per digit.
pub(super) fn parse_token_id(s: &[u8]) -> Option<(u32, usize)> {
    const ONES: u64 = 0x0101_0101_0101_0101;
    if let Some(chunk) = s.get(..8) {
        let x = u64::from_le_bytes(chunk.try_into().ok()?);
        // Per byte (exact up to the first non-digit; a carry only reaches later bytes): zero
        // iff the high nibble is 3 and the low nibble at most 9.
        let high = (x & (0xF0 * ONES)) ^ (0x30 * ONES);
        let low = (x.wrapping_add(0x06 * ONES) & (0xF0 * ONES)) ^ (0x30 * ONES);
        let digits = ((high | low).trailing_zeros() / 8) as usize;
        if digits == 0 || (digits > 1 && s.first() == Some(&b'0')) {
            return None;
        }
        if digits < 8 {
            // Digit values, most significant first in memory, shifted up so that the missing
            // leading digits read as zeros.
            let v = (x & (0x0F * ONES)) << (8 * (8 - digits));
            return Some((eight_digits(v), digits));
        }
    }
    // Eight or more digits, or fewer than eight bytes left.
    let digits = s.iter().take(11).take_while(|b| b.is_ascii_digit()).count();
    if digits == 0 || digits > 10 || (digits > 1 && s.first() == Some(&b'0')) {
        return None;
    }
    let value = s
        .get(..digits)?
        .iter()
        .fold(0u64, |acc, &d| acc * 10 + u64::from(d - b'0'));
    Some((u32::try_from(value).ok()?, digits))
}

/// The value of 8 decimal digits (byte values 0-9, most significant at the lowest address).
/// It is below 10^8, which a u32 holds, so the final cast keeps every bit of it.
#[inline(always)]
fn eight_digits(v: u64) -> u32 {
    let v = v.wrapping_mul(10 << 8 | 1) >> 8; // pairs
    let v = (v & 0x00FF_00FF_00FF_00FF).wrapping_mul(100 << 16 | 1) >> 16; // quads
    let v = (v & 0x0000_FFFF_0000_FFFF).wrapping_mul(10_000 << 32 | 1) >> 32;
    v as u32
}

/// `(first, close, count)` of a token array in the common shape: the offset of the first id's
/// first digit, of the closing `]`, and the number of ids, all relative to `text` (which starts
/// at the array's `[`). See [`count_from`]; `None` also for an empty array.
#[cfg(test)]
pub(crate) fn count_token_ids(text: &[u8]) -> Option<(usize, usize, usize)> {
    if text.first() != Some(&b'[') {
        return None;
    }
    let first = skip_ws(text, 1);
    let (close, count) = count_from(text, first)?;
    Some((first, close, count))
}

/// Checks and counts the ids of a token array from `text[first..]` (an id's first digit, after
/// `[` or a separator) to its `]`: `(close, count)`, the offset of the `]` and the number of ids
/// from `first` on.
///
/// Only the common shape is accepted: ids of 1 to 7 digits (no leading zero) separated by
/// exactly `,` or `, `, and `]` right after the last id. Such an array is one
/// [`scan_token_ids`] reads, with the same ids; `None` for anything else, valid or not (the
/// caller then reads the array with [`scan_token_ids`], which gives every answer it always did).
///
/// No id's value is computed: 64 bytes at a time, vector compares give bit masks of the digits,
/// commas, spaces and zeros, and a few mask operations check the shape (a comma only after a
/// digit, a space only after a comma, an id only after a comma or a space, no `0` followed by a
/// digit at an id's start, no run of 8 digits); the commas are counted. Masks carry their last
/// bits into the next 64 bytes.
pub(crate) fn count_from(text: &[u8], first: usize) -> Option<(usize, usize)> {
    if !text.get(first)?.is_ascii_digit() {
        return None;
    }
    // The previous 64 bytes' masks (before the first id: a separator, nothing else).
    let mut prev = Carry {
        digit: 0,
        comma: 0,
        sep: 1 << 63,
        zero_start: 0,
        run2: 0,
        run4: 0,
    };
    let mut commas = 0usize;
    let mut at = first;
    let mut padded = [0u8; 64];
    loop {
        let chunk = match text.get(at..).and_then(<[u8]>::first_chunk::<64>) {
            Some(chunk) => chunk,
            None => {
                // The last bytes, padded with NULs (not a digit, comma or space).
                let rest = text.get(at..)?;
                padded.get_mut(..rest.len())?.copy_from_slice(rest);
                &padded
            }
        };
        let m = masks64(chunk);
        let other = !(m.digit | m.comma | m.space);
        // Only the bytes before the first other byte count (all if there is none).
        let valid = (other & other.wrapping_neg()).wrapping_sub(1);
        let digit = m.digit & valid;
        let comma = m.comma & valid;
        let space = m.space & valid;
        let sep = comma | space;
        let digit_before = digit << 1 | prev.digit >> 63;
        let comma_before = comma << 1 | prev.comma >> 63;
        let start = digit & !digit_before;
        let zero_start = start & m.zero;
        let run2 = digit & digit_before;
        let run4 = run2 & (run2 << 2 | prev.run2 >> 62);
        let run8 = run4 & (run4 << 4 | prev.run4 >> 60);
        let bad = (comma & !digit_before)
            | (space & !comma_before)
            | (start & !(sep << 1 | prev.sep >> 63))
            | (digit & (zero_start << 1 | prev.zero_start >> 63))
            | run8;
        if bad != 0 {
            return None;
        }
        commas += comma.count_ones() as usize;
        if other != 0 {
            // The first other byte must be the `]` right after the last id's digits.
            let p = other.trailing_zeros();
            let close = at + p as usize;
            let closes = text.get(close) == Some(&b']') && (digit_before >> p) & 1 == 1;
            return closes.then_some((close, commas + 1));
        }
        prev = Carry {
            digit,
            comma,
            sep,
            zero_start,
            run2,
            run4,
        };
        at += 64;
    }
}

/// The masks of the previous 64 bytes that [`count_token_ids`] carries over (their top bits).
struct Carry {
    digit: u64,
    comma: u64,
    sep: u64,
    zero_start: u64,
    run2: u64,
    run4: u64,
}

/// Bit `k` set iff byte `k` is a digit, a comma, a space, a `0`.
#[derive(Clone, Copy, Default)]
struct Masks {
    digit: u64,
    comma: u64,
    space: u64,
    zero: u64,
}

/// [`Masks`] of 64 bytes, 16 at a time.
#[inline(always)]
fn masks64(chunk: &[u8; 64]) -> Masks {
    let mut out = Masks::default();
    for (k, part) in chunk.chunks_exact(16).enumerate() {
        let Some(part) = part.first_chunk::<16>() else {
            continue;
        };
        let m = masks16(part);
        let shift = 16 * k as u32;
        out.digit |= m.digit << shift;
        out.comma |= m.comma << shift;
        out.space |= m.space << shift;
        out.zero |= m.zero << shift;
    }
    out
}

/// [`Masks`] of 16 bytes (the low 16 bits) with Wasm SIMD128 (V8 lowers each step to one or
/// two SSE instructions).
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
#[inline(always)]
fn masks16(chunk: &[u8; 16]) -> Masks {
    use core::arch::wasm32::{
        i8x16_eq, u8x16_bitmask, u8x16_lt, u8x16_splat, u8x16_sub, v128, v128_load,
    };
    // SAFETY: `simd128` is enabled for this build (the `cfg` above), and the load reads the 16
    // bytes of `chunk` (`v128_load` has no alignment requirement).
    let v = unsafe { v128_load(chunk.as_ptr().cast::<v128>()) };
    Masks {
        digit: u64::from(u8x16_bitmask(u8x16_lt(
            u8x16_sub(v, u8x16_splat(b'0')),
            u8x16_splat(10),
        ))),
        comma: u64::from(u8x16_bitmask(i8x16_eq(v, u8x16_splat(b',')))),
        space: u64::from(u8x16_bitmask(i8x16_eq(v, u8x16_splat(b' ')))),
        zero: u64::from(u8x16_bitmask(i8x16_eq(v, u8x16_splat(b'0')))),
    }
}

/// [`Masks`] of 16 bytes with SSE2 (every x86_64 CPU has it): the same steps as the Wasm SIMD
/// version, so that native instruction counts (callgrind) measure what the filter runs.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn masks16(chunk: &[u8; 16]) -> Masks {
    use core::arch::x86_64::{
        __m128i, _mm_cmpeq_epi8, _mm_cmpgt_epi8, _mm_loadu_si128, _mm_movemask_epi8, _mm_set1_epi8,
        _mm_sub_epi8,
    };
    // SAFETY: SSE2 is part of the x86_64 baseline (every x86_64 CPU has it), and the load reads
    // the 16 bytes of `chunk` (`_mm_loadu_si128` has no alignment requirement).
    unsafe {
        let v = _mm_loadu_si128(chunk.as_ptr().cast::<__m128i>());
        // Digits become -128..=-119 (signed), every other byte something larger.
        let shifted = _mm_sub_epi8(v, _mm_set1_epi8((b'0' ^ 0x80) as i8));
        let digit = _mm_cmpgt_epi8(_mm_set1_epi8(-118), shifted);
        // `movemask` sets only the low 16 bits.
        Masks {
            digit: u64::from(_mm_movemask_epi8(digit) as u16),
            comma: u64::from(
                _mm_movemask_epi8(_mm_cmpeq_epi8(v, _mm_set1_epi8(b',' as i8))) as u16,
            ),
            space: u64::from(
                _mm_movemask_epi8(_mm_cmpeq_epi8(v, _mm_set1_epi8(b' ' as i8))) as u16,
            ),
            zero: u64::from(_mm_movemask_epi8(_mm_cmpeq_epi8(v, _mm_set1_epi8(b'0' as i8))) as u16),
        }
    }
}

/// [`Masks`] of 16 bytes, one byte at a time (other targets; the reference for the SIMD ones).
#[cfg_attr(
    any(
        target_arch = "x86_64",
        all(target_arch = "wasm32", target_feature = "simd128")
    ),
    allow(dead_code)
)]
#[inline(always)]
fn masks16_portable(chunk: &[u8; 16]) -> Masks {
    let mut m = Masks::default();
    for (k, &b) in chunk.iter().enumerate() {
        m.digit |= u64::from(b.is_ascii_digit()) << k;
        m.comma |= u64::from(b == b',') << k;
        m.space |= u64::from(b == b' ') << k;
        m.zero |= u64::from(b == b'0') << k;
    }
    m
}

#[cfg(not(any(
    target_arch = "x86_64",
    all(target_arch = "wasm32", target_feature = "simd128")
)))]
#[inline(always)]
fn masks16(chunk: &[u8; 16]) -> Masks {
    masks16_portable(chunk)
}

/// The offset of the `]` that ends the token array `text` starts with (at its `[`), if nothing
/// before it is a `"`, `[` or `{` (so that it is the array's end if the array is one of ids);
/// 16 bytes at a time. Nothing else is checked: [`TokenReader`] checks the ids.
pub(crate) fn array_end(text: &[u8]) -> Option<usize> {
    if text.first() != Some(&b'[') {
        return None;
    }
    let mut at = 1;
    // 64 bytes at a time while none of them is one looked for (most of a long array).
    while let Some(chunk) = text.get(at..).and_then(<[u8]>::first_chunk::<64>) {
        if any_bracket64(chunk) {
            break;
        }
        at += 64;
    }
    let mut padded = [0u8; 16];
    loop {
        let chunk = match text.get(at..).and_then(<[u8]>::first_chunk::<16>) {
            Some(chunk) => chunk,
            None => {
                // The last bytes, padded with NULs (none of the bytes looked for).
                let rest = text.get(at..)?;
                padded.get_mut(..rest.len())?.copy_from_slice(rest);
                &padded
            }
        };
        let (close, nested) = brackets16(chunk);
        if close | nested != 0 {
            let p = (close | nested).trailing_zeros();
            let end = at + p as usize;
            return ((close >> p) & 1 == 1 && end < text.len()).then_some(end);
        }
        if at + 16 > text.len() {
            return None;
        }
        at += 16;
    }
}

/// Whether any of 64 bytes may be a `]`, `"`, `[` or `{`: true if one is, and for other bytes
/// above `?` (letters; never in an array of ids), which the 16-byte loop then sorts out. Two
/// compares per 16 bytes instead of four (Wasm SIMD128).
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
#[inline(always)]
fn any_bracket64(chunk: &[u8; 64]) -> bool {
    use core::arch::wasm32::{
        i8x16_eq, i8x16_gt, u8x16_splat, v128, v128_any_true, v128_load, v128_or,
    };
    let mut any = u8x16_splat(0);
    for part in chunk.chunks_exact(16) {
        // SAFETY: `simd128` is enabled for this build (the `cfg` above), and the load reads the
        // 16 bytes of `part` (`v128_load` has no alignment requirement).
        let v = unsafe { v128_load(part.as_ptr().cast::<v128>()) };
        // `[`, `]`, `{` are above `?` (signed: bytes from 0x80 are below, and none of the four).
        let high = i8x16_gt(v, u8x16_splat(b'?'));
        any = v128_or(any, v128_or(high, i8x16_eq(v, u8x16_splat(b'"'))));
    }
    v128_any_true(any)
}

/// [`any_bracket64`] with SSE2.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn any_bracket64(chunk: &[u8; 64]) -> bool {
    use core::arch::x86_64::{
        __m128i, _mm_cmpeq_epi8, _mm_cmpgt_epi8, _mm_loadu_si128, _mm_movemask_epi8, _mm_or_si128,
        _mm_set1_epi8, _mm_setzero_si128,
    };
    // SAFETY: SSE2 is part of the x86_64 baseline, and each load reads 16 bytes of `chunk`
    // (`_mm_loadu_si128` has no alignment requirement).
    unsafe {
        let mut any = _mm_setzero_si128();
        for part in chunk.chunks_exact(16) {
            let v = _mm_loadu_si128(part.as_ptr().cast::<__m128i>());
            let high = _mm_cmpgt_epi8(v, _mm_set1_epi8(b'?' as i8));
            let quote = _mm_cmpeq_epi8(v, _mm_set1_epi8(b'"' as i8));
            any = _mm_or_si128(any, _mm_or_si128(high, quote));
        }
        _mm_movemask_epi8(any) != 0
    }
}

/// [`any_bracket64`], one byte at a time (other targets).
#[cfg(not(any(
    target_arch = "x86_64",
    all(target_arch = "wasm32", target_feature = "simd128")
)))]
#[inline(always)]
fn any_bracket64(chunk: &[u8; 64]) -> bool {
    chunk.iter().any(|&b| b == b'"' || (b as i8) > b'?' as i8)
}

/// Bits of the `]` bytes and of the `"`, `[` and `{` bytes of 16 bytes (Wasm SIMD128).
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
#[inline(always)]
fn brackets16(chunk: &[u8; 16]) -> (u32, u32) {
    use core::arch::wasm32::{i8x16_eq, u8x16_bitmask, u8x16_splat, v128, v128_load, v128_or};
    // SAFETY: `simd128` is enabled for this build (the `cfg` above), and the load reads the 16
    // bytes of `chunk` (`v128_load` has no alignment requirement).
    let v = unsafe { v128_load(chunk.as_ptr().cast::<v128>()) };
    let nested = v128_or(
        i8x16_eq(v, u8x16_splat(b'"')),
        v128_or(
            i8x16_eq(v, u8x16_splat(b'[')),
            i8x16_eq(v, u8x16_splat(b'{')),
        ),
    );
    (
        u32::from(u8x16_bitmask(i8x16_eq(v, u8x16_splat(b']')))),
        u32::from(u8x16_bitmask(nested)),
    )
}

/// Bits of the `]` bytes and of the `"`, `[` and `{` bytes of 16 bytes (SSE2).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn brackets16(chunk: &[u8; 16]) -> (u32, u32) {
    use core::arch::x86_64::{
        __m128i, _mm_cmpeq_epi8, _mm_loadu_si128, _mm_movemask_epi8, _mm_or_si128, _mm_set1_epi8,
    };
    // SAFETY: SSE2 is part of the x86_64 baseline, and the load reads the 16 bytes of `chunk`
    // (`_mm_loadu_si128` has no alignment requirement).
    unsafe {
        let v = _mm_loadu_si128(chunk.as_ptr().cast::<__m128i>());
        let eq = |b: u8| _mm_cmpeq_epi8(v, _mm_set1_epi8(b as i8));
        let nested = _mm_or_si128(eq(b'"'), _mm_or_si128(eq(b'['), eq(b'{')));
        (
            u32::from(_mm_movemask_epi8(eq(b']')) as u16),
            u32::from(_mm_movemask_epi8(nested) as u16),
        )
    }
}

/// Bits of the `]` bytes and of the `"`, `[` and `{` bytes of 16 bytes (other targets).
#[cfg(not(any(
    target_arch = "x86_64",
    all(target_arch = "wasm32", target_feature = "simd128")
)))]
#[inline(always)]
fn brackets16(chunk: &[u8; 16]) -> (u32, u32) {
    let (mut close, mut nested) = (0, 0);
    for (k, &b) in chunk.iter().enumerate() {
        close |= u32::from(b == b']') << k;
        nested |= u32::from(matches!(b, b'"' | b'[' | b'{')) << k;
    }
    (close, nested)
}

/// Reads a token array's ids on demand, checking them as [`scan_token_ids`] does (the same ids,
/// and the same arrays refused), a block at a time; [`TokenReader::finish`] checks and counts
/// the ids not read.
#[derive(Clone, Debug)]
pub struct TokenReader<'a> {
    /// From the array's `[` to the end of the body.
    text: &'a [u8],
    /// Where the next id starts (after whitespace, if any).
    pos: usize,
    /// Ids read so far.
    read: usize,
    state: ReaderState,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ReaderState {
    Open,
    /// The `]` was read.
    Ended,
    /// Not an array [`scan_token_ids`] reads.
    Failed,
}

impl<'a> TokenReader<'a> {
    pub(super) fn new(text: &'a [u8]) -> Self {
        let mut reader = TokenReader {
            text,
            pos: skip_ws(text, 1),
            read: 0,
            state: ReaderState::Open,
        };
        if text.first() != Some(&b'[') {
            reader.state = ReaderState::Failed;
        } else if text.get(reader.pos) == Some(&b']') {
            reader.state = ReaderState::Ended;
        }
        reader
    }

    /// Fills `out` with the next ids; `None` if fewer are left (the ids of a last partial block
    /// are counted, not returned) or the array is not one of ids.
    pub fn read_block<O: IdOut + ?Sized>(&mut self, out: &mut O) -> Option<()> {
        if self.state != ReaderState::Open {
            return None;
        }
        let text = self.text;
        let room = out.room();
        let mut n = 0;
        let mut i = self.pos;
        while n < room {
            // The common case, 64 bytes then one id at a time; each stops at an id's first
            // byte or after a comma.
            (i, n) = mask_run(text, i, out, n);
            (i, n) = comma_run(text, i, out, n);
            if n == room {
                break;
            }
            // One id the general way (as `scan_token_ids`).
            i = skip_ws(text, i);
            let Some((id, len)) = text.get(i..).and_then(parse_token_id) else {
                self.state = ReaderState::Failed;
                return None;
            };
            out.put(n, id);
            n += 1;
            i = skip_ws(text, i + len);
            match text.get(i) {
                Some(b',') => i = skip_ws(text, i + 1),
                Some(b']') => {
                    self.state = ReaderState::Ended;
                    self.read += n;
                    return (n == room).then_some(());
                }
                _ => {
                    self.state = ReaderState::Failed;
                    return None;
                }
            }
        }
        self.pos = i;
        self.read += n;
        Some(())
    }

    /// The number of ids in the whole array (read or not), checking the ids not read; `None` if
    /// it is not an array [`scan_token_ids`] reads. Reading may go on afterwards.
    pub fn finish(&self) -> Option<usize> {
        match self.state {
            ReaderState::Failed => None,
            ReaderState::Ended => Some(self.read),
            ReaderState::Open => {
                let at = skip_ws(self.text, self.pos);
                match count_from(self.text, at) {
                    Some((_, rest)) => Some(self.read + rest),
                    // Not the common shape: the whole array the exact way.
                    None => scan_token_ids(self.text).map(|(ids, _)| ids.len()),
                }
            }
        }
    }
}

/// Which object the structural scan is in.
#[derive(Clone, Copy)]
enum Level {
    Top,
    Nvext,
}

/// The fast pass's structural scan: walks the top-level object and `nvext` (skipping every other
/// value by its brackets and strings, without validating it) and cuts out token arrays.
/// Any surprise is `None`.
struct Scan<'a> {
    body: &'a [u8],
    pos: usize,
    endpoint: Endpoint,
    /// Leave the ids of arrays [`count_token_ids`] accepts unread ([`TokenSpan`]s).
    lazy: bool,
    /// Byte ranges of the cut arrays, in body order.
    cuts: Vec<(usize, usize)>,
    prompts: Vec<Option<Tokens>>,
    token_data: Vec<Option<Tokens>>,
}

impl<'a> Scan<'a> {
    fn peek(&self) -> Option<u8> {
        self.body.get(self.pos).copied()
    }

    /// Skips whitespace; the next byte.
    fn ws(&mut self) -> Option<u8> {
        let skip = self
            .body
            .get(self.pos..)?
            .iter()
            .position(|&b| !is_json_ws(b))?;
        self.pos += skip;
        self.peek()
    }

    fn eat(&mut self, want: u8) -> Option<()> {
        (self.ws()? == want).then(|| self.pos += 1)
    }

    /// A string (after whitespace): its raw content, `None` if it contains an escape.
    fn string(&mut self) -> Option<Option<&'a [u8]>> {
        self.eat(b'"')?;
        let start = self.pos;
        let mut escaped = false;
        loop {
            let rest = self.body.get(self.pos..)?;
            self.pos += rest.iter().position(|&b| b == b'"' || b == b'\\')?;
            if self.peek()? == b'"' {
                let content = self.body.get(start..self.pos)?;
                self.pos += 1;
                return Some((!escaped).then_some(content));
            }
            escaped = true;
            self.pos += 2; // the backslash and the byte it escapes (`\uXXXX`: plain hex follows)
        }
    }

    /// Skips one value (after whitespace) by its structure.
    fn value(&mut self) -> Option<()> {
        match self.ws()? {
            b'"' => self.string().map(drop),
            b'[' | b'{' => {
                let mut depth = 0usize;
                loop {
                    match self.peek()? {
                        b'"' => {
                            self.string()?;
                            continue;
                        }
                        b'[' | b'{' => depth += 1,
                        b']' | b'}' => {
                            depth = depth.checked_sub(1)?;
                            if depth == 0 {
                                self.pos += 1;
                                return Some(());
                            }
                        }
                        _ => {}
                    }
                    self.pos += 1;
                }
            }
            _ => {
                let rest = self.body.get(self.pos..)?;
                let len = rest
                    .iter()
                    .position(|&b| matches!(b, b',' | b'}' | b']') || is_json_ws(b))
                    .unwrap_or(rest.len());
                if len == 0 {
                    return None;
                }
                self.pos += len;
                Some(())
            }
        }
    }

    /// An object (after whitespace); at `Level::Top` also descends into an `nvext` object.
    fn object(&mut self, level: Level) -> Option<()> {
        self.eat(b'{')?;
        if self.ws()? == b'}' {
            self.pos += 1;
            return Some(());
        }
        loop {
            // A key with escapes could spell a field serde would recognize: give up.
            let key = self.string()??;
            self.eat(b':')?;
            let first = self.ws()?;
            match (level, key) {
                (Level::Top, b"prompt") if self.endpoint == Endpoint::Completions => {
                    let entry = self.token_array()?;
                    self.prompts.push(entry);
                }
                (Level::Top, b"nvext") if first == b'{' => self.object(Level::Nvext)?,
                (Level::Nvext, b"token_data") => {
                    let entry = self.token_array()?;
                    self.token_data.push(entry);
                }
                _ => self.value()?,
            }
            match self.ws()? {
                b',' => self.pos += 1,
                b'}' => {
                    self.pos += 1;
                    return Some(());
                }
                _ => return None,
            }
        }
    }

    /// A token field's value (after whitespace): cut out if [`count_token_ids`] (lazy) or
    /// [`scan_token_ids`] reads it.
    fn token_array(&mut self) -> Option<Option<Tokens>> {
        let start = self.pos;
        let text = self.body.get(start..)?;
        if self.lazy {
            if let Some(close) = array_end(text) {
                self.pos += close + 1;
                self.cuts.push((start, self.pos));
                return Some(Some(Tokens::Span(TokenSpan {
                    open: start,
                    count: None,
                })));
            }
        }
        match scan_token_ids(text) {
            Some((ids, len)) => {
                self.pos += len;
                self.cuts.push((start, self.pos));
                Some(Some(Tokens::Ids(ids)))
            }
            None => {
                self.value()?;
                Some(None)
            }
        }
    }
}
