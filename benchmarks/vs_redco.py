"""redeqx vs redco 0.4.23 on a user's own model, side by side in one run.

    python benchmarks/vs_redco.py --setup     # once: benchmarks/.venv-redco, redco 0.4.23 on this jax (~1 min)
    python benchmarks/vs_redco.py             # K = 1, 2, 4 at both shapes; writes benchmarks/RESULTS.md
    python benchmarks/vs_redco.py --ks 1,2 --rounds 1 --steps 2 --layers 1 --width 64 --vocab 512 --seq 64 --no-write

The workload: a GPT-2-style model (4 layers, width 256, 8 heads, vocab 8192,
256 tokens, tied embedding, fp32), next-token cross-entropy, clip_by_global_norm(1)
+ AdamW, on 8 simulated CPU devices with n_model_shards = K. redeqx trains the
plain-Equinox model of tests/user_gpt.py through its public API
(_redeqx_worker.py); redco trains Hugging Face's FlaxGPT2LMHeadModel of the
same config with its Deployer + Trainer (_redco_worker.py), in its own virtual
environment (redeqx never imports redco). Both read the same token file.

redco 0.4.23 pins nothing but "jax, flax, optax", so `--setup` installs it on
the jax of this environment ("same-jax": both sides then run the same XLA and
differ only in what the libraries ask of it) with the last Transformers 4.x
(5.x dropped Flax); `--setup --redco-stack 2024` builds the set of redco's own
time (jax 0.4.30, flax 0.8.5, Transformers 4.44) in benchmarks/.venv-redco-2024,
and `--redco-stack 2024` runs against it.

For each shape and K, fresh worker processes alternate (redeqx, redco, then
redco, redeqx, ...); each compiles, warms up, then times ``--steps`` steps of
its own training loop (collate, host-to-device, step, loss to the host).
Reported per step: median wall seconds and CPU-seconds (``process_time``:
all of the process's threads), and, from the compiled step of the first
round, collectives (count, bytes per device, by ``redeqx.collective_summary``
on each side's HLO text; ``--hlo-dir`` keeps the texts) and FLOPs per device
(XLA's ``cost_analysis``, plus, on jax 0.4.30, the oneDNN matmul custom calls
that its XLA:CPU emits and ``cost_analysis`` counts as zero).

Shapes: ``small`` is global batch 64; ``large`` is global batch 128
(``--large-batch``), at least 16 sequences per data shard for every K, past
XLA:CPU's poor use of small per-device batches.
"""

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from importlib.metadata import version  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

import redeqx  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
from accelerator_count import reassociated_collectives  # noqa: E402
from user_gpt import make_examples  # noqa: E402

sys.path.insert(0, str(HERE))
from _common import write_section  # noqa: E402

N_DEVICES = 8
# Two tested sets of packages for redco 0.4.23 (it asks only for jax, flax and optax;
# Transformers must stay 4.x, since 5.x dropped Flax and so FlaxGPT2LMHeadModel):
# - "same-jax": the jax of this (redeqx's) environment, so both sides run the same XLA
#   and differ only in what the libraries ask of it (tested with jax 0.10.2);
# - "2024": redco 0.4.23's own time (jax 0.4.30, whose XLA:CPU is much slower here).
REDCO_STACKS = {
    "same-jax": lambda: [f"jax=={version('jax')}", f"jaxlib=={version('jaxlib')}", "flax==0.12.8", "optax==0.2.8",
                         "orbax-checkpoint==0.12.8", "transformers==4.57.6"],
    "2024": lambda: ["jax==0.4.30", "jaxlib==0.4.30", "flax==0.8.5", "optax==0.2.3", "orbax-checkpoint==0.6.4",
                     "chex==0.1.90", "transformers==4.44.2", "numpy<2"],
}
SIDES = ("redeqx", "redco")
# optional extra side: redeqx with make_train_step(shard_mean_loss=True) (--sides)
WORKERS = {"redeqx": "_redeqx_worker.py", "redeqx-smean": "_redeqx_worker.py", "redco": "_redco_worker.py"}


def redco_venv(stack: str) -> Path:
    return HERE / (".venv-redco" if stack == "same-jax" else f".venv-redco-{stack}")


def setup(stack: str) -> None:
    venv = redco_venv(stack)
    packages = ["redco==0.4.23", "tqdm", *REDCO_STACKS[stack]()]
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *packages], check=True)
    print(f"redco venv ({stack}: {' '.join(packages)}) ready at {venv} in {time.perf_counter() - t:.0f} s")


ARRAY = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")


def onednn_matmul_flops(hlo_text: str) -> int:
    """FLOPs of XLA:CPU's ``__onednn$matmul`` custom calls (jax 0.4.x rewrites most
    dots into them, and cost_analysis counts custom calls as zero):
    2 x result elements x contracted size."""
    total = 0
    for line in hlo_text.splitlines():
        if 'custom_call_target="__onednn$matmul"' not in line:
            continue
        head, _, operands = line.partition(" custom-call(")
        result = ARRAY.findall(head.split("=", 1)[1])[0]
        lhs = [int(d) for d in ARRAY.findall(operands)[0][1].split(",") if d]
        k = lhs[-2] if '"transpose_a":true' in line else lhs[-1]
        total += 2 * math.prod(int(d) for d in result[1].split(",") if d) * k
    return total


def run_worker(side, k, batch, args, data, workdir, hlo: Path | None):
    out = workdir / f"{side}-{k}-{batch}.json"
    cmd = [
        sys.executable if side != "redco" else str(args.redco_python), str(HERE / WORKERS[side]),
        "--k", str(k), "--batch", str(batch), "--warmup", str(args.warmup), "--steps", str(args.steps),
        "--layers", str(args.layers), "--width", str(args.width), "--heads", str(args.heads),
        "--vocab", str(args.vocab), "--seq", str(args.seq), "--data", str(data), "--out", str(out),
    ]
    if hlo is not None:
        cmd += ["--hlo", str(hlo)]
    if args.profile_dir is not None:
        cmd += ["--profile", str(args.profile_dir / f"{side}-{k}-{batch}")]
    if side == "redeqx-smean":
        cmd += ["--shard-mean-loss"]
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={N_DEVICES}",
               TRANSFORMERS_VERBOSITY="error", TF_CPP_MIN_LOG_LEVEL="3")
    if side == "redco":
        env.pop("PYTHONPATH", None)  # nothing of this venv leaks into redco's
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{side} worker (K={k}, batch {batch}) failed:\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    result = json.loads(out.read_text())
    result["process_s"] = time.perf_counter() - t
    if hlo is not None:
        text = hlo.read_text()
        result["collectives"] = redeqx.collective_summary(text)
        result["accelerator_bytes"] = sum(c.bytes for c in reassociated_collectives(Path(f"{hlo}.spmd").read_text()))
        result["flops"] = result["flops"] + onednn_matmul_flops(text)
    return result


def sharded(plan: dict) -> str:
    """The split leaves of the first layer and the embeddings, e.g. 'attn.c_attn.kernel (None, mp)'."""
    out = []
    for path, spec in plan.items():
        if spec in ("P()", "PartitionSpec()"):
            continue
        parts = [p for p in re.split(r"[./\[\]]+", path) if p and p != "transformer"]
        if any(p.isdigit() and p != "0" for p in parts):
            continue
        out.append(f"{'.'.join(p for p in parts if not p.isdigit() and p not in ('h', 'blocks'))} "
                   f"{spec.replace('PartitionSpec', '').replace('P', '')}")
    return ", ".join(out)


def machine(versions) -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1))
        mem = f", {kb / 2**20:.0f} GiB memory"
    except (OSError, AttributeError):
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    lines = [f"Machine: {cpu}, {cores} cores{mem}, {platform.system()} {platform.machine()}, "
             f"Python {platform.python_version()}; {N_DEVICES} simulated CPU devices "
             "(`--xla_force_host_platform_device_count`) in every worker."]
    for side in SIDES:
        if side in versions:
            lines.append(f"{side} side: " + ", ".join(f"{n} {v}" for n, v in versions[side].items()))
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setup", action="store_true", help="create the redco venv of --redco-stack and exit")
    p.add_argument("--redco-stack", choices=sorted(REDCO_STACKS), default="same-jax",
                   help="which redco venv: same-jax (benchmarks/.venv-redco) or 2024 (benchmarks/.venv-redco-2024)")
    p.add_argument("--redco-python", type=Path, default=None,
                   help="a python with redco 0.4.23 (instead of --redco-stack's venv)")
    p.add_argument("--ks", default="1,2,4", help="n_model_shards values")
    p.add_argument("--sides", default="redeqx,redco",
                   help="which to run, alternating: redeqx, redeqx-smean (shard_mean_loss=True), redco")
    p.add_argument("--shapes", default="small,large", help="small (global batch 64) and/or large")
    p.add_argument("--large-batch", type=int, default=128, help="global batch of the large shape")
    p.add_argument("--rounds", type=int, default=3, help="fresh worker pairs per (shape, K)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per worker")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per worker (the first compiles)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--timeout", type=int, default=3600, help="seconds per worker")
    p.add_argument("--hlo-dir", type=Path, default=None, help="keep each side's compiled step (HLO text) here")
    p.add_argument("--profile-dir", type=Path, default=None,
                   help="record each worker's timed steps with jax.profiler (a Perfetto trace) under this folder; "
                        "summarise with benchmarks/profile_summary.py")
    p.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    args = p.parse_args()

    if args.setup:
        setup(args.redco_stack)
        return
    if args.redco_python is None:
        args.redco_python = redco_venv(args.redco_stack) / "bin" / "python"
    if not args.redco_python.exists():
        sys.exit(f"no redco python at {args.redco_python}: run `python benchmarks/{Path(__file__).name} --setup "
                 f"--redco-stack {args.redco_stack}` first (or pass --redco-python).")
    ks = [int(k) for k in args.ks.split(",")]
    sides = tuple(args.sides.split(","))
    if "redco" not in sides or any(s not in WORKERS for s in sides):
        sys.exit(f"--sides: {args.sides!r}; name redco and any of redeqx, redeqx-smean, comma-separated.")
    batches = {"small": 64, "large": args.large_batch}
    shapes = args.shapes.split(",")
    for s in shapes:
        if s not in batches:
            sys.exit(f"--shapes: unknown shape {s!r}; choose from small, large.")
    for k in ks:
        if N_DEVICES % k:
            sys.exit(f"--ks: {k} does not divide {N_DEVICES} devices.")
        for s in shapes:
            if batches[s] % (N_DEVICES // k):
                sys.exit(f"global batch {batches[s]} ({s}) does not split over {N_DEVICES // k} data shards (K={k}).")
    if "large" in shapes and args.large_batch // N_DEVICES < 16:
        print(f"note: --large-batch {args.large_batch} gives < 16 sequences per data shard at K=1")

    if args.hlo_dir is not None:
        args.hlo_dir.mkdir(parents=True, exist_ok=True)
    results: dict[tuple, dict] = {}
    versions = {}
    with tempfile.TemporaryDirectory(prefix="vs_redco-") as tmp:
        workdir = Path(tmp)
        need = (args.warmup + args.steps + 1) * max(batches[s] for s in shapes)
        data = workdir / "tokens.npy"
        np.save(data, np.stack([e["tokens"] for e in make_examples(need, args.seq, args.vocab, seed=0)]))
        for shape in shapes:
            batch = batches[shape]
            for k in ks:
                runs = {side: [] for side in sides}
                for r in range(args.rounds):
                    for side in sides if r % 2 == 0 else sides[::-1]:
                        hlo = (args.hlo_dir or workdir) / f"{side}-{shape}-K{k}.hlo" if r == 0 else None
                        res = run_worker(side, k, batch, args, data, workdir, hlo)
                        runs[side].append(res)
                        versions[side] = res["versions"]
                        print(f"{shape} K={k} round {r} {side:6s}: {statistics.median(res['wall']):.3f} s/step, "
                              f"{statistics.median(res['cpu']):.3f} CPU-s/step "
                              f"({statistics.median(res['sys']):.2f} in the kernel), loss {res['first_loss']:.3f} -> "
                              f"{res['last_loss']:.3f} ({res['process_s']:.0f} s in all)", flush=True)
                for side in sides:
                    first = runs[side][0]
                    results[(shape, k, side)] = {
                        "wall": statistics.median([t for run in runs[side] for t in run["wall"]]),
                        "cpu": statistics.median([t for run in runs[side] for t in run["cpu"]]),
                        "sys": statistics.median([t for run in runs[side] for t in run["sys"]]),
                        "faults": statistics.median([t for run in runs[side] for t in run["faults"]]),
                        "collectives": first["collectives"],
                        "accelerator_bytes": first["accelerator_bytes"],
                        "flops": first["flops"],
                        "temp_bytes": first.get("temp_bytes"),
                        "first_loss": first["first_loss"],
                        "last_loss": first["last_loss"],
                        "plan": first.get("plan", {}),
                        "n_params": first["n_params"],
                    }
                    if abs(first["first_loss"] - math.log(args.vocab)) > 0.5:
                        print(f"WARNING: {side} first loss {first['first_loss']:.3f} is far from "
                              f"ln(vocab) = {math.log(args.vocab):.3f}")

    rows = [
        "| shape | K (data x model) | rows / data shard | side | s / step | CPU-s / step | of which kernel "
        "(page faults) | collectives | "
        "bytes / device | as XLA:GPU/TPU move them | GFLOP / device | temporaries / device | loss (first step -> last) | "
        "redeqx / redco time |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for shape in shapes:
        for k in ks:
            for side in sides:
                r = results[(shape, k, side)]
                count = sum(c["count"] for c in r["collectives"].values())
                nbytes = sum(c["bytes"] for c in r["collectives"].values())
                kinds = ", ".join(f"{v['count']} {kind}" for kind, v in sorted(r["collectives"].items()))
                ratio = (f"**{r['wall'] / results[(shape, k, 'redco')]['wall']:.2f}**" if side != "redco" else "")
                temp = f"{r['temp_bytes'] / 2**30:.2f} GiB" if r.get("temp_bytes") is not None else "?"
                rows.append(
                    f"| {shape} | {k} ({N_DEVICES // k} x {k}) | {batches[shape] // (N_DEVICES // k)} | {side} | "
                    f"{r['wall']:.3f} | {r['cpu']:.3f} | {r['sys']:.2f} s ({r['faults'] / 1e6:.2f}M) | {count} ({kinds or 'none'}) | {nbytes / 2**20:.2f} MiB | "
                    f"{r['accelerator_bytes'] / 2**20:.2f} MiB | {r['flops'] / 1e9:.2f} | {temp} | {r['first_loss']:.3f} -> {r['last_loss']:.3f} | {ratio} |")
    plans = []
    for k in ks:
        if k == 1:
            continue
        key = next(((s, k) for s in shapes), None)
        for side in SIDES:
            plan = results[(*key, side)]["plan"] if (*key, side) in results else {}
            plans.append(f"- K={k}, {side}: {sharded(plan) or 'nothing split'}")
    n_params = results[(shapes[0], ks[0], sides[0])]["n_params"]
    body = "\n".join([
        f"GPT-2-style model: {args.layers} layers, width {args.width}, {args.heads} heads, vocab {args.vocab}, "
        f"{args.seq} tokens, tied embedding, learned positions, fp32 ({n_params / 1e6:.2f}M parameters); "
        "clip_by_global_norm(1.0) + AdamW. redeqx: the plain-Equinox model of `tests/user_gpt.py` through "
        "`make_mesh` / `sharding_rules` / `init_state` / `make_train_step` / `batches`"
        + ("; redeqx-smean: the same with `make_train_step(..., shard_mean_loss=True)` (each data shard's "
           "gradients from its own rows, one all-reduce; its first-call check runs in the warm-up)"
           if "redeqx-smean" in sides else "")
        + ". redco 0.4.23: "
        f"Hugging Face's `FlaxGPT2LMHeadModel` of the same config (dropout 0) with `Deployer` + `Trainer`, in the "
        f"`{args.redco_stack}` package set "
        "(`params_sharding_rules=deployer.get_sharding_rules(params)`; n_model_shards=1 is redco's pmap path). "
        f"Median over {args.rounds} rounds of fresh alternating processes x {args.steps} timed steps of each "
        f"side's own loop (after {args.warmup} warm-up steps); collectives and FLOPs per device from each side's "
        "compiled step (redco's: the `Trainer`'s own pjit/pmap, lowered with its arguments), and its temporaries "
        "(XLA's memory analysis; XLA:CPU allocates them afresh at every call, so the kernel's page faults grow with "
        "them). \"As XLA:GPU/TPU move "
        "them\": the same program right after SPMD partitioning, with the two rewrites of those backends' pipelines "
        "that XLA:CPU lacks applied to the count (a sum of all-reduces over the same devices is one all-reduce of the "
        "sum; an all-reduce whose result is only sliced is a reduce-scatter), by `redeqx._hlo.reassociated_collectives`.",
        "",
        machine(versions),
        "",
        *rows,
        "",
        "Parameters split over `model` (first layer and embeddings; everything else replicated):",
        "",
        *plans,
    ])
    print()
    print(body)
    if not args.no_write:
        write_section("redeqx vs redco on a user's model (benchmarks/vs_redco.py)", body)


if __name__ == "__main__":
    main()
