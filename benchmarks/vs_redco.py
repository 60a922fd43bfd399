"""redeqx vs redco 0.4.23 on a user's own model, side by side in one run.

    python -m benchmarks.vs_redco --setup     # once: benchmarks/.venv-redco, redco 0.4.23 on this jax (~1 min)
    python -m benchmarks.vs_redco             # K = 1, 2, 4 at both shapes; writes benchmarks/RESULTS.md
    python -m benchmarks.vs_redco --sides redeqx --ks 2 --shapes small --rounds 1 --steps 2 --layers 1 --width 64 \
        --vocab 512 --seq 64 --no-write       # redeqx's side alone, small

The workload: a GPT-2-style model (4 layers, width 256, 8 heads, vocab 8192,
256 tokens, tied embedding, fp32), next-token cross-entropy,
clip_by_global_norm(1) + AdamW, on 8 simulated CPU devices with
n_model_shards = K. redeqx trains the plain-Equinox model of
tests/user_gpt.py through its public API (``redeqx_side`` here, in a fresh
process); redco trains Hugging Face's FlaxGPT2LMHeadModel of the same config
with its Deployer + Trainer (_redco_worker.py) in its own virtual
environment, on the jax of this one (so both run the same XLA). Both read
the same token file. For each shape and K, fresh worker processes alternate
(redeqx, redco, then redco, redeqx, ...); each compiles, warms up, then times
``--steps`` steps of its own loop (collate, host-to-device, step, loss to the
host). Reported per step: median wall and CPU seconds, and from the first
round's compiled step its collectives, FLOPs and temporaries. ``small`` is
global batch 64, ``large`` 128 (``--large-batch``).
"""

import json
import math
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

from benchmarks._common import HERE, cpu8_env, parser, report, serve, worker

import numpy as np  # noqa: E402
from user_gpt import make_examples  # noqa: E402

import redeqx  # noqa: E402

N_DEVICES = 8
# redco 0.4.23 asks only for jax, flax and optax; Transformers must stay 4.x (5.x dropped Flax)
REDCO_PACKAGES = ["redco==0.4.23", "tqdm", "flax==0.12.8", "optax==0.2.8", "orbax-checkpoint==0.12.8",
                  "transformers==4.57.6"]
SIDES = ("redeqx", "redeqx-smean", "redco")  # redeqx-smean: make_train_step(shard_mean_loss=True)
REDCO_VENV = HERE / ".venv-redco"


def setup() -> None:
    packages = [*REDCO_PACKAGES, f"jax=={version('jax')}", f"jaxlib=={version('jaxlib')}"]
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(REDCO_VENV)], check=True)
    subprocess.run([str(REDCO_VENV / "bin" / "python"), "-m", "pip", "install", "-q", *packages], check=True)
    print(f"redco venv ({' '.join(packages)}) ready at {REDCO_VENV}")


def redeqx_side(k, batch, warmup, steps, layers, width, heads, vocab, seq, data, hlo, shard_mean_loss) -> dict:
    """One redeqx run: the user's loop (``for batch in redeqx.batches(...)``)
    with the loss read back each step, as redco's Trainer does for its
    progress bar; intervals from one step's loss on the host to the next's."""
    import jax
    import optax
    from accelerator_count import reassociated_collectives
    from jax.sharding import PartitionSpec as P
    from user_gpt import GPT, collate_fn, loss_fn

    examples = [{"tokens": row} for row in np.load(data)[:(warmup + steps) * batch]]
    mesh = redeqx.make_mesh(k)
    model = GPT(vocab=vocab, seq=seq, width=width, layers=layers, heads=heads, key=jax.random.key(0))
    specs = redeqx.sharding_rules(model, mesh)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4, weight_decay=0.01))
    state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1))
    train_step = redeqx.make_train_step(loss_fn, optimizer, mesh, specs, shard_mean_loss=shard_mean_loss)
    marks, losses = [], []
    for i, rows in enumerate(redeqx.batches(examples, collate_fn, batch // mesh.shape["data"], mesh, shuffle=True,
                                            key=jax.random.key(2))):
        state, metrics = train_step(state, rows)
        losses.append(float(metrics["loss"]))  # to the host, as a progress bar would
        if i >= warmup - 1:  # the mark after the last warm-up step starts the first interval
            usage = resource.getrusage(resource.RUSAGE_SELF)  # the kernel's share: system time, page faults
            marks.append((time.perf_counter(), time.process_time(), usage.ru_stime, usage.ru_minflt))
    out = {name: [b[i] - a[i] for a, b in zip(marks, marks[1:])] for i, name in enumerate(("wall", "cpu", "sys",
                                                                                          "faults"))}
    out.update(versions={n: version(n) for n in ("redeqx", "jax", "jaxlib", "equinox", "optax")},
               first_loss=losses[0], last_loss=losses[-1],
               n_params=int(sum(x.size for x in jax.tree.leaves(model) if isinstance(x, jax.Array))),
               plan={jax.tree_util.keystr(kp): str(spec) for kp, spec in jax.tree_util.tree_flatten_with_path(
                   specs, is_leaf=lambda x: isinstance(x, P))[0]})
    if hlo:
        from accelerator_count import partitioned_text

        compiled = train_step.lower(state, rows).compile()
        cost = compiled.cost_analysis()
        out.update(hlo=compiled.as_text(), flops=float((cost[0] if isinstance(cost, list) else cost)["flops"]),
                   temp_bytes=int(compiled.memory_analysis().temp_size_in_bytes),
                   accelerator_bytes=sum(c.bytes for c in reassociated_collectives(
                       partitioned_text(train_step, state, rows))))
    return out


def run_side(side, k, batch, args, data, workdir, hlo: bool) -> dict:
    t = time.perf_counter()
    sizes = dict(k=k, batch=batch, warmup=args.warmup, steps=args.steps, layers=args.layers, width=args.width,
                 heads=args.heads, vocab=args.vocab, seq=args.seq)
    if side == "redco":
        out = workdir / f"redco-{k}-{batch}.json"
        cmd = [str(args.redco_python), str(HERE / "_redco_worker.py"), *(f"--{n}={v}" for n, v in sizes.items()),
               f"--data={data}", f"--out={out}", *([f"--hlo={workdir / 'redco.hlo'}"] if hlo else [])]
        env = dict(cpu8_env(), TRANSFORMERS_VERBOSITY="error", TF_CPP_MIN_LOG_LEVEL="3")
        env.pop("PYTHONPATH", None)  # nothing of this environment leaks into redco's
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"redco worker (K={k}, batch {batch}) failed:\n{proc.stdout[-3000:]}\n"
                               f"{proc.stderr[-6000:]}")
        result = json.loads(out.read_text())
        if hlo:
            from accelerator_count import reassociated_collectives

            result["hlo"] = (workdir / "redco.hlo").read_text()
            result["accelerator_bytes"] = sum(c.bytes for c in reassociated_collectives(
                (workdir / "redco.hlo.spmd").read_text()))
    else:
        result = worker(__file__, "redeqx_side", data=str(data), hlo=hlo, shard_mean_loss=side == "redeqx-smean",
                        **sizes)
    if hlo:
        result["collectives"] = redeqx.collective_summary(result.pop("hlo"))
    result["process_s"] = time.perf_counter() - t
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
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    lines = [f"Machine: {cpu}, {len(os.sched_getaffinity(0))} cores, {platform.system()} {platform.machine()}, "
             f"Python {platform.python_version()}; {N_DEVICES} simulated CPU devices in every worker."]
    lines += [f"{side} side: " + ", ".join(f"{n} {v}" for n, v in versions[side].items()) for side in versions]
    return "\n".join(lines)


def main():
    if serve(globals()):
        return
    p = parser(__doc__)
    p.add_argument("--setup", action="store_true", help="create benchmarks/.venv-redco and exit")
    p.add_argument("--redco-python", type=Path, default=REDCO_VENV / "bin" / "python",
                   help="a python with redco 0.4.23 (default: the --setup venv's)")
    p.add_argument("--ks", default="1,2,4", help="n_model_shards values")
    p.add_argument("--sides", default="redeqx,redco", help=f"which to run, alternating: {', '.join(SIDES)}")
    p.add_argument("--shapes", default="small,large", help="small (global batch 64) and/or large")
    p.add_argument("--large-batch", type=int, default=128, help="global batch of the large shape")
    p.add_argument("--rounds", type=int, default=3, help="fresh worker pairs per (shape, K)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per worker")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per worker (the first compiles)")
    for name, default in (("layers", 4), ("width", 256), ("heads", 8), ("vocab", 8192), ("seq", 256)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--timeout", type=int, default=3600, help="seconds per worker")
    args = p.parse_args()
    if args.setup:
        return setup()
    ks, sides, shapes = [int(k) for k in args.ks.split(",")], tuple(args.sides.split(",")), args.shapes.split(",")
    batches = {"small": 64, "large": args.large_batch}
    if any(s not in SIDES for s in sides) or any(s not in batches for s in shapes):
        sys.exit(f"--sides {args.sides!r} / --shapes {args.shapes!r}: choose from {SIDES} / small, large")
    if "redco" in sides and not args.redco_python.exists():
        sys.exit(f"no redco python at {args.redco_python}: run `python -m benchmarks.vs_redco --setup` first "
                 "(or pass --redco-python).")
    for k in ks:
        for s in shapes:
            if N_DEVICES % k or batches[s] % (N_DEVICES // k):
                sys.exit(f"--ks {k}: global batch {batches[s]} ({s}) does not split over {N_DEVICES} devices.")

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
                        res = run_side(side, k, batch, args, data, workdir, hlo=r == 0)
                        runs[side].append(res)
                        versions[side] = res["versions"]
                        print(f"{shape} K={k} round {r} {side:6s}: {statistics.median(res['wall']):.3f} s/step, "
                              f"{statistics.median(res['cpu']):.3f} CPU-s/step "
                              f"({statistics.median(res['sys']):.2f} in the kernel), loss {res['first_loss']:.3f} -> "
                              f"{res['last_loss']:.3f} ({res['process_s']:.0f} s in all)", flush=True)
                for side in sides:
                    first = runs[side][0]  # its figures of the compiled step; the times of every round
                    results[(shape, k, side)] = dict(first, **{
                        key: statistics.median([t for run in runs[side] for t in run[key]])
                        for key in ("wall", "cpu", "sys", "faults")})
                    if abs(first["first_loss"] - math.log(args.vocab)) > 0.5:
                        print(f"WARNING: {side} first loss {first['first_loss']:.3f} is far from ln(vocab)")

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
                ratio = (f"**{r['wall'] / results[(shape, k, 'redco')]['wall']:.2f}**"
                         if side != "redco" and "redco" in sides else "")
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
            plan = results[(*key, side)].get("plan", {}) if (*key, side) in results else {}
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
        f"Hugging Face's `FlaxGPT2LMHeadModel` of the same config (dropout 0) with `Deployer` + `Trainer` "
        "(`params_sharding_rules=deployer.get_sharding_rules(params)`; n_model_shards=1 is redco's pmap path). "
        f"Median over {args.rounds} rounds of fresh alternating processes x {args.steps} timed steps of each "
        f"side's own loop (after {args.warmup} warm-up steps); collectives, FLOPs and temporaries per device from "
        "each side's compiled step; \"as XLA:GPU/TPU move them\" by tests/accelerator_count.py.",
        "",
        machine(versions),
        "",
        *rows,
        "",
        "Parameters split over `model` (first layer and embeddings; everything else replicated):",
        "",
        *plans,
    ])
    report(args, "redeqx vs redco on a user's model (benchmarks/vs_redco.py)", body)


if __name__ == "__main__":
    main()
