"""The runtime stage of a docker/*.Dockerfile, fed with binaries built on the host.

    prebuilt_dockerfile.py DOCKERFILE OUTDIR

Writes OUTDIR/Dockerfile: the global ARGs and the last stage of DOCKERFILE, with each
`COPY --from=build /src/target/release/<bin>... <dest>` turned into `COPY <bin>... <dest>` (the
build context is OUTDIR, where the caller puts the binaries). Prints two lines: the arguments of
the build stage's `RUN cargo build ...` (the caller runs the same build on the host) and the
binaries to copy. scripts/container-demo.sh uses it for CONTAINER_DEMO_BUILD=prebuilt, so the
image is the Dockerfile's own runtime stage, not a copy of it that could drift.
"""

import shlex
import sys
from pathlib import Path

RELEASE = "/src/target/release/"


def logical_lines(text):
    """Instructions with `\\` continuations joined, comments and blank lines dropped."""
    out, cur = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not cur and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        out.append(cur + line)
        cur = ""
    return out


def convert(text):
    lines = logical_lines(text)
    froms = [i for i, l in enumerate(lines) if l.upper().startswith("FROM ")]
    if len(froms) < 2:
        raise SystemExit("expected a build stage and a runtime stage")
    global_args = [l for l in lines[: froms[0]] if l.upper().startswith("ARG ")]
    build = lines[froms[0] : froms[1]]
    cargo = [l for l in build if l.upper().startswith("RUN ") and "cargo build" in l]
    if len(cargo) != 1:
        raise SystemExit("expected one `RUN cargo build` in the build stage")
    cargo_args = shlex.split(cargo[0].split("cargo build", 1)[1])
    runtime, bins = [], []
    for line in lines[froms[-1] :]:
        words = line.split()
        if words[0].upper() == "COPY" and any(w.startswith("--from") for w in words):
            if words[1] != "--from=build" or len(words) < 4:
                raise SystemExit(f"unsupported copy: {line}")
            sources, dest = words[2:-1], words[-1]
            if not all(s.startswith(RELEASE) for s in sources):
                raise SystemExit(f"copies something other than a release binary: {line}")
            names = [s[len(RELEASE) :] for s in sources]
            bins += names
            line = " ".join(["COPY", *names, dest])
        runtime.append(line)
    if not bins:
        raise SystemExit("the runtime stage copies no binary from the build stage")
    dockerfile = "\n".join(global_args + runtime) + "\n"
    return dockerfile, cargo_args, bins


def main():
    src, outdir = Path(sys.argv[1]), Path(sys.argv[2])
    dockerfile, cargo_args, bins = convert(src.read_text())
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "Dockerfile").write_text(f"# Generated from {src}: its runtime stage.\n" + dockerfile)
    print(shlex.join(cargo_args))
    print(" ".join(bins))


if __name__ == "__main__":
    main()
