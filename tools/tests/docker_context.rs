//! The build stage of `docker/tools.Dockerfile` sees only what it COPYs. This test assembles
//! exactly that into a temporary directory and asks cargo (offline, locked) to load the
//! workspace there, so a path the manifests need but the Dockerfile forgets (a declared bench
//! target, a workspace member) fails here instead of in `docker build`.
//!
//! `cargo fetch` is the check: it parses every manifest strictly, as `cargo build` does, without
//! compiling (`cargo metadata` quietly drops a declared target whose file is missing).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

/// `COPY <src>... <dest>` instructions of the first (build) stage, without `--from` copies.
fn build_stage_copies(dockerfile: &str) -> Vec<(Vec<String>, String)> {
    let mut copies = Vec::new();
    let mut stages = 0;
    for line in dockerfile.lines().map(str::trim) {
        let mut words = line.split_whitespace();
        match words.next().map(str::to_ascii_uppercase).as_deref() {
            Some("FROM") => {
                stages += 1;
                if stages > 1 {
                    break;
                }
            }
            Some("COPY") => {
                let args: Vec<String> = words.map(str::to_string).collect();
                if args.iter().any(|a| a.starts_with("--from")) {
                    continue;
                }
                assert!(
                    !args.iter().any(|a| a.starts_with("--")),
                    "unsupported COPY flag in {line:?}"
                );
                if let Some((dest, sources)) = args.split_last() {
                    copies.push((sources.to_vec(), dest.clone()));
                }
            }
            _ => {}
        }
    }
    copies
}

fn copy_tree(from: &Path, to: &Path) {
    if from.is_dir() {
        std::fs::create_dir_all(to).unwrap();
        for entry in std::fs::read_dir(from).unwrap() {
            let entry = entry.unwrap();
            copy_tree(&entry.path(), &to.join(entry.file_name()));
        }
    } else {
        if let Some(parent) = to.parent() {
            std::fs::create_dir_all(parent).unwrap();
        }
        std::fs::copy(from, to).unwrap();
    }
}

/// Lays out the build context as the Dockerfile's WORKDIR would hold it.
fn assemble(copies: &[(Vec<String>, String)], dir: &Path) {
    let root = repo_root();
    for (sources, dest) in copies {
        for src in sources {
            let from = root.join(src);
            assert!(
                from.exists(),
                "the Dockerfile copies {src}, which does not exist"
            );
            let into_dir = dest.ends_with('/') || sources.len() > 1 || dest == ".";
            let to = if into_dir {
                let name = Path::new(src).file_name().unwrap();
                dir.join(dest).join(name)
            } else {
                dir.join(dest)
            };
            copy_tree(&from, &to);
        }
    }
}

fn cargo(dir: &Path, args: &[&str]) -> Output {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    Command::new(cargo)
        .args(args)
        .args(["--offline", "--locked", "--manifest-path"])
        .arg(dir.join("Cargo.toml"))
        .output()
        .unwrap()
}

/// The host triple: only its dependencies are in the local cache on a fresh machine.
fn host_triple() -> String {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let out = Command::new(rustc).arg("-vV").output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_string))
        .unwrap()
}

/// Whether cargo accepts the workspace in `dir` as `cargo build` would; stderr when not.
fn loads(dir: &Path) -> Result<(), String> {
    let out = cargo(dir, &["fetch", "--target", &host_triple()]);
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("docker-context-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn the_dockerfile_copies_everything_the_workspace_needs() {
    let dockerfile = std::fs::read_to_string(repo_root().join("docker/tools.Dockerfile")).unwrap();
    let copies = build_stage_copies(&dockerfile);
    assert!(!copies.is_empty(), "no COPY in the build stage");

    let dir = scratch("full");
    assemble(&copies, &dir);
    if let Err(e) = loads(&dir) {
        panic!("cargo cannot load the Docker build context:\n{e}");
    }
    // The binaries the image ships are targets of the copied workspace.
    let out = cargo(&dir, &["metadata", "--format-version", "1", "--no-deps"]);
    assert!(out.status.success());
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let bins: Vec<&str> = meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().unwrap())
        .filter(|t| t["kind"].as_array().unwrap().iter().any(|k| k == "bin"))
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    for bin in ["mock-worker", "loadgen"] {
        assert!(
            dockerfile.contains(&format!("--bin {bin}")) && bins.contains(&bin),
            "{bin}: {bins:?}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();

    // The check has teeth: the same context without the declared benches is refused.
    let without_benches: Vec<_> = copies
        .iter()
        .filter(|(sources, _)| !sources.iter().any(|s| s == "benches"))
        .cloned()
        .collect();
    let dir = scratch("partial");
    assemble(&without_benches, &dir);
    let err = loads(&dir).unwrap_err();
    assert!(err.contains("bench"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn copy_parsing() {
    let copies = build_stage_copies(
        "FROM a AS build\nCOPY Cargo.toml Cargo.lock ./\ncopy src src\nRUN x\n\
         FROM b\nCOPY --from=build /x /y\nCOPY late late\n",
    );
    assert_eq!(
        copies,
        vec![
            (vec!["Cargo.toml".into(), "Cargo.lock".into()], "./".into()),
            (vec!["src".into()], "src".into()),
        ]
    );
}
