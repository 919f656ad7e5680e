//! The process-wide key-value store every VM shares (Envoy's shared data), as a small trait so
//! that the logic built on it (the replicated event log, the poller lease, the load table's CAS
//! loop) runs natively in unit tests against [`fake::MemStore`].
//!
//! Semantics (Envoy's `SharedData`): every `get` copies the value and returns its version; a
//! `set` with `Some(version)` fails with [`StoreError::CasMismatch`] when the key was written
//! since; `None` (or version 0) writes unconditionally; setting a missing key always succeeds.
//! Versions come from one process-wide counter, so no two writes share one.

/// Why a write did not happen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreError {
    /// The key changed since the version passed was read.
    CasMismatch,
    /// Any other host failure.
    Failed,
}

pub trait SharedStore {
    /// The value and its version; `(None, None)` when the key was never written.
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>);
    /// Writes `value`; with `cas`, only if the key still has that version.
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError>;
}

/// An in-memory store with Envoy's semantics, and hooks that let a test run another VM's
/// operations between any two of this one's (to reproduce races deterministically). Also the
/// shared data of the virtual-time simulator (`loadgen sim`, feature `testing`).
#[cfg(any(test, feature = "testing"))]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
pub mod fake {
    use super::{SharedStore, StoreError};
    use std::cell::{Cell, RefCell};
    use std::collections::HashMap;

    /// Which operation is about to run, for hooks.
    #[derive(Clone, Debug, PartialEq, Eq)]
    pub enum Op {
        Get(String),
        Set(String),
    }

    type Hook = Box<dyn FnMut(&MemStore, &Op)>;

    #[derive(Default)]
    pub struct MemStore {
        map: RefCell<HashMap<String, (Vec<u8>, u32)>>,
        next_cas: Cell<u32>,
        hook: RefCell<Option<Hook>>,
        /// Operations run so far (hooks included).
        pub ops: Cell<usize>,
    }

    impl MemStore {
        pub fn new() -> MemStore {
            MemStore::default()
        }

        /// Runs `hook` before every later operation (not inside the hook's own operations).
        pub fn set_hook(&self, hook: impl FnMut(&MemStore, &Op) + 'static) {
            *self.hook.borrow_mut() = Some(Box::new(hook));
        }

        pub fn clear_hook(&self) {
            *self.hook.borrow_mut() = None;
        }

        fn before(&self, op: Op) {
            self.ops.set(self.ops.get() + 1);
            let taken = self.hook.borrow_mut().take();
            if let Some(mut hook) = taken {
                hook(self, &op);
                let mut slot = self.hook.borrow_mut();
                if slot.is_none() {
                    *slot = Some(hook);
                }
            }
        }

        /// Writes without running hooks (test set-up).
        pub fn put(&self, key: &str, value: &[u8]) {
            let cas = self.bump();
            self.map
                .borrow_mut()
                .insert(key.to_string(), (value.to_vec(), cas));
        }

        /// How many keys exist (Envoy never frees one: tests check the set stays fixed).
        pub fn key_count(&self) -> usize {
            self.map.borrow().len()
        }

        /// Reads without running hooks (test assertions).
        pub fn peek(&self, key: &str) -> Option<Vec<u8>> {
            self.map.borrow().get(key).map(|(v, _)| v.clone())
        }

        fn bump(&self) -> u32 {
            let next = self.next_cas.get().wrapping_add(1).max(1);
            self.next_cas.set(next);
            next
        }
    }

    impl SharedStore for MemStore {
        fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
            self.before(Op::Get(key.to_string()));
            match self.map.borrow().get(key) {
                Some((value, cas)) => (Some(value.clone()), Some(*cas)),
                None => (None, None),
            }
        }

        fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
            self.before(Op::Set(key.to_string()));
            let current = self.map.borrow().get(key).map(|(_, c)| *c);
            if let (Some(expected), Some(current)) = (cas.filter(|c| *c != 0), current) {
                if expected != current {
                    return Err(StoreError::CasMismatch);
                }
            }
            let version = self.bump();
            self.map
                .borrow_mut()
                .insert(key.to_string(), (value.to_vec(), version));
            Ok(())
        }
    }
}
