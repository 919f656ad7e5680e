//! Reading a `serde_json::Value` object field by field: typed, range-checked reads whose errors
//! name the full field path, and leftover keys reported as unknown fields.

use std::net::SocketAddr;

use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use super::ConfigError;

/// A JSON object being consumed field by field; leftover keys are unknown fields.
pub(super) struct Obj {
    pub(super) path: String,
    pub(super) map: Map<String, Value>,
    pub(super) allowed: &'static [&'static str],
}

impl Obj {
    pub(super) fn new(
        path: &str,
        value: Value,
        allowed: &'static [&'static str],
    ) -> Result<Obj, ConfigError> {
        match value {
            Value::Object(map) => Ok(Obj {
                path: path.to_string(),
                map,
                allowed,
            }),
            other => Err(ConfigError::WrongType {
                field: path.to_string(),
                detail: format!("expected an object, got {}", kind(&other)),
            }),
        }
    }

    pub(super) fn field_path(&self, key: &str) -> String {
        if self.path.is_empty() {
            key.to_string()
        } else {
            format!("{}.{key}", self.path)
        }
    }

    /// Takes `key`; absent or `null` = `None` (the default applies).
    pub(super) fn take<T: DeserializeOwned>(
        &mut self,
        key: &str,
    ) -> Result<Option<T>, ConfigError> {
        match self.map.remove(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => {
                let shown = kind(&v);
                serde_json::from_value(v)
                    .map(Some)
                    .map_err(|e| ConfigError::WrongType {
                        field: self.field_path(key),
                        detail: format!("{e} (got {shown})"),
                    })
            }
        }
    }

    pub(super) fn take_raw(&mut self, key: &str) -> Option<Value> {
        match self.map.remove(key) {
            None | Some(Value::Null) => None,
            Some(v) => Some(v),
        }
    }

    pub(super) fn finish(self) -> Result<(), ConfigError> {
        match self.map.keys().next() {
            None => Ok(()),
            Some(key) => Err(ConfigError::UnknownField {
                field: self.field_path(key),
                expected: self.allowed,
            }),
        }
    }
}

pub(super) fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

pub(super) fn f64_in(
    field: String,
    v: f64,
    lo: f64,
    hi: f64,
    expected: &'static str,
) -> Result<f64, ConfigError> {
    if v.is_finite() && v >= lo && v <= hi {
        Ok(v)
    } else {
        Err(ConfigError::OutOfRange {
            field,
            expected,
            got: v.to_string(),
        })
    }
}

pub(super) fn u64_in(
    field: String,
    v: u64,
    lo: u64,
    hi: u64,
    expected: &'static str,
) -> Result<u64, ConfigError> {
    if v >= lo && v <= hi {
        Ok(v)
    } else {
        Err(ConfigError::OutOfRange {
            field,
            expected,
            got: v.to_string(),
        })
    }
}

pub(super) fn non_negative(obj: &mut Obj, key: &str, default: f64) -> Result<f64, ConfigError> {
    match obj.take::<f64>(key)? {
        None => Ok(default),
        Some(v) => f64_in(obj.field_path(key), v, 0.0, f64::MAX, "finite and >= 0"),
    }
}

pub(super) fn positive_fraction(obj: &mut Obj, key: &str) -> Result<Option<f64>, ConfigError> {
    match obj.take::<f64>(key)? {
        None => Ok(None),
        Some(v) if v.is_finite() && v > 0.0 => Ok(Some(v)),
        Some(v) => Err(ConfigError::OutOfRange {
            field: obj.field_path(key),
            expected: "finite and > 0",
            got: v.to_string(),
        }),
    }
}

pub(super) fn ms(
    obj: &mut Obj,
    key: &str,
    default: u64,
    lo: u64,
    hi: u64,
    expected: &'static str,
) -> Result<u64, ConfigError> {
    match obj.take::<u64>(key)? {
        None => Ok(default),
        Some(v) => u64_in(obj.field_path(key), v, lo, hi, expected),
    }
}

pub(super) fn url_path(obj: &mut Obj, key: &str, default: &str) -> Result<String, ConfigError> {
    let p = obj
        .take::<String>(key)?
        .unwrap_or_else(|| default.to_string());
    check_url_path(obj.field_path(key), &p)?;
    Ok(p)
}

pub(super) fn check_url_path(field: String, p: &str) -> Result<(), ConfigError> {
    if !p.starts_with('/') || p.contains(['?', '#', ' ']) {
        return Err(ConfigError::Invalid {
            field,
            detail: format!("\"{p}\" must be an absolute path starting with '/' without query, fragment or spaces"),
        });
    }
    Ok(())
}

pub(super) fn non_empty(field: String, s: &str) -> Result<(), ConfigError> {
    if s.trim().is_empty() {
        return Err(ConfigError::Invalid {
            field,
            detail: "must not be empty".to_string(),
        });
    }
    Ok(())
}

pub(super) fn address(field: String, s: &str) -> Result<SocketAddr, ConfigError> {
    match s.parse::<SocketAddr>() {
        Ok(a) if a.port() != 0 => Ok(a),
        _ => Err(ConfigError::BadAddress {
            field,
            got: s.to_string(),
        }),
    }
}

pub(super) fn variant<T: Copy>(
    obj: &mut Obj,
    key: &str,
    default: T,
    table: &[(&'static str, T)],
    expected: &'static [&'static str],
) -> Result<T, ConfigError> {
    let Some(s) = obj.take::<String>(key)? else {
        return Ok(default);
    };
    table
        .iter()
        .find(|(name, _)| *name == s)
        .map(|(_, v)| *v)
        .ok_or_else(|| ConfigError::UnknownVariant {
            field: obj.field_path(key),
            got: s,
            expected,
        })
}
