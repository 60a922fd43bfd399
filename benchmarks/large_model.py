"""A ~0.5B-parameter LLaMA trained on 8 simulated devices with fsdp: no
device ever holds more than its share.

    python -m benchmarks.large_model               # writes its section of benchmarks/RESULTS.md
    python -m benchmarks.large_model --hidden 64 --layers 2 --heads 4 --intermediate 128 --vocab 256 --no-write

fp32 weights and AdamW (about 8 GB in all during a step) held by 8 CPU
devices sharing this process's memory: built straight into its shards
(`init_model(..., fsdp=True)`), moved into the train state without a copy
(`init_state(..., donate_model=True)`), trained a few steps, saved and
restored into an abstract target. After each phase: per device, the bytes of
every live array against the device's share (total / 8), and the process's
RSS; beside them the planner's figures for the same step. It refuses to start
with less free memory than the plan needs (``--min-free-gb``).
"""

import collections
import gc
import resource
import shutil
import tempfile
import time
from pathlib import Path

from benchmarks._common import cpu_devices, next_token_loss, param_count, parser, report

cpu_devices(8)

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import redeqx  # noqa: E402
from redeqx import models  # noqa: E402

GB = 1e9


def proc_bytes(path: str, field: str) -> int:
    """A ``kB`` field of a /proc file (VmRSS of /proc/self/status, MemAvailable of /proc/meminfo)."""
    line = next(line for line in Path(path).read_text().splitlines() if line.startswith(field))
    return int(line.split()[1]) * 1024


def per_device(tree=None) -> dict[int, int]:
    """Bytes on each device: of ``tree``'s arrays, or of every live array."""
    arrays = jax.live_arrays() if tree is None else [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
    out = collections.Counter({d.id: 0 for d in jax.devices()})
    for a in arrays:
        for s in [] if a.is_deleted() else a.addressable_shards:
            out[s.device.id] += s.data.nbytes
    return dict(out)


class Phases:
    """Each phase's bytes per device and process memory, printed as measured."""

    def __init__(self, n_devices: int):
        self.n, self.rows, self.log = n_devices, [], []

    def __call__(self, name: str, tree, extra: str = "") -> dict:
        live, mine = per_device(), per_device(tree)
        total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if isinstance(x, jax.Array))
        row = dict(phase=name, total=total, share=total / self.n, max_tree=max(mine.values()),
                   max_live=max(live.values()), rss=proc_bytes("/proc/self/status", "VmRSS:"),
                   peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        self.rows.append(row)
        print(f"{name}: state {total / GB:.3f} GB, share {row['share'] / GB:.3f} GB per device, largest "
              f"{row['max_tree'] / GB:.3f} GB; all live arrays at most {row['max_live'] / GB:.3f} GB; RSS "
              f"{row['rss'] / GB:.2f} GB, peak {row['peak_rss'] / GB:.2f} GB{extra}", flush=True)
        return row


def train_save_restore(args, make_model, mesh, optimizer, phases: Phases) -> dict:
    t0 = time.perf_counter()
    model = redeqx.init_model(make_model, mesh, key=jax.random.key(0), fsdp=True)
    phases("after init_model", jax.block_until_ready(model), f" ({time.perf_counter() - t0:.0f} s)")
    specs = redeqx.sharding_rules(model, mesh, fsdp=True)
    state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1), donate_model=True)
    del model
    phases("after init_state(donate_model=True)", jax.block_until_ready(state))
    step = redeqx.make_train_step(next_token_loss, optimizer, mesh, specs)
    rs, losses, times = np.random.RandomState(0), [], []
    for i in range(args.steps):
        ids = rs.randint(0, args.vocab, (args.batch, args.seq + 1)).astype(np.int32)
        t0 = time.perf_counter()
        state, metrics = step(state, jax.device_put({"ids": ids}, NamedSharding(mesh, P("data"))))
        losses.append(float(metrics["loss"]))
        times.append(time.perf_counter() - t0)
        print(f"step {i + 1}: loss {losses[-1]:.4f} ({times[-1]:.1f} s)", flush=True)
    del metrics
    gc.collect()
    after_steps = phases(f"after {args.steps} steps", state)

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="redeqx_large_"))
    path = workdir / f"step_{int(state.step)}"
    checksums = eqx.filter_jit(lambda t: [jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(
        eqx.filter(t, eqx.is_inexact_array))])
    before, step_before = [float(c) for c in checksums(state.model)], int(state.step)
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                        if isinstance(x, jax.Array) else x, state)
    t0 = time.perf_counter()
    redeqx.save_checkpoint(path, state, metadata={"benchmark": "large_model"})
    save_s, on_disk = time.perf_counter() - t0, sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    phases("after save_checkpoint", state, f" (save {save_s:.0f} s)")
    del state
    gc.collect()
    t0 = time.perf_counter()
    state = jax.block_until_ready(redeqx.restore_checkpoint(path, like, mesh, specs))
    restore_s = time.perf_counter() - t0
    same = int(state.step) == step_before and before == [float(c) for c in checksums(state.model)]
    restored = phases("after restore_checkpoint", state, f" (restore {restore_s:.0f} s)")
    shutil.rmtree(path if args.workdir else workdir, ignore_errors=True)
    return dict(losses=losses, times=times, after_steps=after_steps, restored=restored, save_s=save_s,
                restore_s=restore_s, on_disk=on_disk, same=same)


def render(args, n_params, mesh, plan, plan_s, others, rss0, phases: Phases, r: dict) -> str:
    n_dev, share = mesh.devices.size, r["after_steps"]["share"]
    lines = [
        f"LLaMA from `redeqx.models`: {n_params / 1e6:.0f} M parameters (hidden {args.hidden}, {args.layers} layers, "
        f"{args.heads} heads, intermediate {args.intermediate}, vocab {args.vocab}); 8 simulated CPU devices, mesh "
        f"{mesh.shape['data']} data x {mesh.shape['model']} model, `fsdp=True`; AdamW, fp32; batch {args.batch} x "
        f"{args.seq} tokens; {args.steps} steps (losses {', '.join(f'{x:.3f}' for x in r['losses'])}; "
        f"{np.median(r['times'][1:] or r['times']):.1f} s a step after the first).", "",
        "| phase | params + Adam in all | share (total / 8) | largest on one device | / share | all live arrays, "
        "largest device | process RSS | peak RSS |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {p['phase']} | {p['total'] / GB:.3f} GB | {p['share'] / GB:.3f} GB | {p['max_tree'] / GB:.3f} GB | "
              f"{p['max_tree'] / p['share']:.3f} | {p['max_live'] / GB:.3f} GB | {p['rss'] / GB:.2f} GB | "
              f"{p['peak_rss'] / GB:.2f} GB |" for p in phases.rows]
    lines += [
        "", f"The planner, for the same step (`redeqx.plan(..., fsdp=True)`, {plan_s:.0f} s to compile on abstract "
        f"shapes): per device parameters {plan.parameters / GB:.3f} GB + optimizer state {plan.optimizer / GB:.3f} GB "
        f"= {(plan.parameters + plan.optimizer) / GB:.3f} GB (measured after the steps: "
        f"{r['after_steps']['max_tree'] / GB:.3f} GB), temporaries {plan.temporaries / GB:.3f} GB (gradients "
        f"{plan.gradients / GB:.3f} GB), peak {plan.peak / GB:.3f} GB; collectives "
        + ", ".join(f"{k} {v['count']} x = {v['bytes'] / GB:.3f} GB" for k, v in plan.collectives.items()) + ".",
        "", f"Process memory: peak RSS {r['restored']['peak_rss'] / GB:.2f} GB over the whole run (at start, after "
        f"importing JAX, {rss0 / GB:.2f} GB) against 8 x the planned per-device peak = {n_dev * plan.peak / GB:.2f} GB "
        f"and 8 x the share of params + Adam = {n_dev * share / GB:.2f} GB; the 8 simulated devices share this "
        "process's memory, so RSS is what all 8 hold together: a model or optimizer state gathered whole on any "
        f"device would have added {share * (n_dev - 1) / GB:.2f} GB. Checkpoint: {r['on_disk'] / GB:.2f} GB on disk, "
        f"saved in {r['save_s']:.0f} s, restored in {r['restore_s']:.0f} s into an abstract target with "
        f"{'identical' if r['same'] else 'DIFFERENT'} parameter checksums and step."]
    if others:
        lines += ["", "The planner for the same model, batch and `fsdp=True` on the other splits of the 8 devices "
                  "(per device; GB):", "", "| n_model_shards x data | parameters | optimizer state | temporaries "
                  "| peak | 8 x peak |", "|---|---|---|---|---|---|"]
        lines += [f"| {k} x {n_dev // k} | {q.parameters / GB:.3f} | {q.optimizer / GB:.3f} | {q.temporaries / GB:.3f} "
                  f"| {q.peak / GB:.3f} | {n_dev * q.peak / GB:.2f} |"
                  for k, q in sorted({**others, args.n_model_shards: plan}.items())]
    return "\n".join(lines)


def main():
    p = parser(__doc__, hidden=1280, layers=22, heads=20, intermediate=3456, vocab=32000, seq=32, batch=8, steps=3)
    p.add_argument("--n-model-shards", type=int, default=4,
                   help="4 (x fsdp over 2): every weight split 8 ways; 1 (pure fsdp) plans 4.6 GB a device")
    p.add_argument("--min-free-gb", type=float, default=None,
                   help="refuse to start below this much free memory (default: 8 x the planned peak + 3 GB)")
    p.add_argument("--no-others", action="store_true", help="do not plan the other n_model_shards")
    p.add_argument("--workdir", type=Path, default=None, help="where the checkpoint goes (default: a temp dir)")
    args = p.parse_args()
    rss0 = proc_bytes("/proc/self/status", "VmRSS:")
    config = models.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                                num_hidden_layers=args.layers, num_attention_heads=args.heads)
    make_model = lambda key: models.LlamaForCausalLM(config, key=key)  # noqa: E731
    mesh, optimizer = redeqx.make_mesh(args.n_model_shards), optax.adamw(1e-4)
    abstract = eqx.filter_eval_shape(make_model, jax.random.key(0))
    n_params = param_count(abstract)
    batch = {"ids": jax.ShapeDtypeStruct((args.batch, args.seq + 1), jnp.int32)}
    t0 = time.perf_counter()
    plan = redeqx.plan(make_model, next_token_loss, optimizer, batch, mesh, fsdp=True, explore=False)
    plan_s = time.perf_counter() - t0
    print(plan, flush=True)
    others = {} if args.no_others else {  # the same run on the other splits of the 8 devices, planned only
        k: redeqx.plan(make_model, next_token_loss, optimizer, batch, redeqx.make_mesh(k), fsdp=True, explore=False)
        for k in (1, 2, 4, 8) if k != args.n_model_shards}
    need = mesh.devices.size * plan.peak + 3 * GB
    if proc_bytes("/proc/meminfo", "MemAvailable:") < (args.min_free_gb * GB if args.min_free_gb else need):
        raise SystemExit(f"too little free memory: this run needs about {need / GB:.1f} GB (8 x the planned peak "
                         f"{plan.peak / GB:.2f} GB + 3 GB); try later or pass --min-free-gb")
    phases = Phases(mesh.devices.size)
    r = train_save_restore(args, make_model, mesh, optimizer, phases)
    report(args, "A 0.5B model on 8 devices with fsdp (benchmarks/large_model.py)",
           render(args, n_params, mesh, plan, plan_s, others, rss0, phases, r))


if __name__ == "__main__":
    main()
