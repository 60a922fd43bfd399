"""What a checkpoint costs the host: peak memory and time of a save and a restore, redeqx's beside
plain orbax's, each in fresh processes, one process and two.

    python -m benchmarks.checkpoint_memory                      # both states, 1 and 2 processes; writes RESULTS.md
    python -m benchmarks.checkpoint_memory --states leaf --gib 0.25 --processes 1 --no-write   # a quick try

The states, on 8 simulated CPU devices (so the devices' buffers are host memory):

- ``leaf``: one stacked leaf ``(8, 4096, gib * 8192)`` float32 split over ``model`` on its last dim
  (``make_mesh(4)``: replicated over the 2 data shards, each saved once);
- ``llama1b``: the whole train state of TinyLlama-1.1B's shapes (22 stacked layers, hidden 2048,
  vocabulary 32000): parameters and AdamW's two moments, 3.3 G values, in bfloat16 (6.1 GiB; in
  float32, 12.3 GiB, orbax's own save would need twice that, more than a 24 GiB machine has), laid
  out by ``sharding_rules(fsdp=True)`` on ``make_mesh(4)``, so nothing is held twice.

Both variants save and restore the same tree (a dict of arrays): redeqx with `save_checkpoint` and
`restore_checkpoint`, plain orbax with ``StandardCheckpointer`` and the same shardings (what redeqx
writes under, without its content hash and metadata). "Peak over before" is a process's high-water
mark (``VmHWM``, reset just before the call) less its resident memory just before; with two
processes (``redeqx.launch -n 2``, 4 devices each) the larger of the two, and the longer time. Each
figure is the median of ``--repeats`` fresh runs, the variants alternated: redeqx's and orbax's save
(and restore) take turns going first, and each starts after the disk has written back what the one
before it wrote (``os.sync``).
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._common import ROOT, libtpu, parser, report, serve, worker, worker_env

VARIANTS = ("orbax save", "redeqx save", "orbax restore", "redeqx restore")
LLAMA_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                num_attention_heads=32, num_key_value_heads=4)


def _rss() -> tuple[int, int]:
    """(resident, high-water mark) of this process, bytes."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark back to the resident size


def _layout(state: str, gib: float, mesh=None):
    """(mesh, {name: abstract array with its sharding}) of ``state`` on ``mesh`` (``make_mesh(4)``)."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    import redeqx
    from redeqx import models

    mesh = redeqx.make_mesh(4) if mesh is None else mesh
    if state == "leaf":
        sharding = NamedSharding(mesh, P(None, None, "model"))
        return mesh, {"w": jax.ShapeDtypeStruct((8, 4096, int(gib * 8192)), jnp.float32, sharding=sharding)}
    model = eqx.filter_eval_shape(models.LlamaForCausalLM, models.LlamaConfig(**LLAMA_1B), key=jax.random.key(0))
    specs = redeqx.sharding_rules(model, mesh, fsdp=True)
    tree = {}
    for (path, x), spec in zip(jax.tree_util.tree_leaves_with_path(model),
                               jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P)), strict=True):
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        for part in ("params", "mu", "nu"):  # AdamW's moments are shaped and laid out as the parameters
            tree[f"{part}/{name}"] = jax.ShapeDtypeStruct(x.shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec))
    return mesh, tree


def _filled(abstract: dict) -> dict:
    """Random values for every leaf of ``abstract``, made on the devices that hold them."""
    import jax

    out = {}
    for i, (name, x) in enumerate(abstract.items()):
        make = jax.jit(lambda key, x=x: jax.random.normal(key, x.shape, x.dtype), out_shardings=x.sharding)
        out[name] = make(jax.random.key(i))
    return jax.block_until_ready(out)


def measure(variant: str, state: str, gib: float, directory: str) -> dict:
    """One variant in this (fresh) process: its seconds and its peak over the memory before."""
    import jax
    import orbax.checkpoint as ocp

    import redeqx

    mesh, abstract = _layout(state, gib)
    path = Path(directory) / variant.split()[0]
    if variant.endswith("save"):
        tree = _filled(abstract)
    # A run has taken a step before it saves or after it restores: its collectives are set up (across
    # processes, gloo's first all-reduce takes about a second, which no variant should be charged).
    jax.block_until_ready(jax.jit(lambda x: x.sum(), out_shardings=jax.NamedSharding(mesh, jax.P()))(
        jax.device_put(jax.numpy.ones(mesh.size), jax.NamedSharding(mesh, jax.P(mesh.axis_names)))))
    gc.collect()
    os.sync()  # the variant before wrote its checkpoint: its write-back is not charged to this one
    time.sleep(1.0)  # buffers XLA frees on its own threads are gone before the mark
    _reset_peak()
    before, _ = _rss()
    t0 = time.perf_counter()
    if variant == "orbax save":
        with ocp.StandardCheckpointer() as c:
            c.save(path, tree)
    elif variant == "redeqx save":
        redeqx.save_checkpoint(path, tree)
    elif variant == "orbax restore":
        with ocp.StandardCheckpointer() as c:
            out = c.restore(path, abstract)
        jax.block_until_ready(out)
    else:
        out = redeqx.restore_checkpoint(path, abstract, mesh, {k: x.sharding.spec for k, x in abstract.items()})
        jax.block_until_ready(out)
    seconds = time.perf_counter() - t0
    _, peak = _rss()
    return {"seconds": seconds, "over": peak - before,
            "bytes": sum(x.size * x.dtype.itemsize for x in abstract.values())}


def _two_processes(variant: str, state: str, gib: float, directory: str) -> dict:
    """``measure`` under ``redeqx.launch -n 2``: the larger peak and the longer time of the two."""
    results = Path(directory) / "results"
    shutil.rmtree(results, ignore_errors=True)
    results.mkdir()
    task = json.dumps({"fn": "_measure_to_file", "kwargs": dict(variant=variant, state=state, gib=gib,
                                                               directory=directory, results=str(results))})
    subprocess.run([sys.executable, "-m", "redeqx.launch", "-n", "2", "--devices", "8", __file__, "--worker", task],
                   env=worker_env(), cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    each = [json.loads(p.read_text()) for p in sorted(results.glob("*.json"))]
    if len(each) != 2:
        raise RuntimeError(f"{variant} on {state}: {len(each)} of 2 processes reported")
    return {"seconds": max(r["seconds"] for r in each), "over": max(r["over"] for r in each),
            "bytes": each[0]["bytes"]}


def _measure_to_file(results: str, **kwargs) -> dict:
    import jax

    out = measure(**kwargs)
    Path(results, f"{jax.process_index()}.json").write_text(json.dumps(out))
    return out


def tpu_hash(state: str, gib: float) -> dict:
    """libtpu's own figures for the content hash of ``state`` on a TPU v4 slice of 8 chips (no TPU
    attached), laid out as on the CPU devices: per chip, the bytes read and the compiler's estimate
    of the time, summed over the leaves' programs; without (a restore) and with (a manager's save) the
    finiteness test."""
    import numpy as np
    from jax.sharding import Mesh

    from benchmarks._common import tpu_v4_devices
    from redeqx.checkpoints import _hashing

    mesh = Mesh(np.array(tpu_v4_devices(8)).reshape(2, 4), ("data", "model"))  # make_mesh(4)'s axes
    _, abstract = _layout(state, gib, mesh)
    out = {"state": sum(x.size * x.dtype.itemsize for x in abstract.values())}
    for finite in (False, True):
        read = seconds = 0.0
        for x in abstract.values():
            cost = _hashing._fingerprint.lower(x, finite=finite, sharding=x.sharding).compile().cost_analysis()
            cost = cost[0] if isinstance(cost, list) else cost
            read += float(cost.get("bytes accessed", 0.0))
            seconds += float(cost.get("optimal_seconds", 0.0))
        out["finite" if finite else "plain"] = {"bytes": read, "seconds": seconds}
    return out


def variant_order(round_: int) -> list[str]:
    """The variants of round ``round_``: the saves, then the restores, each pair in turn first (the
    second of a pair runs right after the first's I/O, on a disk and page cache it left busy)."""
    saves, restores = VARIANTS[:2], VARIANTS[2:]
    turn = slice(None, None, -1 if round_ % 2 else 1)
    return [*saves[turn], *restores[turn]]


def _rows(state: str, processes: int, runs: dict[str, list[dict]]) -> list[str]:
    med = {v: (statistics.median(r["over"] for r in rs), statistics.median(r["seconds"] for r in rs))
           for v, rs in runs.items()}
    size = runs[VARIANTS[0]][0]["bytes"]
    rows = []
    for v in VARIANTS:
        over, secs = med[v]
        base = med[v.replace("redeqx", "orbax")]
        rows.append(f"| {state} ({size / 2**30:.2f} GiB) | {processes} | {v} | {over / 2**30:.2f} | {over / size:.2f} | "
                    f"{secs:.2f} | {over / base[0]:.2f}x | {secs / base[1]:.2f}x |")
    return rows


def main():
    p = parser(__doc__)
    p.add_argument("--gib", type=float, default=1.0, help="the leaf's size in GiB (default 1)")
    p.add_argument("--states", nargs="+", default=["leaf", "llama1b"], choices=["leaf", "llama1b"])
    p.add_argument("--processes", nargs="+", type=int, default=[1, 2], choices=[1, 2])
    p.add_argument("--repeats", type=int, default=4, help="fresh runs per variant (default 4: each goes first twice)")
    p.add_argument("--tpu", action="store_true", help="instead: libtpu's figures for the hash's pass on TPU v4")
    args = p.parse_args()
    if args.tpu:
        return _tpu_report(args)
    rows = ["| state | processes | what | host peak over before (GiB) | x the state | seconds | "
            "vs plain orbax: memory | time |", "|---|---|---|---|---|---|---|---|"]
    for state in args.states:
        for n in args.processes:
            runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
            with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as d:
                for i in range(args.repeats):
                    for v in variant_order(i):  # each save writes the checkpoint its restore then reads
                        kw = dict(variant=v, state=state, gib=args.gib, directory=d)
                        runs[v].append(worker(__file__, "measure", **kw) if n == 1 else _two_processes(**kw))
                        print(f"  {state} x{n} {v}: {json.dumps(runs[v][-1])}", file=sys.stderr, flush=True)
                    for child in Path(d).iterdir():  # the next round saves anew
                        shutil.rmtree(child, ignore_errors=True)
            rows += _rows(state, n, runs)
    report(args, "What a checkpoint costs the host", f"""
Each variant in fresh processes on 8 simulated CPU devices, median of {args.repeats}, the variants alternated
(redeqx's and orbax's take turns going first, each after `os.sync`; `benchmarks/checkpoint_memory.py` says what
each state is). With 2 processes: the larger peak and the longer time of the two. Targets (issue 49): redeqx's
peak <= 1.25x plain orbax's, its time <= 1.5x.

""" + "\n".join(rows) + "\n")


def _tpu_report(args) -> None:
    python, env = libtpu(8)
    rows = ["| state | pass | bytes read per chip (GiB) | libtpu's estimate (ms) | GB/s |", "|---|---|---|---|---|"]
    for state in args.states:
        r = worker(__file__, "tpu_hash", python=python, env=env, state=state, gib=args.gib)
        for kind, what in (("plain", "a restore's (sums)"), ("finite", "a manager's save (sums, finiteness)")):
            f = r[kind]
            rows.append(f"| {state} ({r['state'] / 2**30:.2f} GiB) | {what} | {f['bytes'] / 2**30:.3f} | "
                        f"{f['seconds'] * 1e3:.2f} | {f['bytes'] / f['seconds'] / 1e9:.0f} |")
    report(args, "The checkpoint content hash on a TPU", """
The content hash's pass over each state of `benchmarks/checkpoint_memory.py` as libtpu compiles it for 8 TPU v4
chips (no TPU attached; the CPU devices' layout): per chip, the bytes its programs read and libtpu's own
estimate of their time (`optimal_seconds`), summed over the leaves. A v4 chip's HBM gives about 1,200 GB/s.

""" + "\n".join(rows) + "\n")


if __name__ == "__main__" and not serve(globals()):
    main()
