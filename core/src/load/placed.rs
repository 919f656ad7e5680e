//! How many requests every VM of this Envoy has placed on each slot: the request-share term's
//! memory ([`crate::router::SelectorState`]) made common to the process's VMs.
//!
//! The share term spreads new sessions by the requests each slot received lately. Counted per
//! VM, it sees only its own thread's requests (Envoy hands each connection to one worker
//! thread): each thread balances its own part, and the parts pile up. Each VM counts its
//! placements since its last tick; on the tick it adds them to the process's totals under one
//! shared-data key ([`KEY`]: one `u64` per slot, whatever the traffic) and reads back what the
//! other VMs added meanwhile, which joins its share term as requests placed now.
//!
//! In the simulator, two VMs of one Envoy (`loadgen sim --replicas-share-data --arms 'kv*2'`,
//! 5 runs, tuning traces) went from 52.7 to 50.7 ms TTFT mean on `s-agent11` and 42.0 to 41.0
//! on `conv7`, back to one VM's figures; 55.0 against 55.6 on `s-agent7`, within its runs'
//! spread. In a real Envoy (two worker threads), level on a conversation workload and 2% lower
//! on bursts. The same totals relayed between Envoy replicas through the bridges were tried
//! and not kept: the simulator predicted a small gain, the real replicas lost 2-11% TTFT mean
//! in three of four cases (docs/race/2026-12-07f/README.md).

use crate::store::SharedStore;

/// The process's placement totals: `slots` little-endian `u64`s.
pub const KEY: &str = "ekr.placed";

/// Attempts of the tick's compare-and-set before its placements wait for the next tick.
const CAS_ATTEMPTS: usize = 8;

/// Placements heard in one tick beyond which a slot's count is cut: a corrupt total must not
/// swamp the share term (no real slot receives as many in one tick).
const MAX_PER_TICK: u64 = 4096;

/// One VM's side of the exchange.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Placements {
    /// Per slot, this VM's placements not yet added to the shared totals.
    unshared: Vec<u32>,
    /// Per slot, the shared totals as this VM last read them (its own flushed ones included).
    seen: Vec<u64>,
}

impl Placements {
    /// This VM placed a request on `slot` (already in its own share term).
    pub fn note(&mut self, slots: usize, slot: usize) {
        if self.unshared.len() != slots {
            self.unshared.resize(slots, 0);
        }
        if let Some(n) = self.unshared.get_mut(slot) {
            *n = n.saturating_add(1);
        }
    }

    /// Adds this VM's placements to the process's totals and writes into `others` (one entry per
    /// slot) how many the other VMs placed on each slot since this VM's last exchange. `false`
    /// (and `others` all 0) when the store stayed contended: the placements wait for the next
    /// tick. A stored value of another length (the fleet changed) starts the totals again.
    pub fn exchange(
        &mut self,
        store: &dyn SharedStore,
        slots: usize,
        others: &mut Vec<u32>,
    ) -> bool {
        others.clear();
        others.resize(slots, 0);
        self.unshared.resize(slots, 0);
        for _ in 0..CAS_ATTEMPTS {
            let (bytes, cas) = store.get(KEY);
            let mut totals = decode(bytes.as_deref().unwrap_or_default(), slots);
            let fresh = totals.is_none();
            let totals = totals.get_or_insert_with(|| vec![0; slots]);
            if self.seen.len() != slots || fresh {
                // First exchange, or the totals started again: what is stored now is the past.
                self.seen.clear();
                self.seen.extend_from_slice(totals);
            }
            for (t, &mine) in totals.iter_mut().zip(&self.unshared) {
                *t = t.wrapping_add(u64::from(mine));
            }
            let unchanged = self.unshared.iter().all(|&n| n == 0) && !fresh;
            if unchanged || store.set(KEY, &encode(totals), cas).is_ok() {
                for (i, ((&total, seen), &mine)) in totals
                    .iter()
                    .zip(&mut self.seen)
                    .zip(&self.unshared)
                    .enumerate()
                {
                    let grown = total.wrapping_sub(*seen).wrapping_sub(u64::from(mine));
                    // A total that went down (the key was reset) counts as nothing new.
                    let grown = if grown > u64::MAX / 2 { 0 } else { grown };
                    if let Some(o) = others.get_mut(i) {
                        *o = u32::try_from(grown.min(MAX_PER_TICK)).unwrap_or(0);
                    }
                    *seen = total;
                }
                self.unshared.iter_mut().for_each(|n| *n = 0);
                return true;
            }
        }
        false
    }
}

/// The process's totals per slot, as stored; `None` for bytes of another length.
fn decode(bytes: &[u8], slots: usize) -> Option<Vec<u64>> {
    if bytes.len() != slots.checked_mul(8)? {
        return None;
    }
    Some(
        bytes
            .chunks_exact(8)
            .map(|c| c.try_into().map(u64::from_le_bytes).unwrap_or(0))
            .collect(),
    )
}

fn encode(totals: &[u64]) -> Vec<u8> {
    totals.iter().flat_map(|t| t.to_le_bytes()).collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use crate::store::fake::MemStore;

    #[test]
    fn each_vm_hears_what_the_others_placed_once() {
        let store = MemStore::new();
        let (mut a, mut b) = (Placements::default(), Placements::default());
        let mut others = Vec::new();
        assert!(a.exchange(&store, 3, &mut others));
        assert!(b.exchange(&store, 3, &mut others));
        a.note(3, 0);
        a.note(3, 0);
        a.note(3, 2);
        b.note(3, 1);
        assert!(a.exchange(&store, 3, &mut others));
        assert_eq!(others, vec![0, 0, 0], "nobody else placed yet");
        assert!(b.exchange(&store, 3, &mut others));
        assert_eq!(others, vec![2, 0, 1], "b hears a's, not its own");
        assert!(a.exchange(&store, 3, &mut others));
        assert_eq!(others, vec![0, 1, 0], "a hears b's");
        assert!(a.exchange(&store, 3, &mut others));
        assert_eq!(others, vec![0, 0, 0], "and only once");
        assert_eq!(decode(&store.get(KEY).0.unwrap(), 3), Some(vec![2, 1, 1]));
    }

    #[test]
    fn a_new_fleet_size_or_a_corrupt_key_starts_the_totals_again() {
        let store = MemStore::new();
        let mut a = Placements::default();
        let mut others = Vec::new();
        store.set(KEY, b"garbage", None).unwrap();
        a.note(2, 1);
        assert!(a.exchange(&store, 2, &mut others));
        assert_eq!(others, vec![0, 0]);
        assert_eq!(decode(&store.get(KEY).0.unwrap(), 2), Some(vec![0, 1]));
        assert!(a.exchange(&store, 4, &mut others));
        assert_eq!(others, vec![0; 4]);
        assert_eq!(decode(&store.get(KEY).0.unwrap(), 4), Some(vec![0; 4]));
    }
}
