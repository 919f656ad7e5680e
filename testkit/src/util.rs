//! Small shared helpers: deterministic mixing, percentiles (HDR histograms), poison-tolerant locking, `reqwest`
//! errors as `io::Error`.

use hdrhistogram::Histogram;
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

/// Values in milliseconds (or any unit) in an HDR histogram at a thousandth of the unit
/// (microseconds), 3 significant digits; negative values count as 0, non-finite ones are left
/// out. `None` when no value is left.
pub fn histogram(values: &[f64]) -> Option<Histogram<u64>> {
    let mut h = Histogram::<u64>::new(3).ok()?;
    for v in values.iter().filter(|v| v.is_finite()) {
        // Auto-resizing: recording only fails past u64::MAX / 2 microseconds.
        let _ = h.record((v * 1000.0).round().max(0.0) as u64);
    }
    (!h.is_empty()).then_some(h)
}

/// The `p` percentile (0..=100) of a histogram from [`histogram`], back in the values' unit.
pub fn quantile_of(h: &Histogram<u64>, p: f64) -> f64 {
    h.value_at_quantile((p / 100.0).clamp(0.0, 1.0)) as f64 / 1000.0
}

/// The `p` percentile (0..=100) of `values` (any order; see [`histogram`]); `None` if empty.
pub fn percentile(values: &[f64], p: f64) -> Option<f64> {
    histogram(values).map(|h| quantile_of(&h, p))
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
        // 3 significant digits: within 0.1% of the nearest rank.
        let near = |p: f64, want: f64| {
            let got = percentile(&v, p).unwrap_or(f64::NAN);
            assert!((got - want).abs() <= want * 1e-3, "p{p}: {got} vs {want}");
        };
        near(50.0, 50.0);
        near(99.0, 99.0);
        near(100.0, 100.0);
        near(0.0, 1.0);
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(percentile(&[f64::NAN], 50.0), None);
        assert_eq!(mean(&[1.0, 2.0, 6.0]), Some(3.0));
        assert_ne!(splitmix64(1), splitmix64(2));
    }
}
