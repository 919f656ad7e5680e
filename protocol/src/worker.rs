//! A worker's description of itself: the `worker` object of its event page or dump (DP layout,
//! device, capacity, batch budget, models, timing). The bridge and the mock write it; the filter
//! reads it (and vets it against its pool entry: see the filter's `worker_description`).

use serde::{Deserialize, Serialize};

/// At most this many models, each at most [`MAX_MODEL_BYTES`] (the filter keeps the description
/// in its shared log head, which is bounded; the bridge reads no more from `/v1/models`).
pub const MAX_MODELS: usize = 32;
pub const MAX_MODEL_BYTES: usize = 256;

/// Worker device class (the filter's `device-aware-weighted` mode reads it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Device {
    /// Any non-CPU accelerator.
    Gpu,
    Cpu,
}

/// What a worker says about itself. Absent fields are left out of the JSON (and, in the filter,
/// leave its template's value).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct WorkerDescription {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dp_start: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dp_size: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<Device>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_capacity_blocks: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_num_batched_tokens: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub models: Option<Vec<String>>,
    /// Its engine's prefill time (ms) per step by tokens, as `calibrate` measured it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_time_ms_poly: Option<Vec<f64>>,
    /// Its engine's decode step time (ms) by KV fill.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_step_ms_poly: Option<Vec<f64>>,
}

impl WorkerDescription {
    /// `self` (e.g. the bridge's flags) over `learned`, field by field.
    pub fn over(&self, learned: &WorkerDescription) -> WorkerDescription {
        WorkerDescription {
            block_size: self.block_size.or(learned.block_size),
            dp_start: self.dp_start.or(learned.dp_start),
            dp_size: self.dp_size.or(learned.dp_size),
            device: self.device.or(learned.device),
            kv_capacity_blocks: self.kv_capacity_blocks.or(learned.kv_capacity_blocks),
            max_num_batched_tokens: self
                .max_num_batched_tokens
                .or(learned.max_num_batched_tokens),
            models: self.models.clone().or_else(|| learned.models.clone()),
            prefill_time_ms_poly: self
                .prefill_time_ms_poly
                .clone()
                .or_else(|| learned.prefill_time_ms_poly.clone()),
            decode_step_ms_poly: self
                .decode_step_ms_poly
                .clone()
                .or_else(|| learned.decode_step_ms_poly.clone()),
        }
    }

    pub fn is_empty(&self) -> bool {
        *self == WorkerDescription::default()
    }

    /// The JSON object, or `None` when nothing is known.
    pub fn to_json(&self) -> Option<String> {
        if self.is_empty() {
            return None;
        }
        serde_json::to_string(self).ok()
    }
}

/// Splices `,"worker":{...}` into a page or dump body (a JSON object).
pub fn splice(mut body: String, worker: Option<&str>) -> String {
    if let Some(w) = worker {
        if body.ends_with('}') {
            body.pop();
            body.push_str(",\"worker\":");
            body.push_str(w);
            body.push('}');
        }
    }
    body
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_round_trip_leaves_absent_fields_out() {
        let d = WorkerDescription {
            device: Some(Device::Cpu),
            dp_size: Some(2),
            models: Some(vec!["m".into()]),
            ..Default::default()
        };
        let json = d.to_json().unwrap();
        assert_eq!(json, r#"{"dp_size":2,"device":"cpu","models":["m"]}"#);
        assert_eq!(serde_json::from_str::<WorkerDescription>(&json).unwrap(), d);
        assert!(serde_json::from_str::<WorkerDescription>(r#"{"device":"tpu"}"#).is_err());
        assert_eq!(WorkerDescription::default().to_json(), None);
    }
}
