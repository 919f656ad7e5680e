//! The load table in one shared-data key, updated by every thread with CAS (get, edit, set with
//! the version read; retry on mismatch) so that no update is lost.

use super::host;
use crate::config::Config;
use crate::load::LoadTable;

const LOAD_KEY: &str = "ekr.load";
const CAS_ATTEMPTS: usize = 64;

/// Creates the key if absent, so later writers always have a CAS version to check.
pub fn init(config: &Config) {
    if host::shared_get(LOAD_KEY).0.is_none() {
        let _ = host::shared_set(LOAD_KEY, &LoadTable::new(config.slots.len()).encode(), None);
    }
}

pub fn read(config: &Config) -> LoadTable {
    let (bytes, _) = host::shared_get(LOAD_KEY);
    LoadTable::decode_or_fresh(bytes.as_deref().unwrap_or_default(), config.slots.len()).0
}

/// Applies `edit` atomically; an edit that returns `None` changed nothing and writes nothing.
/// Returns the edit's result, or `None` when it declined or contention outlasted the retries.
pub fn update<R>(config: &Config, mut edit: impl FnMut(&mut LoadTable) -> Option<R>) -> Option<R> {
    for _ in 0..CAS_ATTEMPTS {
        let (bytes, cas) = host::shared_get(LOAD_KEY);
        let mut table =
            LoadTable::decode_or_fresh(bytes.as_deref().unwrap_or_default(), config.slots.len()).0;
        let result = edit(&mut table)?;
        if host::shared_set(LOAD_KEY, &table.encode(), cas).is_ok() {
            return Some(result);
        }
    }
    None
}

/// Drops entries older than the request timeout: requests whose VM died before releasing them.
pub fn reap(config: &Config, now_ms: u64) -> usize {
    update(config, |table| {
        let reaped = table.reap_older_than(now_ms, config.load.request_timeout_ms);
        (reaped > 0).then_some(reaped)
    })
    .unwrap_or(0)
}
