//! `loadgen race --trace-workload`: a Mooncake-format trace of the user's own (or one generated
//! for a held-out check) as a race workload, on a mock fleet described next to it, so the race's
//! arms and targets run on traffic and fleets that are not the race's own.

use std::path::PathBuf;

use crate::compare::worker_arg;

use super::{EXTRA_WORKLOADS, MOCK_BLOCK_SIZE, MOCK_WORKERS, MOCK_WORKER_ARGS, WORKLOADS};

/// Most mock workers a trace workload may ask for (each is a process on this machine).
pub const MAX_WORKERS: u64 = 64;

/// The keys a `--trace-workload` spec takes after `NAME=PATH`.
const KEYS: &str = "workers, block_size, worker_args, speedups, time_scale";

/// One `--trace-workload NAME=PATH[;key=value...]`.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceWorkload {
    pub name: String,
    pub path: PathBuf,
    /// Mock workers (the race's 8 by default).
    pub workers: u64,
    /// KV block size of the fleet and the filter (the race's 64 by default).
    pub block_size: u32,
    /// Mock-worker arguments (the race's `--kv-blocks 8192 --speedup 2` by default; with
    /// `speedups` and none given, `--kv-blocks 8192`).
    pub worker_args: Vec<String>,
    /// A mixed fleet: worker i at the i-th `--speedup` (cycled); empty for one speed.
    pub speedups: Vec<f64>,
    /// The trace's timestamps divided by this.
    pub time_scale: f64,
}

fn positive(key: &str, value: &str) -> Result<f64, String> {
    match value.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!("{key}={value}: expected a positive number")),
    }
}

impl TraceWorkload {
    /// Parses `NAME=PATH[;key=value...]`, keys [`KEYS`], e.g.
    /// `mine=traces/prod.jsonl;workers=12;speedups=1,3;block_size=16`.
    pub fn parse(spec: &str) -> Result<TraceWorkload, String> {
        let err = |why: String| format!("--trace-workload {spec:?}: {why}");
        let mut parts = spec.split(';');
        let head = parts.next().unwrap_or_default();
        let Some((name, path)) = head
            .split_once('=')
            .map(|(n, p)| (n.trim(), p.trim()))
            .filter(|(n, p)| !n.is_empty() && !p.is_empty())
        else {
            return Err(err(format!(
                "expected NAME=PATH[;key=value...] (keys: {KEYS})"
            )));
        };
        // The name becomes file names (`ttft-NAME.svg`) and must not shadow a race workload.
        if !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            return Err(err(format!(
                "name {name:?}: letters, digits, '-' and '_' only"
            )));
        }
        if WORKLOADS.contains(&name) || EXTRA_WORKLOADS.contains(&name) {
            return Err(err(format!(
                "{name:?} is a race workload's name; pick another"
            )));
        }
        let mut w = TraceWorkload {
            name: name.to_string(),
            path: PathBuf::from(path),
            workers: MOCK_WORKERS,
            block_size: MOCK_BLOCK_SIZE,
            worker_args: Vec::new(),
            speedups: Vec::new(),
            time_scale: 1.0,
        };
        let mut worker_args = None;
        for part in parts.filter(|p| !p.trim().is_empty()) {
            let Some((key, value)) = part.split_once('=') else {
                return Err(err(format!("{part:?}: expected key=value (keys: {KEYS})")));
            };
            let key = key.trim();
            match key {
                "workers" => match value.trim().parse::<u64>() {
                    Ok(n) if (1..=MAX_WORKERS).contains(&n) => w.workers = n,
                    _ => return Err(err(format!("workers={value}: expected 1..={MAX_WORKERS}"))),
                },
                "block_size" => match value.trim().parse::<u32>() {
                    Ok(n) if n > 0 => w.block_size = n,
                    _ => {
                        return Err(err(format!(
                            "block_size={value}: expected a positive integer"
                        )))
                    }
                },
                "worker_args" => {
                    worker_args = Some(value.split_whitespace().map(str::to_string).collect())
                }
                "speedups" => {
                    w.speedups = value
                        .split(',')
                        .map(|v| positive(key, v))
                        .collect::<Result<_, _>>()
                        .map_err(err)?
                }
                "time_scale" => w.time_scale = positive(key, value).map_err(err)?,
                other => return Err(err(format!("unknown key {other:?} (keys: {KEYS})"))),
            }
        }
        let mixed = !w.speedups.is_empty();
        w.worker_args = worker_args.unwrap_or_else(|| {
            // A mixed fleet's speedups are each worker's whole `--speedup`.
            let args = if mixed {
                &MOCK_WORKER_ARGS[..2]
            } else {
                &MOCK_WORKER_ARGS[..]
            };
            args.iter().map(|s| s.to_string()).collect()
        });
        if mixed && worker_arg::<f64>(&w.worker_args, "--speedup").is_some() {
            return Err(err(
                "speedups are each worker's --speedup: drop --speedup from worker_args".into(),
            ));
        }
        Ok(w)
    }

    /// The fleet in words, for the summary.
    pub fn fleet_text(&self) -> String {
        let mut s = format!(
            "{} mock workers `{}`",
            self.workers,
            self.worker_args.join(" ")
        );
        if !self.speedups.is_empty() {
            s.push_str(&format!(
                ", worker i at `--speedup` {:?} (cycled)",
                self.speedups
            ));
        }
        if self.block_size != MOCK_BLOCK_SIZE {
            s.push_str(&format!(", blocks of {} tokens", self.block_size));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_and_a_path_take_the_race_fleet() {
        let w = TraceWorkload::parse("mine=traces/prod.jsonl").unwrap();
        assert_eq!(w.name, "mine");
        assert_eq!(w.path, PathBuf::from("traces/prod.jsonl"));
        assert_eq!((w.workers, w.block_size, w.time_scale), (8, 64, 1.0));
        assert_eq!(w.worker_args, ["--kv-blocks", "8192", "--speedup", "2"]);
        assert!(w.speedups.is_empty());
    }

    #[test]
    fn keys_describe_the_fleet() {
        let w = TraceWorkload::parse(
            "held-out=/tmp/a.jsonl;workers=12;block_size=16;worker_args=--kv-blocks 16384 --speedup 2;time_scale=2",
        )
        .unwrap();
        assert_eq!((w.workers, w.block_size, w.time_scale), (12, 16, 2.0));
        assert_eq!(w.worker_args, ["--kv-blocks", "16384", "--speedup", "2"]);
        // Speedups without worker_args drop the race's --speedup, keep its cache.
        let mixed = TraceWorkload::parse("m=/tmp/a.jsonl;speedups=1,3").unwrap();
        assert_eq!(mixed.speedups, [1.0, 3.0]);
        assert_eq!(mixed.worker_args, ["--kv-blocks", "8192"]);
        assert!(
            mixed.fleet_text().contains("[1.0, 3.0]"),
            "{}",
            mixed.fleet_text()
        );
    }

    #[test]
    fn bad_specs_name_what_is_wrong() {
        let why = |spec: &str| TraceWorkload::parse(spec).unwrap_err();
        assert!(why("mine").contains("NAME=PATH"));
        assert!(why("=x.jsonl").contains("NAME=PATH"));
        assert!(why("a b=x.jsonl").contains("letters"));
        assert!(why("agent=x.jsonl").contains("race workload"));
        assert!(why("m=x.jsonl;workers=0").contains("workers=0"));
        assert!(why("m=x.jsonl;workers=65").contains("1..=64"));
        assert!(why("m=x.jsonl;block_size=-1").contains("block_size"));
        assert!(why("m=x.jsonl;speedups=1,0").contains("speedups=0"));
        assert!(why("m=x.jsonl;time_scale=nan").contains("time_scale"));
        assert!(why("m=x.jsonl;fleet=3").contains("unknown key \"fleet\""));
        assert!(why("m=x.jsonl;workers").contains("key=value"));
        assert!(why("m=x.jsonl;speedups=1,2;worker_args=--speedup 2").contains("drop --speedup"));
    }
}
