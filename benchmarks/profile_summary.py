"""Where a step's time goes, from a `jax.profiler` trace of XLA:CPU.

    python benchmarks/vs_redco.py --ks 4 --shapes large --rounds 1 --steps 3 --profile-dir /tmp/prof --no-write
    python benchmarks/profile_summary.py /tmp/prof/redeqx-4-128 /tmp/prof/redco-4-128

XLA:CPU records one event per executed HLO instruction (thunk), per device.
On 8 simulated devices sharing a few cores the events overlap, so an event's
duration is not its cost; this splits the wall clock instead: each moment is
shared equally among the instructions running then, and the shares are summed
per instruction and per kind (the instruction's name without its number),
then divided by the number of steps. What the trace cannot show is time the
kernel spends for the process (page faults on freshly allocated temporaries):
vs_redco.py reports that from `getrusage` beside each side's step time.
"""

import argparse
import collections
import gzip
import json
import re
from pathlib import Path


def load(folder: Path) -> list[dict]:
    traces = sorted(folder.glob("**/perfetto_trace.json.gz"))
    if not traces:
        raise SystemExit(f"{folder}: no perfetto_trace.json.gz under it (record with --profile-dir)")
    with gzip.open(traces[-1]) as f:
        events = json.load(f)["traceEvents"]
    return [e for e in events
            if e.get("ph") == "X" and e.get("name") == e.get("args", {}).get("hlo_op")]


def wall_shares(events: list[dict]) -> collections.Counter:
    """Seconds of wall clock per instruction name, each moment split equally
    among the instructions running at it."""
    edges = sorted([(e["ts"], 1, e["name"]) for e in events] + [(e["ts"] + e["dur"], -1, e["name"]) for e in events])
    running, shares, last = collections.Counter(), collections.Counter(), None
    for t, change, name in edges:
        if last is not None and running:
            total = sum(running.values())
            for n, count in running.items():
                shares[n] += (t - last) * count / total / 1e6
        last = t
        running[name] += change
        if not running[name]:
            del running[name]
    return shares


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folders", nargs="+", type=Path, help="trace folders (one per worker)")
    p.add_argument("--top", type=int, default=12, help="kinds and instructions to list")
    args = p.parse_args()
    for folder in args.folders:
        events = load(folder)
        # a step is one execution on every device: the most common count of an instruction over devices
        per_device = collections.Counter(e["name"] for e in events)
        devices = len({e["args"].get("device_ordinal") for e in events}) or 1
        steps = max(1, collections.Counter(per_device.values()).most_common(1)[0][0] // devices)
        shares = wall_shares(events)
        kinds = collections.Counter()
        for name, s in shares.items():
            kinds[re.sub(r"\.\d+$", "", name)] += s
        print(f"{folder}: {steps} steps, {sum(shares.values()) / steps:.2f} s of wall clock per step in XLA ops")
        for kind, s in kinds.most_common(args.top):
            print(f"  {s / steps:8.3f} s  {kind}")
        print("  top instructions:")
        for name, s in shares.most_common(args.top):
            print(f"  {s / steps:8.3f} s  {name}")


if __name__ == "__main__":
    main()
