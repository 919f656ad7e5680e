//! The poller lease (`ekr.lease`): only the VM holding it polls workers, so a process makes one
//! call per worker per interval, not one per thread. A lease not renewed for `lease_ms` passes to
//! the next VM that asks.
//!
//! Two VMs can both believe they are the poller for a moment (one's lease expired while it was
//! busy); the log's append protocol ([`super::log`]) stays consistent when that happens.

use crate::store::SharedStore;

const LEASE_KEY: &str = "ekr.lease";

fn read(store: &dyn SharedStore) -> ((u64, u64), Option<u32>) {
    let (bytes, cas) = store.get(LEASE_KEY);
    let lease = bytes
        .as_deref()
        .and_then(|b| {
            let owner = u64::from_le_bytes(b.get(0..8)?.try_into().ok()?);
            let expires = u64::from_le_bytes(b.get(8..16)?.try_into().ok()?);
            Some((owner, expires))
        })
        .unwrap_or((0, 0));
    (lease, cas)
}

/// Takes or renews the lease for `nonce` (CAS); true if this VM holds it now.
pub fn hold_lease(store: &dyn SharedStore, nonce: u64, now_ms: u64, lease_ms: u64) -> bool {
    let ((owner, expires_ms), cas) = read(store);
    if owner != nonce && expires_ms > now_ms {
        return false;
    }
    let mut value = nonce.to_le_bytes().to_vec();
    value.extend_from_slice(&now_ms.saturating_add(lease_ms).to_le_bytes());
    store.set(LEASE_KEY, &value, cas).is_ok()
}

/// Whether `nonce` holds an unexpired lease (one read, no write).
pub fn holds_lease(store: &dyn SharedStore, nonce: u64, now_ms: u64) -> bool {
    let ((owner, expires_ms), _) = read(store);
    owner == nonce && expires_ms > now_ms
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::fake::MemStore;

    #[test]
    fn one_holder_until_the_lease_expires() {
        let store = MemStore::new();
        assert!(hold_lease(&store, 1, 1000, 500));
        assert!(holds_lease(&store, 1, 1200));
        assert!(!hold_lease(&store, 2, 1200, 500), "held by 1");
        assert!(!holds_lease(&store, 2, 1200));
        assert!(hold_lease(&store, 1, 1400, 500), "renewed");
        assert!(
            !hold_lease(&store, 2, 1800, 500),
            "renewal moved the expiry"
        );
        assert!(hold_lease(&store, 2, 1901, 500), "expired: taken over");
        assert!(!holds_lease(&store, 1, 1902));
        assert!(holds_lease(&store, 2, 1902));
    }
}
