"""Drives a real vLLM engine and checks kv-event-bridge against it.

Needs a running engine (scripts/vllm/serve.sh) and a bridge connected to it. Runs with the
engine's venv python (pyzmq, msgspec). After each phase it waits until the bridge has applied the
engine's newest batch, then checks:
  * the bridge's /kv/dump equals the blocks a full replay of the engine's events gives (read
    independently here, with pyzmq, from the engine's replay socket, reference-counted);
  * replaying the bridge's /kv/events page from the start gives the same blocks.

Usage: python bridge_check.py --api http://127.0.0.1:8100 --bridge http://127.0.0.1:8200 \
           --replay tcp://127.0.0.1:5558 [--topic kv] [--block-size 32] [--phases all]
Exit status 0 when every check passed.
"""
import argparse
import json
import sys
import time
import urllib.request

import msgspec
import zmq

ap = argparse.ArgumentParser()
ap.add_argument("--api", default="http://127.0.0.1:8100")
ap.add_argument("--bridge", default="http://127.0.0.1:8200")
ap.add_argument("--replay", default="tcp://127.0.0.1:5558")
ap.add_argument("--topic", default="kv")
ap.add_argument("--block-size", type=int, default=32)
ap.add_argument("--phases", default="prefix,decode,evict,reset",
                help="comma list, run in order: prefix, decode, evict, reset, check (check only)")
ap.add_argument("--timeout", type=float, default=30.0)
args = ap.parse_args()
BS = args.block_size


def http_json(url, body=None, method=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        raw = r.read()
    return json.loads(raw) if raw else None


def complete(prompt_ids, max_tokens):
    return http_json(f"{args.api}/v1/completions", {
        "model": "tiny", "prompt": prompt_ids, "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": True})


def engine_history():
    """Every buffered batch of the engine, from its replay socket: [(seq, payload)]."""
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(args.replay)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    out = []
    while True:
        if not dealer.poll(5000):
            raise SystemExit("replay socket did not answer")
        frames = dealer.recv_multipart()
        seq = int.from_bytes(frames[-2], "big", signed=True)
        if seq == -1:
            break
        out.append((seq, frames[-1]))
    dealer.close()
    return out


def reference(history):
    """(rank, medium, hash, parent, tokens) of every block the engine holds after its history."""
    held = {}
    for _, payload in history:
        ts, events, rank = msgspec.msgpack.decode(payload)
        rank = rank or 0
        for e in events:
            t = e["type"]
            if t == "BlockStored":
                medium = (e.get("medium") or "GPU").upper()
                parent = e.get("parent_block_hash")
                for i, h in enumerate(e["block_hashes"]):
                    key = (rank, medium, h)
                    if key in held:
                        held[key][0] += 1
                    else:
                        held[key] = [1, parent, tuple(e["token_ids"][i * BS:(i + 1) * BS])]
                    parent = h
            elif t == "BlockRemoved":
                medium = (e.get("medium") or "GPU").upper()
                for h in e["block_hashes"]:
                    key = (rank, medium, h)
                    if key in held:
                        held[key][0] -= 1
                        if held[key][0] == 0:
                            del held[key]
            elif t == "AllBlocksCleared":
                held = {k: v for k, v in held.items() if k[0] != rank}
    return {(r, m, h, p, t) for (r, m, h), (_, p, t) in held.items()}


def blocks_of(event):
    rank, medium = event["dp_rank"], event["medium"]
    parent, tokens = event["parent_block_hash"], event["token_ids"]
    out = []
    for i, h in enumerate(event["block_hashes"]):
        out.append((rank, medium, h, parent, tuple(tokens[i * BS:(i + 1) * BS])))
        parent = h
    return out


def bridge_dump():
    d = http_json(f"{args.bridge}/kv/dump")
    assert d["block_size"] == BS, d["block_size"]
    seen, out = set(), set()
    for e in d["events"]:
        for b in blocks_of(e):
            assert b[3] is None or (b[0], b[3]) in seen or not any(x[2] == b[3] for x in out), "child before parent"
            seen.add((b[0], b[2]))
            out.add(b)
    return out, d["last_event_id"]


def bridge_page_replay():
    after, blocks, n = 0, set(), 0
    while True:
        page = http_json(f"{args.bridge}/kv/events?after={after}")
        if page["first_event_id"] > after + 1:
            raise SystemExit(f"page lost events: first_event_id {page['first_event_id']} after {after}")
        for e in page["events"]:
            assert e["event_id"] == after + 1, (e["event_id"], after)
            after += 1
            n += 1
            if e["type"] == "BlockStored":
                blocks.update(blocks_of(e))
            elif e["type"] == "BlockRemoved":
                gone = set(e["block_hashes"])
                blocks = {b for b in blocks if not (b[0] == e["dp_rank"] and b[1] == e["medium"] and b[2] in gone)}
            elif e["type"] == "AllBlocksCleared":
                blocks = {b for b in blocks if b[0] != e["dp_rank"]}
        if after >= page["last_event_id"]:
            return blocks, n


def wait_bridge_at(seq):
    deadline = time.time() + args.timeout
    while time.time() < deadline:
        h = http_json(f"{args.bridge}/health")
        eng = h["engines"][0]
        if eng["last_seq"] == seq and eng["state"] == "connected":
            return h
        time.sleep(0.05)
    raise SystemExit(f"bridge did not reach engine seq {seq}: {json.dumps(h)}")


failures = 0


def check(phase):
    global failures
    # Events are flushed after the engine step; give the publisher a moment after the response.
    time.sleep(0.3)
    history = engine_history()
    last_seq = history[-1][0] if history else None
    h = wait_bridge_at(last_seq) if last_seq is not None else http_json(f"{args.bridge}/health")
    want = reference(history)
    dumped, last_id = bridge_dump()
    paged, n_events = bridge_page_replay()
    ok = dumped == want and paged == want
    failures += not ok
    m = urllib.request.urlopen(f"{args.bridge}/metrics", timeout=10).read().decode()
    counters = {k: sum(float(l.rsplit(" ", 1)[1]) for l in m.splitlines() if l.startswith(k))
                for k in ("kv_bridge_seq_gaps_total", "kv_bridge_resets_total", "kv_bridge_bad_frames_total",
                          "kv_bridge_refused_events_total", "kv_bridge_replays_total")}
    print(f"[{'ok' if ok else 'FAIL'}] {phase}: engine seq {last_seq} ({len(history)} batches buffered), "
          f"engine holds {len(want)} blocks, bridge dump {len(dumped)}, page replay {len(paged)} "
          f"({n_events} page events, last_event_id {last_id}), load {h.get('load')}, "
          + ", ".join(f"{k.replace('kv_bridge_', '')}={int(v)}" for k, v in counters.items()))
    if not ok:
        print("  only in engine:", sorted(b[2] for b in want - dumped)[:10])
        print("  only in dump:  ", sorted(b[2] for b in dumped - want)[:10])
        print("  page vs dump:  ", sorted(b[2] for b in paged ^ dumped)[:10])


def phase_prefix():
    shared = [4 + (i * 7) % 500 for i in range(96)]
    complete(shared + [100, 101, 102, 103], 8)
    check("prefix: 100-token prompt")
    complete(shared + [200 + i for i in range(40)], 8)
    check("prefix: 136 tokens sharing 96")
    complete(shared + [100, 101, 102, 103], 8)
    check("prefix: full hit (no event)")


def phase_decode():
    complete([300 + i for i in range(30)], 40)
    check("decode fills blocks")


def phase_evict():
    for k in range(8):
        complete([4 + ((i * 3 + 17 * k) % 500) for i in range(200)], 1)
    check("eviction: 8 x 200-token prompts in a 24-block cache")


def phase_reset():
    http_json(f"{args.api}/reset_prefix_cache", body={}, method="POST")
    complete([400 + i for i in range(40)], 1)
    check("reset_prefix_cache + request (AllBlocksCleared)")


PHASES = {"prefix": phase_prefix, "decode": phase_decode, "evict": phase_evict,
          "reset": phase_reset, "check": lambda: check("check")}
for name in args.phases.split(","):
    PHASES[name]()
sys.exit(1 if failures else 0)
