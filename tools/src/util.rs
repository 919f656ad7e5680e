//! Small shared helpers: deterministic mixing, percentiles, poison-tolerant locking, `reqwest`
//! errors as `io::Error`.

use std::error::Error as _;
use std::io;
use std::sync::{Mutex, MutexGuard};

/// Locks a mutex, ignoring poisoning (a panicking handler must not wedge the server).
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// SplitMix64 finalizer: a fast, well-mixed 64-bit hash of `x`.
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Nearest-rank percentile (`p` in 0..=100) of an ascending-sorted slice; `None` if empty.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    let idx = rank.clamp(1, sorted.len()) - 1;
    sorted.get(idx).copied()
}

/// Arithmetic mean; `None` if empty.
pub fn mean(values: &[f64]) -> Option<f64> {
    if values.is_empty() {
        None
    } else {
        Some(values.iter().sum::<f64>() / values.len() as f64)
    }
}

/// Maps a `reqwest` error to an `io::Error` whose kind says what happened (`TimedOut`,
/// `ConnectionRefused`, ...) and whose message names the innermost cause.
pub fn to_io_error(e: reqwest::Error) -> io::Error {
    let mut kind = if e.is_timeout() {
        io::ErrorKind::TimedOut
    } else {
        io::ErrorKind::Other
    };
    let mut source = e.source();
    let mut innermost = None;
    while let Some(s) = source {
        if let Some(ioe) = s.downcast_ref::<io::Error>() {
            if kind == io::ErrorKind::Other {
                kind = ioe.kind();
            }
        }
        innermost = Some(s.to_string());
        source = s.source();
    }
    let msg = match innermost {
        Some(cause) => format!("{e}: {cause}"),
        None => e.to_string(),
    };
    io::Error::new(kind, msg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), Some(50.0));
        assert_eq!(percentile(&v, 99.0), Some(99.0));
        assert_eq!(percentile(&v, 100.0), Some(100.0));
        assert_eq!(percentile(&v, 0.0), Some(1.0));
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(mean(&[1.0, 2.0, 6.0]), Some(3.0));
        assert_ne!(splitmix64(1), splitmix64(2));
    }
}
