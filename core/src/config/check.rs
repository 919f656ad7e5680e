//! Field checks shared by the compile step and the sections' own checks: each names the field
//! in its [`ConfigError`].

use super::ConfigError;

/// Most coefficients a timing polynomial (ms, lowest degree first) may have.
pub const MAX_POLY_COEFFICIENTS: usize = 8;

/// Whether `poly` is a timing polynomial the filter accepts: 1 to 8 finite coefficients.
pub fn is_timing_poly(poly: &[f64]) -> bool {
    (1..=MAX_POLY_COEFFICIENTS).contains(&poly.len()) && poly.iter().all(|c| c.is_finite())
}

/// [`is_timing_poly`] as a configuration error naming the field (and the coefficient).
pub(super) fn timing_poly(field: &str, poly: &[f64]) -> Result<(), ConfigError> {
    if poly.is_empty() || poly.len() > MAX_POLY_COEFFICIENTS {
        return Err(ConfigError::OutOfRange {
            field: field.to_string(),
            expected: "a list of 1 to 8 coefficients (lowest degree first)",
            got: format!("{} coefficients", poly.len()),
        });
    }
    for (i, c) in poly.iter().enumerate() {
        f64_in(
            &format!("{field}[{i}]"),
            *c,
            f64::MIN,
            f64::MAX,
            "a finite number",
        )?;
    }
    Ok(())
}

pub(super) fn u64_in(
    field: &str,
    v: u64,
    lo: u64,
    hi: u64,
    expected: &'static str,
) -> Result<(), ConfigError> {
    if v >= lo && v <= hi {
        return Ok(());
    }
    Err(ConfigError::OutOfRange {
        field: field.to_string(),
        expected,
        got: v.to_string(),
    })
}

pub(super) fn f64_in(
    field: &str,
    v: f64,
    lo: f64,
    hi: f64,
    expected: &'static str,
) -> Result<(), ConfigError> {
    if v.is_finite() && v >= lo && v <= hi {
        return Ok(());
    }
    Err(ConfigError::OutOfRange {
        field: field.to_string(),
        expected,
        got: v.to_string(),
    })
}

pub(super) fn non_negative(field: &str, v: f64) -> Result<(), ConfigError> {
    f64_in(field, v, 0.0, f64::MAX, "finite and >= 0")
}

pub(super) fn positive(field: &str, v: f64) -> Result<(), ConfigError> {
    if v.is_finite() && v > 0.0 {
        return Ok(());
    }
    Err(ConfigError::OutOfRange {
        field: field.to_string(),
        expected: "finite and > 0",
        got: v.to_string(),
    })
}

pub(super) fn url_path(field: &str, p: &str) -> Result<(), ConfigError> {
    if !p.starts_with('/') || p.contains(['?', '#', ' ']) {
        return Err(ConfigError::Invalid {
            field: field.to_string(),
            detail: format!("\"{p}\" must be an absolute path starting with '/' without query, fragment or spaces"),
        });
    }
    Ok(())
}

pub(super) fn non_empty(field: &str, s: &str) -> Result<(), ConfigError> {
    if s.trim().is_empty() {
        return Err(ConfigError::Invalid {
            field: field.to_string(),
            detail: "must not be empty".to_string(),
        });
    }
    Ok(())
}
