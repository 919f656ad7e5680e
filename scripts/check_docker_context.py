"""Checks the build context of docker/*.Dockerfile against .dockerignore (`make test`).

The context is the repository root and .dockerignore is an allow-list, so a file a Dockerfile
COPYs but the allow-list forgets fails only at `docker build` time. This check walks the context
as Docker does (its .dockerignore rules: Go `filepath.Match` patterns, the last matching one wins,
a pattern matching a parent directory matches everything under it) and fails when a COPY source,
or any file under it, would not be sent, or when the context grows past a few megabytes (target/
leaking in). It then shows that it has teeth: without `!benches` the tools image fails the check.

Whether cargo accepts what the build stage copies is the business of the tools crate's
docker_context test; whether the images build and run, of scripts/container-demo.sh.
"""

import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# COPY sources that may be missing: a workspace member not in this tree yet (its Dockerfile is
# skipped, with a note). Build outputs under target/ are checked by pattern alone.
OPTIONAL = {"bridge"}
MAX_CONTEXT_BYTES = 16 << 20


def glob_regex(pattern):
    """Go filepath.Match (plus Docker's `**`) as a regex over '/'-separated paths."""
    out, i = "", 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            out, i = out + ".*", i + 2
            continue
        if c == "*":
            out += "[^/]*"
        elif c == "?":
            out += "[^/]"
        elif c == "[":
            j = pattern.find("]", i)
            if j < 0:
                raise ValueError(f"bad pattern {pattern!r}")
            body = pattern[i + 1 : j].replace("\\", "\\\\")
            out += "[" + ("^" + body[1:] if body.startswith("^") else body) + "]"
            i = j
        elif c == "\\" and i + 1 < len(pattern):
            i += 1
            out += re.escape(pattern[i])
        else:
            out += re.escape(c)
        i += 1
    return re.compile(out + r"\Z")


def read_patterns(text):
    patterns = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negative = line.startswith("!")
        body = os.path.normpath(line[1:].strip() if negative else line).lstrip("/")
        patterns.append((negative, body, glob_regex(body)))
    return patterns


def excluded(path, patterns):
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = path.split("/")
    result = False
    for negative, body, regex in patterns:
        depth = body.count("/") + 1
        hit = bool(regex.match(path)) or (
            depth < len(parts) and bool(regex.match("/".join(parts[:depth])))
        )
        if hit:
            result = not negative
    return result


def context_files(patterns):
    """(path, size) of every file the context sends, skipping excluded trees nobody re-includes."""
    reincluded = [body for negative, body, _ in patterns if negative]
    for dirpath, dirnames, filenames in os.walk(ROOT):
        rel = os.path.relpath(dirpath, ROOT)
        rel = "" if rel == "." else rel + "/"
        dirnames[:] = [
            d
            for d in dirnames
            if d != ".git"
            and (
                not excluded(rel + d, patterns)
                or any(b.startswith(rel + d + "/") for b in reincluded)
            )
        ]
        for name in filenames:
            path = rel + name
            if not excluded(path, patterns):
                yield path, os.path.getsize(os.path.join(dirpath, name))


def copy_sources(dockerfile):
    """Sources of every `COPY` without --from, in every stage."""
    sources = []
    for line in dockerfile.splitlines():
        words = line.split()
        if words and words[0].upper() in ("COPY", "ADD"):
            args = words[1:]
            if any(a.startswith("--from") for a in args):
                continue
            args = [a for a in args if not a.startswith("--")]
            sources += [os.path.normpath(s) for s in args[:-1]]
    return sources


def problems(dockerfile_path, patterns, sent):
    """What the context lacks for this Dockerfile; None when it is skipped."""
    found = []
    for src in copy_sources(dockerfile_path.read_text()):
        full = ROOT / src
        if src.split("/")[0] == "target":
            if excluded(src, patterns):
                found.append(f"{src} (a build output) is excluded by .dockerignore")
        elif not full.exists():
            if src in OPTIONAL:
                return None
            found.append(f"{src} does not exist")
        elif full.is_dir():
            files = [
                os.path.relpath(os.path.join(d, f), ROOT)
                for d, _, fs in os.walk(full)
                for f in fs
            ]
            missing = [f for f in files if f not in sent]
            if missing:
                found.append(f"{src}: {len(missing)} files not sent, e.g. {missing[0]}")
        elif src not in sent:
            found.append(f"{src} is excluded by .dockerignore")
    return found


def check(patterns, quiet=False):
    sent = dict(context_files(patterns))
    failures = []
    total = sum(sent.values())
    if total > MAX_CONTEXT_BYTES:
        failures.append(f"the build context is {total >> 20} MiB (> {MAX_CONTEXT_BYTES >> 20} MiB)")
    for path in sorted((ROOT / "docker").glob("*.Dockerfile")):
        name = path.relative_to(ROOT)
        found = problems(path, patterns, sent)
        if found is None:
            if not quiet:
                print(f"{name}: skipped (copies a workspace member this tree does not have yet)")
            continue
        failures += [f"{name}: {p}" for p in found]
        if not quiet and not found:
            print(f"{name}: every COPY source is in the build context")
    if not quiet:
        print(f"build context: {len(sent)} files, {total / 1024:.0f} KiB")
    return failures


def main():
    patterns = read_patterns((ROOT / ".dockerignore").read_text())
    failures = check(patterns)
    for f in failures:
        print(f"FAIL {f}", file=sys.stderr)
    # The check has teeth: the same allow-list without `!benches` loses the tools image.
    without = [p for p in patterns if not (p[0] and p[1] == "benches")]
    assert len(without) == len(patterns) - 1, ".dockerignore no longer has !benches"
    lost = check(without, quiet=True)
    assert any("tools.Dockerfile: benches" in f for f in lost), lost
    assert all(
        excluded(p, patterns) == want
        for p, want in [("target/release/loadgen", True), ("target/envoy_kv_router.wasm", False),
                        ("src/lib.rs", False), ("core/src/lib.rs", False), ("README.md", True),
                        ("tools/src/lib.rs", False)]
    )
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
