//! The closed loop's tick side ([`crate::learn`]): the request path writes each streamed
//! response's first-token sample to its worker's shared record
//! (`crate::request_path::RoutingState::learn_first_token`); the tick reads the records back (a
//! bounded batch per tick) and recomputes the factors routing multiplies by.

use crate::config::Config;

use super::host::HostStore;
use super::vm::VmState;

/// Records read per tick: at 8 workers all of them, at 1,000 each one every ~16 ticks.
const RECORDS_PER_TICK: usize = 64;

impl VmState {
    /// The tick: reads the next batch of shared records and recomputes every factor.
    pub fn refresh_learned(&mut self, config: &Config, now: u64) {
        if !config.ttft.as_ref().is_some_and(|t| t.learn) {
            return;
        }
        let workers = config.workers.len();
        self.path
            .learned
            .read_next(&HostStore, workers, RECORDS_PER_TICK, now);
    }
}
