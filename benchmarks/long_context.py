"""Long context: how long a training sequence fits with and without context
parallelism, planned on abstract shapes (nothing allocated, no TPU needed).

    python benchmarks/long_context.py              # TPU v4 via libtpu (benchmarks/.venv-tpu), else XLA:CPU
    python benchmarks/long_context.py --sizes 8b   # the 8B searches only
    python benchmarks/long_context.py --cache /tmp/lc.json   # keep each probe; a rerun skips the done ones

Each probe is one `redeqx.plan(..., explore=False)` of a LLaMA-3-shaped model
(bf16 compute, fp32 master weights, AdamW, remat, fsdp over data x context),
one sequence per step, in a subprocess with that many devices: libtpu's
compiler for a TPU v4 slice (32 GiB a chip) when benchmarks/.venv-tpu exists
(``python benchmarks/table1.py --setup-tpu``), else XLA:CPU's buffer
assignment against the same 32 GiB (said in the section). The longest
sequence is found by doubling from 4096 tokens. The collectives of
`redeqx.attention` alone are compared with the analytic count.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from _common import write_section

HERE = Path(__file__).resolve().parent
TPU_PYTHON = HERE / ".venv-tpu" / "bin" / "python"
MEMORY = 32 * 2**30  # a TPU v4 chip
SIZES = {  # LLaMA-3 shapes (vocab 128256, GQA with 8 KV heads)
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64),
}


# ----------------------------------------------------------------------------- worker (imports JAX)


def _devices(n: int, tpu: bool):
    import jax

    if not tpu:
        return jax.devices()[:n]
    from table1 import tpu_v4_devices

    return tpu_v4_devices(n)


def _plan(task: dict) -> dict:
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import AxisType, Mesh

    import numpy as np
    import redeqx
    from redeqx import models

    config = models.LlamaConfig(vocab_size=128256, num_key_value_heads=8, rope_theta=500000.0,
                                max_position_embeddings=task["seq"], context_attention=task["impl"],
                                **SIZES[task["size"]])
    devices = _devices(task["chips"], task["tpu"])
    c, m = task["context"], task["model"]
    if c == 0:  # today's path: no context axis at all
        mesh, seq_keys = redeqx.make_mesh(m, devices=devices), ()
    else:  # a context axis, of size 1 included (the blocked attention, no split)
        grid = np.asarray(devices, dtype=object).reshape(-1, c, m)
        mesh, seq_keys = Mesh(grid, ("data", "context", "model"), axis_types=(AxisType.Auto,) * 3), ("input_ids", "labels")

    def loss_fn(model, batch, key):
        logits = jax.vmap(model)(batch["input_ids"])
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["labels"]).mean()

    b = mesh.shape["data"]
    batch = {k: jax.ShapeDtypeStruct((b, task["seq"]), jnp.int32) for k in ("input_ids", "labels")}
    t = time.perf_counter()
    p = redeqx.plan(lambda key: models.LlamaForCausalLM(config, key=key), loss_fn, optax.adamw(1e-5), batch, mesh,
                    fsdp=True, remat=True, compute_dtype=jnp.bfloat16, device_memory=MEMORY, explore=False,
                    seq_keys=seq_keys)
    return dict(fits=bool(p.fits), peak=p.peak, temporaries=p.temporaries, flops=p.flops,
                collectives=p.collectives, refused=getattr(p, "refused", None), compile_s=time.perf_counter() - t)


def _attention_collectives(task: dict) -> dict:
    """`redeqx.attention` alone (value and grads) on one 8B layer's shapes: its collectives."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    import redeqx

    c, t = task["context"], task["seq"]
    mesh = redeqx.make_mesh(1, n_context_shards=c, devices=_devices(c, task["tpu"]))
    sh = NamedSharding(mesh, P(None, "context"))
    q = jax.ShapeDtypeStruct((1, t, 32, 128), jnp.bfloat16, sharding=sh)
    kv = jax.ShapeDtypeStruct((1, t, 8, 128), jnp.bfloat16, sharding=sh)

    def loss(q, k, v):
        return jnp.sum(redeqx.attention(q, k, v, impl=task["impl"]).astype(jnp.float32))

    with jax.set_mesh(mesh):
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile().as_text()
    return redeqx.collective_summary(text)


def worker(task: dict) -> None:
    out = _attention_collectives(task) if task["kind"] == "attention" else _plan(task)
    print(json.dumps(out))


# ----------------------------------------------------------------------------- driver (no JAX)


class NotProbed(Exception):
    """A probe missing from the cache, with --cached-only."""


class Runner:
    def __init__(self, tpu: bool, cache: Path | None, cached_only: bool = False):
        self.tpu, self.cache_path, self.cached_only = tpu, cache, cached_only
        self.cache = json.loads(cache.read_text()) if cache and cache.exists() else {}

    def __call__(self, **task) -> dict:
        task = dict(task, tpu=self.tpu)
        key = json.dumps(task, sort_keys=True)
        if key not in self.cache and self.cached_only:
            raise NotProbed(key)
        if key not in self.cache:
            env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={task['chips']}",
                       PYTHONWARNINGS="ignore::UserWarning")
            python = sys.executable
            if self.tpu:
                python = str(TPU_PYTHON)
                env.update(TPU_ACCELERATOR_TYPE=f"v4-{2 * task['chips']}", TPU_WORKER_HOSTNAMES="localhost",
                           ALLOW_MULTIPLE_LIBTPU_LOAD="1",  # other compiles (other probes, other sessions) may hold libtpu
                           TPU_SKIP_MDS_QUERY="1")
            proc = subprocess.run([python, __file__, "--worker", key], env=env, stdout=subprocess.PIPE, text=True)
            if proc.returncode:
                raise RuntimeError(f"probe {key} failed (exit {proc.returncode}); its output is above")
            self.cache[key] = json.loads(proc.stdout.strip().splitlines()[-1])
            if self.cache_path:
                self.cache_path.write_text(json.dumps(self.cache, indent=1))
        print(f"  {key} -> {json.dumps(self.cache[key])[:160]}", flush=True)
        return self.cache[key]


def longest(run: Runner, size: str, chips: int, context: int, model: int, start: int, impl="gather"):
    """The longest power-of-two multiple of 1024 tokens that fits (searched from ``start``, up or down), and its
    plan; with probes missing (--cached-only), the longest that fits among those made, and None."""
    try:
        return _longest(run, size, chips, context, model, start, impl)
    except NotProbed:
        fit = [json.loads(k)["seq"] for k, v in run.cache.items() if v.get("fits") and json.loads(k).get("kind") == "plan"
               and all(json.loads(k)[f] == x for f, x in (("size", size), ("context", context), ("model", model)))]
        return (max(fit) if fit else 0), None


def _longest(run: Runner, size: str, chips: int, context: int, model: int, start: int, impl: str):
    probe = lambda seq: run(kind="plan", size=size, chips=chips, context=context, model=model, seq=seq, impl=impl)  # noqa: E731
    seq, p = start, probe(start)
    step = 2 if p["fits"] else 0.5
    while True:
        nxt = int(seq * step)
        if nxt < 1024:
            return 0, None
        q = probe(nxt)
        if step == 2 and not q["fits"]:
            return seq, p
        if step == 0.5 and q["fits"]:
            return nxt, q
        seq, p = nxt, q


GPU_NOTE = """
On a GPU (waits for one): tokens/s of the 1B LLaMA with and without remat at the same 32768 tokens a step,
2k x 16 against 8k x 4 and 32k x 1 (attention's share grows with the sequence), then longer until a step fails:

    for s in "2048 16" "8192 4" "32768 1" "65536 1" "131072 1"; do set -- $s
      python benchmarks/throughput.py --size 1b --seq $1 --batch $2 --variants stacked,stacked+remat \\
        --no-hand --no-write --json benchmarks/results/throughput_1b_seq$1.json; done
"""


def gib(n) -> str:
    return f"{n / 2**30:.1f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker")
    parser.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=sorted(SIZES),
                        help="8b: the 8-chip searches, the C table and attention's bytes; 70b: the 64-chip searches")
    parser.add_argument("--cpu", action="store_true", help="XLA:CPU even when libtpu is installed")
    parser.add_argument("--cache", type=Path)
    parser.add_argument("--cached-only", action="store_true", help="compile nothing: the table from --cache's probes")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    tpu = TPU_PYTHON.exists() and not args.cpu
    run = Runner(tpu, args.cache, args.cached_only)
    compiler = "libtpu, TPU v4 (32 GiB a chip)" if tpu else "XLA:CPU's buffer assignment, against 32 GiB a device"
    lines = [f"Planned on abstract shapes by {compiler}: LLaMA-3-shaped models (vocab 128256, 8 KV heads), bf16 "
             "compute, fp32 weights + AdamW, remat, fsdp over data x context, one sequence per data row "
             "(the 70B without context parallelism: data 8 x model 8, 8 sequences a step, each on its own 8 chips). "
             "`today` is a mesh without a context axis (the zoo's unsplit attention, which forms the (T, T) "
             "scores off a GPU); `C=1` a context axis of one device (the blocked attention, nothing split).", "",
             "| model | chips | mesh (context x model) | longest sequence | peak GiB | temporaries GiB |",
             "|---|---|---|---|---|---|"]
    # (context, model, the search's first length): 0 = no context axis
    cases = [("8b", 8, [(8, 1, 32768), (0, 8, 8192), (1, 8, 16384)]),
             ("70b", 64, [(8, 8, 65536), (0, 8, 8192), (1, 8, 8192)])]
    cases = [case for case in cases if case[0] in args.sizes]
    found = {}
    for size, chips, meshes in cases:
        for c, m, start in meshes:
            seq, p = longest(run, size, chips, c, m, start)
            found[size, c, m] = seq
            mesh = "today, model 8" if c == 0 else f"{c} x {m}"
            shown = f"{seq}" if p else f"≥ {seq} (search unfinished)"
            lines.append(f"| {size} | {chips} | {mesh} | {shown} | {gib(p['peak']) if p else '-'} | "
                         f"{gib(p['temporaries']) if p else '-'} |")
    for size, chips, meshes in cases:
        blocked, today = found[size, 1, 8], found[size, 0, 8]
        best = max(found[k] for k in found if k[0] == size and k[1] > 1)
        lines.append(f"\n{size}: context parallelism fits {best} tokens: {best / max(blocked, 1):.0f}x the {blocked} of the same "
                     f"blocked attention unsplit, {best / max(today, 1):.0f}x the {today} of today's unsplit path.")
    if "8b" in args.sizes:
        lines += _attention_bytes(run), _per_c(run), _ring_step(run)
    lines.append(GPU_NOTE)
    print("\n".join(lines))
    if not args.no_write:
        write_section("Long context (benchmarks/long_context.py)", "\n".join(lines))


def _per_c(run: Runner) -> str:
    """Activation memory and FLOPs per token of the 8B at 32k tokens, for C = 1, 2, 4, 8 (model = 8 / C)."""
    rows = ["", "8B at 32768 tokens on 8 chips, C context shards x 8/C model shards:", "",
            "| C | temporaries GiB / device | FLOPs per token (all devices) | vs C=1 |", "|---|---|---|---|"]
    first = None
    for c in (1, 2, 4, 8):
        try:
            p = run(kind="plan", size="8b", chips=8, context=c, model=8 // c, seq=32768, impl="gather")
        except NotProbed:
            rows.append(f"| {c} | not probed | | |")
            continue
        per_token = p["flops"] * 8 / 32768
        first = first or per_token
        rows.append(f"| {c} | {gib(p['temporaries'])} | {per_token:.3e} | {per_token / first:.3f} |")
    rows.append("\nTemporaries hold the layers' saved inputs (split by C) and also what C does not split: the fp32 "
                "gradients (fsdp: 1/8 of them on every mesh) and the vocabulary-wide logits (split 8 ways either "
                "way). FLOPs per token are XLA's count with loops counted per iteration; every attention block "
                "is computed whole, causal half included, on every mesh.")
    return "\n".join(rows)


def _ring_step(run: Runner) -> str:
    """The 8B step at 65536 tokens on 8 context shards, K/V gathered or passed around the ring."""
    rows = ["", "8B step at 65536 tokens, 8 context shards: gathered K/V against the ring:", "",
            "| impl | peak GiB | temporaries GiB | all-gather GiB | collective-permute GiB | all-reduce GiB |",
            "|---|---|---|---|---|---|"]
    for impl in ("gather", "ring"):
        try:
            p = run(kind="plan", size="8b", chips=8, context=8, model=1, seq=65536, impl=impl)
        except NotProbed:
            continue
        col = {k: gib(p["collectives"].get(k, {}).get("bytes", 0)) for k in ("all-gather", "collective-permute", "all-reduce")}
        rows.append(f"| {impl} | {gib(p['peak'])} | {gib(p['temporaries'])} | {col['all-gather']} | "
                    f"{col['collective-permute']} | {col['all-reduce']} |")
    return "\n".join(rows)


def _attention_bytes(run: Runner) -> str:
    """Collective bytes of redeqx.attention (forward + backward, one 8B layer) against the analytic count."""
    t, c, kv, tok = 32768, 8, 8 * 128 * 2, 4  # bf16 K (or V) bytes per token; an int32 position or segment
    local = t // c
    analytic = {  # per device, bytes of each collective's result
        # all-gather K, V, positions (segments: a constant here); backward: dK, dV reduced back
        "gather": t * (2 * kv + tok) + local * 2 * kv,
        # forward C - 1 hops of K, V, positions, segments; backward C hops of those and dK, dV in f32
        "ring": (c - 1) * local * (2 * kv + 2 * tok) + c * local * (2 * kv + 2 * tok + 2 * 2 * kv),
    }
    rows = ["", f"redeqx.attention alone (value and grads, {t} tokens, 32 query / 8 KV heads of 128, bf16, C={c}): "
            "collective bytes per device against the analytic K/V count:", "",
            "| impl | collectives | measured MiB | analytic MiB | ratio |", "|---|---|---|---|---|"]
    # libtpu writes every psum_scatter as an all-reduce of the whole array (a plain one too, on this slice)
    analytic["gather, reduce as all-reduce"] = t * (2 * kv + tok) + t * 2 * kv
    for name, value in analytic.items():
        try:
            s = run(kind="attention", chips=c, context=c, seq=t, impl=name.split(",")[0])
        except NotProbed:
            continue
        total = sum(v["bytes"] for v in s.values())
        kinds = ", ".join(f"{k} x{v['count']}" for k, v in sorted(s.items()))
        rows.append(f"| {name} | {kinds} | {total / 2**20:.1f} | {value / 2**20:.1f} | {total / value:.2f} |")
    rows.append("\nThe gather's gradient reduce-scatter counts its result (T / C tokens); a compiler that writes it "
                "as an all-reduce of the gathered size (libtpu does so for every psum_scatter on this slice, a plain "
                "one included) shows the gathered size there instead.")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
