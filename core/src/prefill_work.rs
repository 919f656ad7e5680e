//! Prefill work: what a prompt costs its engine to compute, in token-equivalents that add up.
//!
//! The prefill polynomial (`load.prefill_time_ms_poly`, lowest degree first) beyond its
//! constant, `P`, is the compute of a prompt from scratch: linear layers per token and attention
//! growing with the square of the length. With chunked prefill every step's tokens attend to all
//! the tokens of their sequence before them, a cached prefix included, so `tokens` new tokens
//! after `context` cost `P(context + tokens) - P(context)`, whatever the step size. Divided by
//! the polynomial's linear rate, that is a *work* in tokens: for a short prompt about its
//! tokens, for a 191k-token prompt ~6x them. Works add up, so a worker's booked queue is the sum
//! of its prompts' own costs, not the polynomial of their summed tokens; and the cost's own term
//! credits a cached prefix with everything it saves, its attention included. Pure.

/// The polynomial's per-token rate (ms): its linear coefficient, else its mean rate over a
/// step of 8,192 tokens beyond its constant; `None` when neither is positive and finite.
pub fn token_rate_ms(poly: &[f64]) -> Option<f64> {
    let positive = |r: f64| (r.is_finite() && r > 0.0).then_some(r);
    let constant = poly.first().copied().unwrap_or(0.0);
    poly.get(1)
        .copied()
        .and_then(positive)
        .or_else(|| positive((horner(poly, 8192.0) - constant) / 8192.0))
}

/// A polynomial (lowest degree first) at `x`.
pub fn horner(poly: &[f64], x: f64) -> f64 {
    poly.iter().rev().fold(0.0, |acc, c| acc * x + c)
}

/// The work of `tokens` new tokens after `context` tokens of their sequence already in the KV
/// cache (a cached prefix, or the prompt's earlier steps), in token-equivalents (module docs).
/// Without a rate (a constant polynomial) the work is the tokens. Finite and `>= 0`.
pub fn prefill_work_tokens(poly: &[f64], tokens: f64, context: f64) -> f64 {
    if tokens.is_nan() || tokens <= 0.0 {
        return 0.0;
    }
    let Some(rate) = token_rate_ms(poly) else {
        return if tokens.is_finite() { tokens } else { 0.0 };
    };
    let constant = poly.first().copied().unwrap_or(0.0);
    let context = if context.is_finite() {
        context.max(0.0)
    } else {
        0.0
    };
    let beyond = |x: f64| horner(poly, x) - constant;
    let work = (beyond(context + tokens) - beyond(context)) / rate;
    if work.is_finite() {
        work.max(0.0)
    } else if tokens.is_finite() {
        tokens
    } else {
        0.0
    }
}

/// Coefficients kept by [`WorkShape`] (`load.prefill_time_ms_poly` has at most 8).
const MAX_COEFFICIENTS: usize = 8;

/// The polynomial's shape as the per-slot cost loop reads it: `P / rate` without the constant,
/// in a fixed array (`Copy`, no allocation, no lifetime).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WorkShape {
    /// `P`'s coefficients over the rate, lowest degree first (the constant 0; unused ones 0).
    scaled: [f64; MAX_COEFFICIENTS],
}

impl WorkShape {
    /// `None` without a rate, or with more coefficients than kept.
    pub fn of(poly: &[f64]) -> Option<WorkShape> {
        let rate = token_rate_ms(poly)?;
        if poly.len() > MAX_COEFFICIENTS {
            return None;
        }
        let mut scaled = [0.0; MAX_COEFFICIENTS];
        for (dst, c) in scaled.iter_mut().zip(poly).skip(1) {
            *dst = c / rate;
        }
        Some(WorkShape { scaled })
    }

    /// The work of a prompt of `tokens` from scratch (the same as [`prefill_work_tokens`]
    /// after no context; not clamped: callers take differences).
    #[inline]
    pub fn from_scratch(&self, tokens: f64) -> f64 {
        horner(&self.scaled, tokens)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const POLY: [f64; 3] = [16.5, 0.0152, 4.21e-7];

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * b.abs().max(1.0)
    }

    #[test]
    fn a_long_prompt_is_more_work_than_its_tokens_and_a_prefix_costs_attention() {
        let work = |t: f64, c: f64| prefill_work_tokens(&POLY, t, c);
        // Short prompts are about their tokens; 191k tokens ~6.3x theirs.
        assert!(work(500.0, 0.0) < 500.0 * 1.02);
        let long = work(191_373.0, 0.0) / 191_373.0;
        assert!(long > 6.0 && long < 6.5, "{long}");
        // The same 1,000 tokens after a 30,000-token prefix are ~2.7x the work.
        assert!(work(1_000.0, 30_000.0) > 2.6 * work(1_000.0, 0.0));
        // Works of consecutive pieces add up to the whole.
        assert!(close(
            work(10_000.0, 0.0) + work(5_000.0, 10_000.0),
            work(15_000.0, 0.0)
        ));
        // The shape the cost reads agrees.
        let shape = WorkShape::of(&POLY).unwrap();
        assert!(close(shape.from_scratch(15_000.0), work(15_000.0, 0.0)));
        assert!(close(
            shape.from_scratch(40_000.0) - shape.from_scratch(30_000.0),
            work(10_000.0, 30_000.0)
        ));
    }

    #[test]
    fn odd_polynomials_and_inputs_stay_finite() {
        // No per-token rate: the work is the tokens, and there is no shape.
        assert_eq!(prefill_work_tokens(&[5.0], 100.0, 50.0), 100.0);
        assert_eq!(WorkShape::of(&[5.0]), None);
        assert_eq!(WorkShape::of(&[0.0; 9]), None);
        // Only a quadratic term: its mean rate over a step.
        assert!(prefill_work_tokens(&[0.0, 0.0, 1e-6], 100.0, 0.0) > 0.0);
        for t in [0.0, -5.0, f64::NAN, f64::INFINITY] {
            let w = prefill_work_tokens(&POLY, t, 0.0);
            assert!(w.is_finite() && w >= 0.0, "{t}: {w}");
        }
        assert!(prefill_work_tokens(&POLY, 100.0, f64::NAN).is_finite());
        assert!(prefill_work_tokens(&[f64::NAN, 1.0], 100.0, 0.0).is_finite());
    }
}
