//! Picking one slot: among scored candidates (argmin with uniformly random ties, or softmax), or by
//! one of the basic modes. All randomness comes from the caller's [`Rng`], so every pick is
//! reproducible from a seed.
//!
//! "Load" in the basic modes is the slot's in-flight request count from the load table.

use crate::config::{Config, Device};
use crate::load::SlotLoad;
use crate::rng::Rng;
use crate::types::SlotIdx;

/// Costs within this relative distance of each other are ties.
const TIE_EPSILON: f64 = 1e-9;

fn tied(a: f64, b: f64) -> bool {
    // An infinity ties only with itself (its distance to a finite cost is within an infinite
    // tolerance, which would make it a minimum).
    a == b || (a - b).abs() <= TIE_EPSILON * a.abs().max(b.abs()).max(1.0) && (a - b).is_finite()
}

/// A cost above this does not tie with `min` when no cost is below `min`: for `c >= min`,
/// `tied(c, min)` needs `c - min <= eps * max(|c|, |min|, 1)`, which for `c >= 0` means
/// `c <= (min + eps * (|min| + 1)) / (1 - eps)` and for `c < 0` (so `|c| <= |min|`)
/// `c <= min + eps * (|min| + 1)`; both are below `min + 4 * eps * (|min| + 1)`, whose rounding
/// is far smaller than the slack.
fn tie_bound(min: f64) -> f64 {
    let bound = min + 4.0 * TIE_EPSILON * (min.abs() + 1.0);
    // `min` = -inf: -inf ties with it.
    if bound.is_nan() {
        f64::INFINITY
    } else {
        bound
    }
}

/// Index (into `costs`) of a minimum cost; ties are broken uniformly at random. `None` if empty.
pub fn argmin_random_ties(costs: &[f64], rng: &mut Rng) -> Option<usize> {
    let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
    argmin_given_min(costs, min, rng)
}

/// [`argmin_random_ties`] when the caller already folded `min` (`f64::min` over `costs`, from
/// `f64::INFINITY`) while computing the costs.
pub fn argmin_given_min(costs: &[f64], min: f64, rng: &mut Rng) -> Option<usize> {
    // The `rng.index(ties)`-th tie, without collecting the ties: one pass counts them and keeps
    // the first (the usual pick: a single tie), a second finds any later one.
    // No cost above `near` ties with `min` (see `tie_bound`): most are rejected by one compare.
    let near = tie_bound(min);
    let mut ties = 0usize;
    let mut first = None;
    for (i, &c) in costs.iter().enumerate() {
        if c <= near && tied(c, min) {
            first = first.or(Some(i));
            ties += 1;
        }
    }
    match rng.index(ties) {
        0 => first,
        nth => costs
            .iter()
            .enumerate()
            .filter(|(_, c)| tied(**c, min))
            .nth(nth)
            .map(|(i, _)| i),
    }
}

/// Softmax probabilities over min-max normalised costs:
/// `p_i ∝ exp(-(c_i - c_min) / ((c_max - c_min) * temperature))`; uniform when all costs are
/// equal. `temperature` must be `> 0`.
pub fn softmax_probabilities(costs: &[f64], temperature: f64) -> Vec<f64> {
    if costs.is_empty() {
        return Vec::new();
    }
    let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
    let max = costs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let uniform = vec![1.0 / costs.len() as f64; costs.len()];
    if tied(min, max) || temperature <= 0.0 {
        return uniform;
    }
    let scale = (max - min) * temperature;
    let weights: Vec<f64> = costs.iter().map(|c| (-(c - min) / scale).exp()).collect();
    let sum: f64 = weights.iter().sum();
    if !(sum.is_finite() && sum > 0.0) {
        return uniform;
    }
    weights.into_iter().map(|w| w / sum).collect()
}

/// Samples an index from [`softmax_probabilities`].
pub fn softmax_pick(costs: &[f64], temperature: f64, rng: &mut Rng) -> Option<usize> {
    let probs = softmax_probabilities(costs, temperature);
    let last = probs.len().checked_sub(1)?;
    let mut r = rng.next_f64();
    for (i, p) in probs.iter().enumerate() {
        if r < *p {
            return Some(i);
        }
        r -= p;
    }
    Some(last)
}

/// The KV pick: argmin with random ties at temperature 0, softmax above.
pub fn pick_by_cost(costs: &[f64], temperature: f64, rng: &mut Rng) -> Option<usize> {
    let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
    pick_by_cost_given_min(costs, min, temperature, rng)
}

/// [`pick_by_cost`] with the costs' minimum already folded (see [`argmin_given_min`]).
pub fn pick_by_cost_given_min(
    costs: &[f64],
    min: f64,
    temperature: f64,
    rng: &mut Rng,
) -> Option<usize> {
    if temperature > 0.0 {
        softmax_pick(costs, temperature, rng)
    } else {
        argmin_given_min(costs, min, rng)
    }
}

fn in_flight(load: &[SlotLoad], slot: SlotIdx) -> u32 {
    load.get(usize::from(slot)).map_or(0, |l| l.active_requests)
}

pub fn random(candidates: &[SlotIdx], rng: &mut Rng) -> Option<SlotIdx> {
    candidates.get(rng.index(candidates.len())).copied()
}

/// `candidates[counter % len]`, then advances the counter.
pub fn round_robin(candidates: &[SlotIdx], counter: &mut u64) -> Option<SlotIdx> {
    if candidates.is_empty() {
        return None;
    }
    let i = (*counter % candidates.len() as u64) as usize;
    *counter = counter.wrapping_add(1);
    candidates.get(i).copied()
}

/// Fewest in-flight requests; uniformly random among ties.
pub fn least_loaded(candidates: &[SlotIdx], load: &[SlotLoad], rng: &mut Rng) -> Option<SlotIdx> {
    let min = candidates.iter().map(|s| in_flight(load, *s)).min()?;
    let ties: Vec<SlotIdx> = candidates
        .iter()
        .copied()
        .filter(|s| in_flight(load, *s) == min)
        .collect();
    random(&ties, rng)
}

/// Two distinct random candidates; the one with fewer in-flight requests wins (random on a tie).
pub fn power_of_two(candidates: &[SlotIdx], load: &[SlotLoad], rng: &mut Rng) -> Option<SlotIdx> {
    if candidates.len() < 2 {
        return candidates.first().copied();
    }
    let n = candidates.len();
    let i = rng.index(n);
    // A uniformly random j != i.
    let j = (i + 1 + rng.index(n - 1)) % n;
    let a = *candidates.get(i)?;
    let b = *candidates.get(j)?;
    let (la, lb) = (in_flight(load, a), in_flight(load, b));
    Some(match la.cmp(&lb) {
        std::cmp::Ordering::Less => a,
        std::cmp::Ordering::Greater => b,
        std::cmp::Ordering::Equal => {
            if rng.below(2) == 0 {
                a
            } else {
                b
            }
        }
    })
}

/// Dynamo's device-aware weighted mode: CPU and non-CPU groups compare
/// `in_flight(group) / (count(group) * weight)` (weight 1 for CPU, `config.device_ratio` for
/// GPU); the lower group wins (GPU on a tie) and least-loaded picks inside it. With one device
/// class present this is plain least-loaded.
pub fn device_aware_weighted(
    config: &Config,
    candidates: &[SlotIdx],
    load: &[SlotLoad],
    rng: &mut Rng,
) -> Option<SlotIdx> {
    let device_of = |s: SlotIdx| config.worker_of_slot(s).map_or(Device::Gpu, |w| w.device);
    let (cpu, gpu): (Vec<SlotIdx>, Vec<SlotIdx>) = candidates
        .iter()
        .partition(|s| device_of(**s) == Device::Cpu);
    if cpu.is_empty() || gpu.is_empty() {
        return least_loaded(candidates, load, rng);
    }
    let normalized = |group: &[SlotIdx], weight: f64| {
        let total: f64 = group.iter().map(|s| f64::from(in_flight(load, *s))).sum();
        total / (group.len() as f64 * weight)
    };
    let cpu_load = normalized(&cpu, 1.0);
    let gpu_load = normalized(&gpu, config.device_ratio);
    if cpu_load < gpu_load {
        least_loaded(&cpu, load, rng)
    } else {
        least_loaded(&gpu, load, rng)
    }
}

#[cfg(test)]
#[allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
mod tests {
    use super::*;

    fn loads(active: &[u32]) -> Vec<SlotLoad> {
        active
            .iter()
            .map(|a| SlotLoad {
                active_requests: *a,
                ..SlotLoad::default()
            })
            .collect()
    }

    #[test]
    fn argmin_breaks_ties_uniformly() {
        let costs = [5.0, 3.0, 3.0, 4.0, 3.0 + 1e-12];
        let mut rng = Rng::new(1);
        let mut counts = [0u32; 5];
        for _ in 0..30_000 {
            counts[argmin_random_ties(&costs, &mut rng).unwrap()] += 1;
        }
        assert_eq!(counts[0] + counts[3], 0);
        for i in [1, 2, 4] {
            assert!((9_000..11_000).contains(&counts[i]), "{counts:?}");
        }
        assert_eq!(argmin_random_ties(&[], &mut rng), None);
    }

    /// The argmin as it was written first (three passes, every cost compared with `tied`).
    fn argmin_by_three_passes(costs: &[f64], rng: &mut Rng) -> Option<usize> {
        let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
        let ties = costs.iter().filter(|c| tied(**c, min)).count();
        let nth = rng.index(ties);
        costs
            .iter()
            .enumerate()
            .filter(|(_, c)| tied(**c, min))
            .nth(nth)
            .map(|(i, _)| i)
    }

    /// The one-compare rejection never drops a tie: on costs clustered within and just past the
    /// tie distance (negative, signed zeros, huge, infinite, NaN), the pick and the random stream
    /// after it are those of the three-pass argmin.
    #[test]
    fn argmin_with_the_tie_bound_picks_as_three_passes() {
        let mut rng = Rng::new(3);
        let (mut multi, mut single) = (0, 0);
        for round in 0..20_000u64 {
            let base: f64 = [0.0, -0.0, 1.0, -1.0, 3.5, -250.0, 1e12, -1e12, 1e-300][rng.index(9)];
            let n = rng.index(12);
            let costs: Vec<f64> = (0..n)
                .map(|_| {
                    let scale = base.abs().max(1.0);
                    match rng.index(9) {
                        0 => f64::INFINITY,
                        1 => f64::NEG_INFINITY,
                        2 => f64::NAN,
                        // Around the tie distance: 0.5 to 3 epsilons away.
                        3 => base + scale * TIE_EPSILON * (0.5 + rng.index(6) as f64 * 0.5),
                        4 => base - scale * TIE_EPSILON * (0.5 + rng.index(6) as f64 * 0.5),
                        5 => base * (1.0 + TIE_EPSILON * rng.index(4) as f64),
                        _ => base + rng.index(3) as f64,
                    }
                })
                .collect();
            let seed = rng.next_u64();
            let (mut a, mut b) = (Rng::new(seed), Rng::new(seed));
            let want = argmin_by_three_passes(&costs, &mut a);
            assert_eq!(
                argmin_random_ties(&costs, &mut b),
                want,
                "round {round}: {costs:?}"
            );
            assert_eq!(
                a.next_u64(),
                b.next_u64(),
                "round {round}: the random stream moved"
            );
            let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
            match costs.iter().filter(|c| tied(**c, min)).count() {
                0 | 1 => single += 1,
                _ => multi += 1,
            }
        }
        assert!(multi > 2_000 && single > 2_000, "{multi} {single}");
    }

    #[test]
    fn softmax_matches_the_formula() {
        // Normalised 0, 0.5, 1 at T = 0.5: weights 1, e^-1, e^-2.
        let p = softmax_probabilities(&[10.0, 15.0, 20.0], 0.5);
        let w = [1.0, (-1.0f64).exp(), (-2.0f64).exp()];
        let s: f64 = w.iter().sum();
        for i in 0..3 {
            assert!((p[i] - w[i] / s).abs() < 1e-12);
        }
        assert_eq!(softmax_probabilities(&[7.0, 7.0], 1.0), vec![0.5, 0.5]);
        assert!(softmax_probabilities(&[], 1.0).is_empty());
    }

    #[test]
    fn softmax_sampling_follows_the_probabilities() {
        let costs = [10.0, 15.0, 20.0];
        let p = softmax_probabilities(&costs, 0.5);
        let mut rng = Rng::new(42);
        let n = 100_000;
        let mut counts = [0u32; 3];
        for _ in 0..n {
            counts[softmax_pick(&costs, 0.5, &mut rng).unwrap()] += 1;
        }
        for i in 0..3 {
            let f = f64::from(counts[i]) / f64::from(n);
            assert!((f - p[i]).abs() < 0.01, "slot {i}: {f} vs {}", p[i]);
        }
    }

    #[test]
    fn round_robin_cycles() {
        let mut c = 0;
        let picks: Vec<SlotIdx> = (0..7)
            .map(|_| round_robin(&[4, 5, 6], &mut c).unwrap())
            .collect();
        assert_eq!(picks, vec![4, 5, 6, 4, 5, 6, 4]);
        assert_eq!(round_robin(&[], &mut c), None);
    }

    #[test]
    fn least_loaded_picks_the_minimum_randomly_among_ties() {
        let load = loads(&[3, 1, 2, 1]);
        let mut rng = Rng::new(5);
        let mut counts = [0u32; 4];
        for _ in 0..10_000 {
            counts[usize::from(least_loaded(&[0, 1, 2, 3], &load, &mut rng).unwrap())] += 1;
        }
        assert_eq!(counts[0] + counts[2], 0);
        assert!((4_500..5_500).contains(&counts[1]), "{counts:?}");
    }

    #[test]
    fn power_of_two_never_picks_the_most_loaded_of_three() {
        // The most loaded of three can only win against itself, which distinct sampling forbids;
        // the least loaded wins every pair it is in (2 of 3 pairs).
        let load = loads(&[0, 5, 9]);
        let mut rng = Rng::new(9);
        let mut counts = [0u32; 3];
        let n = 30_000;
        for _ in 0..n {
            counts[usize::from(power_of_two(&[0, 1, 2], &load, &mut rng).unwrap())] += 1;
        }
        assert_eq!(counts[2], 0);
        let f0 = f64::from(counts[0]) / f64::from(n);
        assert!((f0 - 2.0 / 3.0).abs() < 0.02, "{counts:?}");
        assert_eq!(power_of_two(&[7], &load, &mut rng), Some(7));
    }
}
