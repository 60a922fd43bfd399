"""Which activation layout (and whether donation) makes a user's model train
fastest: the GPT-2-style model of benchmarks/vs_redco.py, redeqx only, each
variant in a fresh worker process, variants alternating within each round.

    python benchmarks/layout.py                      # K = 2, 4 at the small and the large shape
    python benchmarks/layout.py --ks 1 --variants auto,no-donate     # donation at K = 1

Reported per variant: median wall and CPU seconds per step, collectives
(count, bytes per device) of the compiled step. Decides `activation_layout="auto"`.
"""

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

import redeqx  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))
from _common import write_section  # noqa: E402
from user_gpt import make_examples  # noqa: E402


def worker(variant, k, batch, args, data, workdir):
    out, hlo = workdir / f"{variant}-{k}-{batch}.json", workdir / f"{variant}-{k}-{batch}.hlo"
    layout = {"no-donate": "auto", "xw": "auto"}.get(variant, variant)
    cmd = [sys.executable, str(HERE / "_redeqx_worker.py"), "--k", str(k), "--batch", str(batch), "--warmup",
           str(args.warmup), "--steps", str(args.steps), "--data", str(data), "--out", str(out), "--hlo", str(hlo),
           "--layout", layout] + (["--no-donate"] if variant == "no-donate" else []) + (
           ["--matmul", "xw"] if variant == "xw" else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600,
                          env=dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8"))
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-4000:])
    result = json.loads(out.read_text())
    result["collectives"] = redeqx.collective_summary(hlo.read_text())
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ks", default="2,4")
    p.add_argument("--shapes", default="small,large")
    p.add_argument("--variants", default="none,sequence,replicated")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    batches = {"small": 64, "large": 128}
    variants = args.variants.split(",")
    rows = ["| shape | K | variant | s / step | CPU-s / step | collectives | bytes / device |", "|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        data = workdir / "tokens.npy"
        need = (args.warmup + args.steps + 1) * max(batches[s] for s in args.shapes.split(","))
        np.save(data, np.stack([e["tokens"] for e in make_examples(need, 256, 8192, seed=0)]))
        for shape in args.shapes.split(","):
            for k in map(int, args.ks.split(",")):
                runs = {v: [] for v in variants}
                for r in range(args.rounds):
                    for v in variants if r % 2 == 0 else variants[::-1]:
                        runs[v].append(worker(v, k, batches[shape], args, data, workdir))
                        print(f"{shape} K={k} {v}: {statistics.median(runs[v][-1]['wall']):.3f} s/step", flush=True)
                for v in variants:
                    wall = statistics.median(t for run in runs[v] for t in run["wall"])
                    cpu = statistics.median(t for run in runs[v] for t in run["cpu"])
                    c = runs[v][0]["collectives"]
                    kinds = ", ".join(f"{x['count']} {kind}" for kind, x in sorted(c.items())) or "none"
                    nbytes = sum(x["bytes"] for x in c.values())
                    rows.append(f"| {shape} | {k} | {v} | {wall:.3f} | {cpu:.3f} | {kinds} | {nbytes / 2**20:.1f} MiB |")
    text = ("GPT-2-style user model of benchmarks/vs_redco.py (4 layers, width 256, vocab 8192, 256 tokens, fp32, "
            f"clip + AdamW) on 8 simulated CPU devices; medians over {args.rounds} alternating rounds x "
            f"{args.steps} steps; small = global batch 64, large = 128.\n\n" + "\n".join(rows))
    print(text)
    if not args.no_write:
        write_section("Activation layouts on a user's GPT (benchmarks/layout.py)", text)


if __name__ == "__main__":
    main()
