//! Presets: `engine` names what serves the requests, and fills in the fields that follow from it
//! (docs/CONFIG.md#engine-presets). A preset only fills fields the configuration leaves out: a
//! field written explicitly always wins, and every other field keeps its default.
//!
//! The preset is applied to the JSON before it is read (so serde still names every unknown key
//! and bad type by its path), and an error in a field the preset filled says so.
//!
//! * `vllm` and `sglang`: the engine runs with a `kv-event-bridge` next to it (the engines publish
//!   their KV events over ZMQ; the bridge serves them as the filter's event page, whatever the
//!   engine's wire format and metric names). The bridge listens on port 8200 by default, and
//!   supports long polling.

use serde::Deserialize;
use serde_json::{Map, Value};

use super::ConfigError;

/// The engine behind the workers (`engine`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Engine {
    /// vLLM, with a `kv-event-bridge` beside each engine.
    Vllm,
    /// SGLang, with a `kv-event-bridge` beside each engine.
    Sglang,
}

/// The port `kv-event-bridge` listens on by default (`--listen 0.0.0.0:8200`).
pub const BRIDGE_PORT: u16 = 8200;

/// vLLM's default KV block size on GPUs (`--block-size`).
pub const VLLM_BLOCK_SIZE: u32 = 16;

/// The long poll the engine presets set: the bridge answers as soon as an event exists.
pub const BRIDGE_LONG_POLL_MS: u64 = 1000;

impl Engine {
    pub fn as_str(self) -> &'static str {
        match self {
            Engine::Vllm => "vllm",
            Engine::Sglang => "sglang",
        }
    }

    fn parse(v: &Value) -> Result<Engine, ConfigError> {
        match v.as_str() {
            Some("vllm") => Ok(Engine::Vllm),
            Some("sglang") => Ok(Engine::Sglang),
            _ => Err(ConfigError::Parse {
                field: "engine".to_string(),
                detail: format!(
                    "unknown engine {v}, expected \"vllm\" or \"sglang\" (or leave it out: no preset)"
                ),
            }),
        }
    }
}

/// What a preset filled in: the paths of the fields it set, to name it in an error.
#[derive(Debug, Default)]
pub(super) struct Filled {
    engine: Option<Engine>,
    paths: Vec<String>,
}

impl Filled {
    /// `err`, with a note when it is about a field the preset filled in.
    pub(super) fn explain(&self, err: ConfigError) -> ConfigError {
        let (Some(engine), Some(field)) = (self.engine, err.field()) else {
            return err;
        };
        if !self.paths.iter().any(|p| p == field) {
            return err;
        }
        let field = field.to_string();
        let text = err.to_string();
        let detail = text
            .strip_prefix(&format!("{field}: "))
            .unwrap_or(&text)
            .to_string();
        ConfigError::Invalid {
            detail: format!(
                "{detail} (the value engine \"{}\" sets; write the field to override it)",
                engine.as_str()
            ),
            field,
        }
    }
}

/// Fills in the fields the root object's `engine` implies and leaves out. Values of the wrong
/// type are left alone, for serde to report by their path.
pub(super) fn apply(root: &mut Map<String, Value>) -> Result<Filled, ConfigError> {
    // `null` is "not set", as for every optional field.
    let engine = match root.get("engine") {
        None | Some(Value::Null) => return Ok(Filled::default()),
        Some(engine) => engine,
    };
    let engine = Engine::parse(engine)?;
    let mut filled = Filled {
        engine: Some(engine),
        paths: Vec::new(),
    };
    match engine {
        Engine::Vllm => filled.set(root, "block_size", Value::from(VLLM_BLOCK_SIZE)),
        // SGLang's page size defaults to 1 token, too small to route by; its operators choose one.
        Engine::Sglang if !root.contains_key("block_size") => {
            return Err(ConfigError::Invalid {
                field: "block_size".to_string(),
                detail: "required with engine \"sglang\": the engines' --page-size (SGLang's \
                         default of 1 token is too small to route by; 16 to 64 is usual)"
                    .to_string(),
            })
        }
        Engine::Sglang => {}
    }
    bridge(root, &mut filled);
    Ok(filled)
}

/// The `kv-event-bridge` beside each engine: its port, and long polling.
fn bridge(root: &mut Map<String, Value>, filled: &mut Filled) {
    filled.set_in(
        root,
        "events",
        "long_poll_ms",
        Value::from(BRIDGE_LONG_POLL_MS),
    );
    if let Some(Value::Object(m)) = root.get_mut("membership") {
        if !m.contains_key("events_port") {
            m.insert("events_port".to_string(), Value::from(BRIDGE_PORT));
            filled.paths.push("membership.events_port".to_string());
        }
    }
    if let Some(Value::Array(workers)) = root.get_mut("workers") {
        for (i, w) in workers.iter_mut().enumerate() {
            let Value::Object(w) = w else { continue };
            if w.contains_key("events_address") {
                continue;
            }
            // An address that does not parse is left for the compile step to name.
            let Some(addr) = w
                .get("address")
                .and_then(Value::as_str)
                .and_then(|a| a.parse::<std::net::SocketAddr>().ok())
            else {
                continue;
            };
            let events = std::net::SocketAddr::new(addr.ip(), BRIDGE_PORT);
            w.insert(
                "events_address".to_string(),
                Value::from(events.to_string()),
            );
            filled.paths.push(format!("workers[{i}].events_address"));
        }
    }
}

impl Filled {
    fn set(&mut self, root: &mut Map<String, Value>, key: &str, value: Value) {
        if !root.contains_key(key) {
            root.insert(key.to_string(), value);
            self.paths.push(key.to_string());
        }
    }

    /// `section.key`, creating the section when it is absent (a section of another type is left
    /// for serde to report).
    fn set_in(&mut self, root: &mut Map<String, Value>, section: &str, key: &str, value: Value) {
        let entry = root
            .entry(section.to_string())
            .or_insert_with(|| Value::Object(Map::new()));
        if let Value::Object(m) = entry {
            if !m.contains_key(key) {
                m.insert(key.to_string(), value);
                self.paths.push(format!("{section}.{key}"));
            }
        }
    }
}
