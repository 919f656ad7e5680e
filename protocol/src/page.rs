//! The event page and the dump the filter polls (docs/DESIGN.md, "Worker event endpoint"): the
//! vLLM-shaped events a producer (the bridge) writes, the `load` object, the id bound. The
//! filter's reader (`events::parse_event_page`) takes these and the other shapes it accepts.

use serde::{Deserialize, Serialize};

/// A data-parallel rank.
pub type DpRank = u32;

/// Largest event id (and cursor) accepted: 2^63 - 1. Ids are counters from 0 or 1; anything
/// near `u64::MAX` is a broken or hostile worker, and accepting it would leave no room for the
/// next id (`cursor + 1`) to exist.
pub const MAX_EVENT_ID: u64 = i64::MAX as u64;

/// One "stored" event of a dump: a run of blocks on one rank and medium, each following the one
/// before it, the first following `parent`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DumpRun {
    pub dp_rank: DpRank,
    pub medium: String,
    pub parent: Option<u64>,
    pub block_hashes: Vec<u64>,
    pub token_ids: Vec<u32>,
    pub lora_name: Option<String>,
}

/// An event as forwarded to the page.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PageEvent {
    Stored {
        dp_rank: DpRank,
        medium: String,
        parent: Option<u64>,
        block_hashes: Vec<u64>,
        token_ids: Vec<u32>,
        lora_name: Option<String>,
    },
    Removed {
        dp_rank: DpRank,
        medium: String,
        block_hashes: Vec<u64>,
    },
    /// Every block of one rank. The rank is always named: the filter reads a clear without
    /// `dp_rank` as "every rank of the worker".
    Cleared { dp_rank: DpRank },
}

impl PageEvent {
    pub fn kind(&self) -> &'static str {
        match self {
            PageEvent::Stored { .. } => "BlockStored",
            PageEvent::Removed { .. } => "BlockRemoved",
            PageEvent::Cleared { .. } => "AllBlocksCleared",
        }
    }
}

#[derive(Serialize)]
struct StoredJson<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    event_id: Option<u64>,
    dp_rank: DpRank,
    #[serde(rename = "type")]
    kind: &'static str,
    block_hashes: &'a [u64],
    parent_block_hash: Option<u64>,
    token_ids: &'a [u32],
    block_size: u32,
    medium: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    lora_name: Option<&'a str>,
}

#[derive(Serialize)]
struct RemovedJson<'a> {
    event_id: u64,
    dp_rank: DpRank,
    #[serde(rename = "type")]
    kind: &'static str,
    block_hashes: &'a [u64],
    medium: &'a str,
}

#[derive(Serialize)]
struct ClearedJson {
    event_id: u64,
    dp_rank: DpRank,
    #[serde(rename = "type")]
    kind: &'static str,
}

/// One page event as JSON with its id.
pub fn event_json(event_id: u64, event: &PageEvent, block_size: u32) -> String {
    let kind = event.kind();
    let json = match event {
        PageEvent::Stored {
            dp_rank,
            medium,
            parent,
            block_hashes,
            token_ids,
            lora_name,
        } => serde_json::to_string(&StoredJson {
            event_id: Some(event_id),
            dp_rank: *dp_rank,
            kind,
            block_hashes,
            parent_block_hash: *parent,
            token_ids,
            block_size,
            medium,
            lora_name: lora_name.as_deref(),
        }),
        PageEvent::Removed {
            dp_rank,
            medium,
            block_hashes,
        } => serde_json::to_string(&RemovedJson {
            event_id,
            dp_rank: *dp_rank,
            kind,
            block_hashes,
            medium,
        }),
        PageEvent::Cleared { dp_rank } => serde_json::to_string(&ClearedJson {
            event_id,
            dp_rank: *dp_rank,
            kind,
        }),
    };
    // These structs hold only numbers and strings: serialization cannot fail.
    json.unwrap_or_default()
}

/// Worker-reported load, as the page's `load` object. Read leniently: a field left out or
/// `null` is 0 (a producer that knows only some of them still reports those).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Load {
    #[serde(deserialize_with = "null_as_default")]
    pub num_waiting: u32,
    #[serde(deserialize_with = "null_as_default")]
    pub num_running: u32,
    /// Fraction of the worker's KV cache in use, 0.0..=1.0 as reported (not clamped).
    #[serde(deserialize_with = "null_as_default")]
    pub kv_usage: f64,
}

fn null_as_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// `GET /kv/events` body.
pub fn page_json(
    block_size: u32,
    first_event_id: u64,
    last_event_id: u64,
    events: &[&str],
    load: Option<Load>,
) -> String {
    let body_len: usize = events.iter().map(|e| e.len() + 1).sum();
    let mut out = String::with_capacity(body_len + 160);
    out.push_str(&format!(
        "{{\"block_size\":{block_size},\"first_event_id\":{first_event_id},\"last_event_id\":{last_event_id},\"events\":["
    ));
    for (i, e) in events.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(e);
    }
    out.push(']');
    if let Some(load) = load {
        out.push_str(",\"load\":");
        out.push_str(&serde_json::to_string(&load).unwrap_or_else(|_| "null".to_owned()));
    }
    out.push('}');
    out
}

/// `GET /kv/dump` body: the mirror as stored events (no ids) and the id it corresponds to.
pub fn dump_json(block_size: u32, last_event_id: u64, runs: &[DumpRun]) -> String {
    let mut out =
        format!("{{\"block_size\":{block_size},\"last_event_id\":{last_event_id},\"events\":[");
    for (i, run) in runs.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        let json = serde_json::to_string(&StoredJson {
            event_id: None,
            dp_rank: run.dp_rank,
            kind: "BlockStored",
            block_hashes: &run.block_hashes,
            parent_block_hash: run.parent,
            token_ids: &run.token_ids,
            block_size,
            medium: &run.medium,
            lora_name: run.lora_name.as_deref(),
        });
        out.push_str(&json.unwrap_or_default());
    }
    out.push_str("]}");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_load_object_reads_missing_and_null_fields_as_zero() {
        let load: Load = serde_json::from_str(r#"{"num_waiting": 3, "kv_usage": null}"#).unwrap();
        assert_eq!(
            load,
            Load {
                num_waiting: 3,
                num_running: 0,
                kv_usage: 0.0
            }
        );
        let written = Load {
            num_waiting: 1,
            num_running: 2,
            kv_usage: 0.5,
        };
        let back: Load = serde_json::from_str(&serde_json::to_string(&written).unwrap()).unwrap();
        assert_eq!(back, written);
        assert!(serde_json::from_str::<Load>(r#"{"num_waiting": -1}"#).is_err());
    }
}
