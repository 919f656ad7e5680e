//! vLLM-shaped KV events for test and bench fixtures, as `serde_json` values: written by the
//! protocol's [`EventJson`] (the shape the bridge and the mock write and the filter reads), so
//! that no fixture spells the event's keys by hand.
//!
//! The events name rank 0 (`dp_rank`), and leave out `parent_block_hash` and `lora_name` when
//! there are none (readers take an absent field as `null`). A fixture that writes a malformed or
//! non-vLLM event on purpose (a Dynamo shape, a missing field) keeps writing it by hand.

use kv_router_protocol::page::{EventJson, PageEvent};
use serde_json::Value;

/// The medium vLLM names the device (GPU) tier with.
pub const GPU: &str = "GPU";

/// `event` as its vLLM-shaped JSON value, with `event_id` when one is given (a page event; an
/// event published to a mock worker gets its id from the mock). `block_size` is written in a
/// stored event only.
pub fn page_event(event_id: Option<u64>, event: &PageEvent, block_size: u32) -> Value {
    let json = EventJson {
        event_id: event_id.map(Into::into),
        ..EventJson::of(event, block_size)
    };
    // Strings and integers that fit 64 bits (the id comes from a u64): cannot fail.
    serde_json::to_value(json).unwrap_or(Value::Null)
}

/// A `BlockStored` event on rank 0: `block_hashes` in order, the first following `parent`,
/// `token_ids` as given (normally `block_hashes.len() * block_size` of them).
pub fn stored_event(
    block_hashes: &[u64],
    parent: Option<u64>,
    token_ids: &[u32],
    block_size: u32,
    medium: &str,
) -> Value {
    page_event(
        None,
        &stored(block_hashes, parent, token_ids, medium),
        block_size,
    )
}

/// A `BlockRemoved` event on rank 0.
pub fn removed_event(block_hashes: &[u64], medium: &str) -> Value {
    page_event(None, &removed(block_hashes, medium), 0)
}

/// The [`PageEvent`] of [`stored_event`] (no LoRA adapter), for [`page_event`].
pub fn stored(
    block_hashes: &[u64],
    parent: Option<u64>,
    token_ids: &[u32],
    medium: &str,
) -> PageEvent {
    PageEvent::Stored {
        dp_rank: 0,
        medium: medium.to_owned(),
        parent,
        block_hashes: block_hashes.to_vec(),
        token_ids: token_ids.to_vec(),
        lora_name: None,
    }
}

/// The [`PageEvent`] of [`removed_event`], for [`page_event`].
pub fn removed(block_hashes: &[u64], medium: &str) -> PageEvent {
    PageEvent::Removed {
        dp_rank: 0,
        medium: medium.to_owned(),
        block_hashes: block_hashes.to_vec(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn stored_and_removed_are_vllm_shaped() {
        assert_eq!(
            stored_event(&[7, u64::MAX], Some(3), &[1, 2, 3, 4], 2, GPU),
            json!({"dp_rank": 0, "type": "BlockStored", "block_hashes": [7, u64::MAX],
                "parent_block_hash": 3, "token_ids": [1, 2, 3, 4], "block_size": 2,
                "medium": "GPU"})
        );
        // No parent: the key is left out (read as null).
        assert_eq!(
            stored_event(&[7], None, &[1, 2], 2, "CPU"),
            json!({"dp_rank": 0, "type": "BlockStored", "block_hashes": [7],
                "token_ids": [1, 2], "block_size": 2, "medium": "CPU"})
        );
        assert_eq!(
            removed_event(&[5, 6], GPU),
            json!({"dp_rank": 0, "type": "BlockRemoved", "block_hashes": [5, 6], "medium": "GPU"})
        );
    }

    #[test]
    fn a_page_event_carries_its_id() {
        let event = page_event(Some(u64::MAX >> 1), &removed(&[9], GPU), 16);
        assert_eq!(event["event_id"], json!(u64::MAX >> 1));
        assert_eq!(event["type"], "BlockRemoved");
        assert!(event.get("block_size").is_none(), "{event}");
        let event = page_event(Some(1), &stored(&[9], None, &[1], GPU), 16);
        assert_eq!(
            (event["event_id"].clone(), event["block_size"].clone()),
            (json!(1), json!(16))
        );
    }

    #[test]
    fn what_the_fixtures_write_the_protocol_reads_back() {
        let event = stored(&[1, 2], Some(u64::MAX), &[1, 2, 3, 4], GPU);
        let value = page_event(Some(4), &event, 2);
        let back: EventJson = serde_json::from_value(value).expect("reads back");
        assert_eq!(
            back,
            EventJson {
                event_id: Some(4u64.into()),
                ..EventJson::of(&event, 2)
            }
        );
    }
}
