# Regenerate: .vllm/venv/bin/python make_expected.py . > EXPECTED.json
# Decodes the fixtures with msgspec (vLLM's own msgpack library) into EXPECTED.json.
import json, sys, pathlib, msgspec
d = pathlib.Path(sys.argv[1])
out = []
def h(v):
    if isinstance(v, (bytes, bytearray)): return {"bin": v.hex()}
    return v
for i in range(18):
    b = msgspec.msgpack.decode((d / f"{i:04d}.msgpack").read_bytes())
    ts, events, rank = b
    evs = []
    for e in events:
        t = e["type"]
        if t == "BlockStored":
            evs.append({"type": t, "block_hashes": [h(x) for x in e["block_hashes"]], "parent_block_hash": h(e.get("parent_block_hash")),
                        "token_ids": e["token_ids"], "block_size": e["block_size"], "medium": e.get("medium"), "lora_name": e.get("lora_name")})
        elif t == "BlockRemoved":
            evs.append({"type": t, "block_hashes": [h(x) for x in e["block_hashes"]], "medium": e.get("medium")})
        else:
            evs.append({"type": t})
    out.append({"seq": i, "ts": ts, "dp_rank": rank, "events": evs})
json.dump(out, sys.stdout, indent=None)
