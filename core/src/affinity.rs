//! Load-gated prefix affinity (the `affinity` option of `kv` mode): keep a request on the worker
//! holding its longest cached prefix unless that worker's load exceeds the least-loaded
//! candidate's by a configured margin. Pure: the caller falls back to the Dynamo cost on `None`.

use crate::config::AffinityConfig;
use crate::load::SlotLoad;
use crate::types::SlotIdx;

/// What the gate needs to know about one candidate slot.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AffinityCandidate {
    pub slot: SlotIdx,
    /// Device blocks of the prompt cached on the slot (0 when stale).
    pub overlap_blocks: u32,
    pub load: SlotLoad,
    /// The slot's Dynamo cost: breaks ties among max-overlap slots.
    pub cost: f64,
}

/// Active prefill tokens plus this request's uncached tokens on the slot.
fn prefill_work(c: &AffinityCandidate, isl_tokens: u32, block_size: u32) -> f64 {
    let cached = u64::from(c.overlap_blocks) * u64::from(block_size);
    let uncached = u64::from(isl_tokens).saturating_sub(cached);
    c.load.prefill_tokens + uncached as f64
}

/// The max-overlap slot (lowest cost among equals) when affinity applies and its load is within
/// the margins; `None` otherwise.
pub fn affine_slot(
    config: &AffinityConfig,
    candidates: &[AffinityCandidate],
    isl_tokens: u32,
    block_size: u32,
) -> Option<SlotIdx> {
    let max_overlap = candidates.iter().map(|c| c.overlap_blocks).max()?;
    if max_overlap < config.min_overlap_blocks {
        return None;
    }
    let best = candidates
        .iter()
        .filter(|c| c.overlap_blocks == max_overlap)
        .min_by(|a, b| a.cost.total_cmp(&b.cost))?;
    let least_work = candidates
        .iter()
        .map(|c| prefill_work(c, isl_tokens, block_size))
        .fold(f64::INFINITY, f64::min);
    let fewest_requests = candidates
        .iter()
        .map(|c| c.load.active_requests)
        .min()
        .unwrap_or(0);
    // Compared as f64: a NaN load fails the gate and leaves the decision to the cost.
    let extra_work = prefill_work(best, isl_tokens, block_size) - least_work;
    let extra_requests = best.load.active_requests.saturating_sub(fewest_requests);
    (extra_work <= config.max_extra_prefill_tokens as f64
        && extra_requests <= config.max_extra_requests)
        .then_some(best.slot)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    fn cand(
        slot: SlotIdx,
        overlap: u32,
        prefill: f64,
        active: u32,
        cost: f64,
    ) -> AffinityCandidate {
        AffinityCandidate {
            slot,
            overlap_blocks: overlap,
            load: SlotLoad {
                prefill_tokens: prefill,
                decode_blocks: 0.0,
                active_requests: active,
            },
            cost,
        }
    }

    fn cfg(tokens: u64, requests: u32) -> AffinityConfig {
        AffinityConfig {
            min_overlap_blocks: 1,
            max_extra_prefill_tokens: tokens,
            max_extra_requests: requests,
        }
    }

    #[test]
    fn keeps_the_history_holder_within_the_margins() {
        // 100-block prompt of 16-token blocks; slot 1 holds 90 blocks but its cost is higher
        // (its queue and decode load), slot 0 is idle.
        let c = [cand(0, 0, 0.0, 0, 100.0), cand(1, 90, 1000.0, 3, 140.0)];
        // Work: slot 0 = 1600, slot 1 = 1000 + 160 = 1160: no extra work; 3 extra requests.
        assert_eq!(affine_slot(&cfg(0, 3), &c, 1600, 16), Some(1));
        assert_eq!(affine_slot(&cfg(0, 2), &c, 1600, 16), None);
        // A long queue on the holder: work 5000 + 160 vs 1600 = 3560 extra.
        let c = [cand(0, 0, 0.0, 0, 100.0), cand(1, 90, 5000.0, 0, 400.0)];
        assert_eq!(affine_slot(&cfg(3560, 0), &c, 1600, 16), Some(1));
        assert_eq!(affine_slot(&cfg(3559, 0), &c, 1600, 16), None);
    }

    #[test]
    fn ties_on_overlap_go_to_the_cheaper_and_no_overlap_means_no_affinity() {
        let c = [
            cand(4, 10, 0.0, 0, 30.0),
            cand(5, 10, 0.0, 0, 20.0),
            cand(6, 2, 0.0, 0, 1.0),
        ];
        assert_eq!(affine_slot(&cfg(1 << 20, 8), &c, 320, 16), Some(5));
        let none = [cand(0, 0, 0.0, 0, 1.0), cand(1, 0, 0.0, 0, 2.0)];
        assert_eq!(affine_slot(&cfg(1 << 20, 8), &none, 320, 16), None);
        let mut min3 = cfg(1 << 20, 8);
        min3.min_overlap_blocks = 11;
        assert_eq!(affine_slot(&min3, &c, 320, 16), None);
        assert_eq!(affine_slot(&cfg(0, 0), &[], 320, 16), None);
        // A NaN load fails the gate.
        let nan = [cand(0, 5, f64::NAN, 0, 1.0), cand(1, 0, 0.0, 0, 2.0)];
        assert_eq!(affine_slot(&cfg(1 << 20, 8), &nan, 320, 16), None);
    }
}
