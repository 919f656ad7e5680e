#!/usr/bin/env python3
"""Independent block-hash test vectors for tests/hash_vectors.rs.

Computes Dynamo's block hashing with Python's `xxhash` package (not our Rust code):
local = XXH3-64(tokens as little-endian u32, seed), seed = 1337, or with a LoRA adapter
1337 + XXH3-64(name, seed 0) mod 2^64; seq[0] = local[0],
seq[i] = XXH3-64(le_u64(seq[i-1]) ++ le_u64(local[i]), seed 1337). Only full blocks.

Usage (the `xxhash` package comes from PyPI):
    python3 -m venv /tmp/hashvec && /tmp/hashvec/bin/pip install xxhash
    /tmp/hashvec/bin/python scripts/gen_hash_vectors.py > tests/data/hash_vectors.json
"""
import json
import struct
import sys

import xxhash

SEED = 1337
MASK = (1 << 64) - 1


def seed_for(lora):
    if not lora:
        return SEED
    return (SEED + xxhash.xxh3_64_intdigest(lora.encode("utf-8"), seed=0)) & MASK


def local_hashes(tokens, block_size, seed):
    out = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start:start + block_size]
        data = struct.pack("<%dI" % len(block), *block)
        out.append(xxhash.xxh3_64_intdigest(data, seed=seed))
    return out


def chain(locals_):
    out = []
    for local in locals_:
        if not out:
            out.append(local)
        else:
            data = struct.pack("<QQ", out[-1], local)
            out.append(xxhash.xxh3_64_intdigest(data, seed=SEED))
    return out


def lcg_tokens(n, state, vocab):
    """Deterministic pseudo-random token ids (no dependence on Python's random module)."""
    out = []
    for _ in range(n):
        state = (state * 6364136223846793005 + 1442695040888963407) & MASK
        out.append((state >> 33) % vocab)
    return out


def main():
    sequences = {
        "counting": list(range(200)),
        "lcg_vocab_32k": lcg_tokens(300, 42, 32000),
        "large_ids": [0xFFFFFFFF, 0, 0x80000000, 1] * 40 + [7, 7, 7],
        "short": [5, 6, 7],
    }
    vectors = []
    for name, tokens in sequences.items():
        for block_size in (4, 16, 64):
            for lora in (None, "my-adapter", ""):
                seed = seed_for(lora)
                locals_ = local_hashes(tokens, block_size, seed)
                vectors.append({
                    "name": name,
                    "tokens": tokens,
                    "block_size": block_size,
                    "lora_name": lora,
                    "seed": str(seed),
                    "local_hashes": [str(h) for h in locals_],
                    "sequence_hashes": [str(h) for h in chain(locals_)],
                })
    doc = {
        "generator": "scripts/gen_hash_vectors.py (python xxhash %s)" % xxhash.VERSION,
        "note": "u64 values as decimal strings",
        "vectors": vectors,
    }
    # One vector per line: reviewable diffs without a 100 kB indented file.
    sys.stdout.write('{"generator": %s,\n "note": %s,\n "vectors": [\n' % (
        json.dumps(doc["generator"]), json.dumps(doc["note"])))
    sys.stdout.write(",\n".join("  " + json.dumps(v) for v in vectors))
    sys.stdout.write("\n]}\n")


if __name__ == "__main__":
    main()
