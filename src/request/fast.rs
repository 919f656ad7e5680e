//! The fast pass for token ids: a structural scan cuts plain integer arrays out of the body and
//! reads them with a hand-written loop; the rest of the body still goes through the serde pass
//! (see the `request` module docs).

use std::cell::Cell;

use super::visitors::{parse_object, Prefill};
use super::{Endpoint, LlmRequest, ParseOptions};

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
        cuts: Vec::new(),
        prompts: Vec::new(),
        token_data: Vec::new(),
    };
    scan.object(Level::Top)?;
    if scan.cuts.is_empty() {
        return None;
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
    let req = parse_object(&copy, endpoint, Some(&prefill), opts).ok()?;
    let drained = prefill.prompts.take().is_empty() && prefill.token_data.take().is_empty();
    drained.then_some(req)
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
        (i, n) = comma_run(text, i, &mut ids, n);
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
fn comma_run(text: &[u8], mut i: usize, out: &mut [u32], mut n: usize) -> (usize, usize) {
    const ONES: u64 = 0x0101_0101_0101_0101;
    // `b ^ 0x30` of a comma and of a space.
    const COMMA: u8 = b',' ^ b'0';
    const SPACE: u8 = b' ' ^ b'0';
    let Some(last) = text.len().checked_sub(8) else {
        return (i, n);
    };
    while i <= last && n < out.len() {
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
        if let Some(slot) = out.get_mut(n) {
            *slot = eight_digits(d << (64 - bits));
        }
        n += 1;
        // Past the comma, and one space after it (`json.dumps` writes `, `); 7 digits: the
        // byte after the comma is not in the load (`tail >> 8` is 0), the next load sees it.
        i += (bits / 8) as usize + 1 + usize::from((tail >> 8) as u8 == SPACE);
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
    /// Byte ranges of the cut arrays, in body order.
    cuts: Vec<(usize, usize)>,
    prompts: Vec<Option<Vec<u32>>>,
    token_data: Vec<Option<Vec<u32>>>,
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

    /// A token field's value (after whitespace): cut out if [`scan_token_ids`] reads it.
    fn token_array(&mut self) -> Option<Option<Vec<u32>>> {
        let start = self.pos;
        match scan_token_ids(self.body.get(start..)?) {
            Some((ids, len)) => {
                self.pos += len;
                self.cuts.push((start, self.pos));
                Some(Some(ids))
            }
            None => {
                self.value()?;
                Some(None)
            }
        }
    }
}
