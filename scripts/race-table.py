#!/usr/bin/env python3
"""Prints the README's race table from `loadgen race` result files (results.json).

Usage: scripts/race-table.py [--no-targets] RESULTS.json [MORE.json ...]

One row per workload, one column per arm: TTFT mean / p99 (ms), prefix hit rate, max/mean
requests per worker (on a mixed fleet: the largest share of requests over the worker's share of
the speed), the medians of the runs; then the candidate's TTFT ratio to the best peer and the
targets it passed. Later files add workloads (or replace one of the same name).
"""
import json
import sys

SHORT = {
    "vllm-router:cache_aware": "cache_aware",
    "vllm-router:kv_aware": "kv_aware",
    "vllm-router:power_of_two": "power_of_two",
}
TARGET_NAMES = ["TTFT", "p99", "hit", "balance"]


def cell(m):
    if not m:
        return "-"
    t = m["ttft_ms"]
    return f'{t["mean"]:.0f} / {t["p99"]:.0f} / {100 * m["hit_rate"]:.1f}% / {m["balance"]:.2f}'


def main(paths, targets=True):
    workloads, arms, candidate, runs = {}, [], "kv", set()
    for path in paths:
        with open(path) as f:
            r = json.load(f)
        race = r["race"]
        candidate = race.get("candidate", candidate)
        runs.add(race.get("runs"))
        for a in race["arms"]:
            if a not in arms:
                arms.append(a)
        for name in race["workloads"]:
            w = r["workloads"].get(name)
            if w and w.get("medians"):
                workloads[name] = w
    peers = [a for a in arms if a.startswith("vllm-router:")]
    order = [candidate] + peers + [a for a in arms if a != candidate and a not in peers]
    head = ["workload"] + [f"**{a}**" if a == candidate else SHORT.get(a, a) for a in order]
    if targets:
        head += ["best peer / kv", "targets met"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name, w in workloads.items():
        med = w["medians"]
        row = [name] + [cell(med.get(a)) for a in order]
        if targets:
            ratio = w.get("targets", {}).get("ttft_mean_ratio_candidate_over_best_peer")
            row.append(f"{1 / ratio:.2f}x" if ratio else "-")
            judged = w.get("targets", {}).get("targets", [])
            met = [n for n, t in zip(TARGET_NAMES, judged) if t.get("pass")]
            row.append(", ".join(met) if met else "none")
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    args = sys.argv[1:]
    main([a for a in args if a != "--no-targets"], targets="--no-targets" not in args)
