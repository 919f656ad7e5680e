//! State shared by every VM of an Envoy process, on top of a [`SharedStore`](crate::store::SharedStore):
//!
//! * [`log`]: the replicated event log that keeps every VM's KV index identical;
//! * [`head`]: the log head's types, [`head_codec`] their binary layout;
//! * [`lease`]: which VM is the poller (fetches worker events and appends them to the log).
//!
//! Both are pure logic over the store trait, so every race between VMs can be replayed
//! deterministically in unit tests with the in-memory store.

pub mod coalesce;
pub mod head;
pub mod head_codec;
pub mod lease;
pub mod log;
