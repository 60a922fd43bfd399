"""A ~0.5B-parameter LLaMA trained on 8 simulated devices with fsdp: no
device ever holds more than its share.

    python -m benchmarks.large_model               # writes its section of benchmarks/RESULTS.md
    python -m benchmarks.large_model --hidden 64 --layers 2 --heads 4 --intermediate 128 --vocab 256 --steps 2 --no-write

fp32 weights and AdamW: about 2 GB of parameters, 4 GB of Adam moments and 2
GB of gradients during a step, about 8 GB in all, held by 8 CPU devices that
share this process's memory. The model is built straight into its shards
(`redeqx.init_model(..., fsdp=True)`), moved into the train state without a
copy (`init_state(..., donate_model=True)`), trained for a few steps (batch 8,
short sequences), saved with `redeqx.save_checkpoint` and restored into an
abstract target. After each phase it measures, per device, the bytes of every
live array (the sum of its ``addressable_shards`` on that device) against the
device's share (total / 8), prints the planner's figures for the same step,
and the process's peak RSS (``resource.getrusage``) against 8 x the share.

It refuses to start when the machine has less free memory than the plan
needs with a margin (``--min-free-gb``).
"""

import collections
import gc
import math
import resource
import shutil
import tempfile
import time
from pathlib import Path

from benchmarks._common import cpu_devices, parser, report

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


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def current_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def per_device(tree=None) -> dict[int, int]:
    """Bytes on each device: of ``tree``'s arrays, or of every live array."""
    arrays = jax.live_arrays() if tree is None else [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
    out = collections.Counter({d.id: 0 for d in jax.devices()})
    for a in arrays:
        if a.is_deleted():
            continue
        for s in a.addressable_shards:
            out[s.device.id] += s.data.nbytes
    return dict(out)


def total_bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if isinstance(x, jax.Array))


def loss_fn(model, batch, key):
    ids = batch["ids"]
    logits = jax.vmap(model)(ids[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()


def main():
    p = parser(__doc__)
    for name, default in (("hidden", 1280), ("layers", 22), ("heads", 20), ("intermediate", 3456), ("vocab", 32000),
                          ("seq", 32), ("batch", 8), ("steps", 3)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--n-model-shards", type=int, default=4,
                   help="4 (x fsdp over 2): every weight split 8 ways; 1 (pure fsdp) plans 4.6 GB a device")
    p.add_argument("--min-free-gb", type=float, default=None,
                   help="refuse to start below this much free memory (default: 8 x the planned peak + 3 GB)")
    p.add_argument("--no-others", action="store_true", help="do not plan the other n_model_shards")
    p.add_argument("--workdir", type=Path, default=None, help="where the checkpoint goes (default: a temp dir)")
    args = p.parse_args()

    rss0 = current_rss()
    config = models.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                                num_hidden_layers=args.layers, num_attention_heads=args.heads)

    def make_model(key):
        return models.LlamaForCausalLM(config, key=key)

    mesh = redeqx.make_mesh(args.n_model_shards)
    n_dev = mesh.devices.size
    optimizer = optax.adamw(1e-4)
    abstract = eqx.filter_eval_shape(make_model, jax.random.key(0))
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract) if isinstance(x, jax.ShapeDtypeStruct))
    batch_spec = {"ids": jax.ShapeDtypeStruct((args.batch, args.seq + 1), jnp.int32)}
    log = []

    def say(msg):
        print(msg, flush=True)
        log.append(msg)

    say(f"LLaMA {n_params / 1e6:.0f} M parameters (hidden {args.hidden}, {args.layers} layers, intermediate "
        f"{args.intermediate}, vocab {args.vocab}); mesh {dict(mesh.shape)}, fsdp=True; batch {args.batch} x "
        f"{args.seq} tokens, AdamW, fp32")

    t0 = time.perf_counter()
    plan = redeqx.plan(make_model, loss_fn, optimizer, batch_spec, mesh, fsdp=True, explore=False)
    plan_s = time.perf_counter() - t0
    print(plan, flush=True)
    others = {}  # the same run on the other splits of the 8 devices, planned only
    for k in (1, 2, 4, 8):
        if k != args.n_model_shards and not args.no_others:
            others[k] = redeqx.plan(make_model, loss_fn, optimizer, batch_spec, redeqx.make_mesh(k), fsdp=True,
                                    explore=False)
            print(f"planned with n_model_shards={k}: peak {others[k].peak / GB:.3f} GB per device", flush=True)
    need = n_dev * plan.peak + 3 * GB
    floor = (args.min_free_gb * GB) if args.min_free_gb is not None else need
    if mem_available() < floor:
        raise SystemExit(f"only {mem_available() / GB:.1f} GB free; this run needs about {need / GB:.1f} GB "
                         f"(8 x the planned peak {plan.peak / GB:.2f} GB + 3 GB); try later or pass --min-free-gb")

    specs = redeqx.sharding_rules(abstract, mesh, fsdp=True)
    phases = []

    def record(name, tree, extra=""):
        live = per_device()
        mine = per_device(tree)
        total = total_bytes(tree)
        share = total / n_dev
        row = dict(phase=name, total=total, share=share, max_tree=max(mine.values()), min_tree=min(mine.values()),
                   max_live=max(live.values()), peak_rss=peak_rss(), rss=current_rss())
        phases.append(row)
        say(f"{name}: state {total / GB:.3f} GB in all, share {share / GB:.3f} GB per device; per device "
            f"{row['min_tree'] / GB:.3f}-{row['max_tree'] / GB:.3f} GB of it "
            f"({row['max_tree'] / share:.3f} x the share), all live arrays at most {row['max_live'] / GB:.3f} GB; "
            f"RSS {row['rss'] / GB:.2f} GB, peak RSS {row['peak_rss'] / GB:.2f} GB{extra}")
        return row

    # build straight into the shards
    t0 = time.perf_counter()
    model = redeqx.init_model(make_model, mesh, key=jax.random.key(0), fsdp=True)
    jax.block_until_ready(model)
    record("after init_model", model, f" ({time.perf_counter() - t0:.0f} s)")

    t0 = time.perf_counter()
    state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1), donate_model=True)
    del model
    jax.block_until_ready(state)
    record("after init_state(donate_model=True)", state, f" ({time.perf_counter() - t0:.0f} s)")

    step = redeqx.make_train_step(loss_fn, optimizer, mesh, specs)
    rs = np.random.RandomState(0)
    losses, times = [], []
    for i in range(args.steps):
        ids = rs.randint(0, args.vocab, (args.batch, args.seq + 1)).astype(np.int32)
        batch = jax.device_put({"ids": ids}, NamedSharding(mesh, P("data")))
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        times.append(time.perf_counter() - t0)
        say(f"step {i + 1}: loss {losses[-1]:.4f} ({times[-1]:.1f} s{', with compiling' if i == 0 else ''})")
    del batch, metrics
    gc.collect()
    after_steps = record(f"after {args.steps} steps", state)

    # checkpoint, then restore into an abstract target
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="redeqx_large_"))
    path = workdir / f"step_{int(state.step)}"

    @eqx.filter_jit
    def checksums(tree):
        return [jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array))]

    before = [float(c) for c in checksums(state.model)]
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                        if isinstance(x, jax.Array) else x, state)
    t0 = time.perf_counter()
    redeqx.save_checkpoint(path, state, metadata={"benchmark": "large_model"})
    save_s = time.perf_counter() - t0
    on_disk = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    record("after save_checkpoint", state, f" (save {save_s:.0f} s, {on_disk / GB:.2f} GB on disk)")
    step_before = int(state.step)
    del state
    gc.collect()
    t0 = time.perf_counter()
    state = redeqx.restore_checkpoint(path, like, mesh, specs)
    jax.block_until_ready(state)
    restore_s = time.perf_counter() - t0
    after = [float(c) for c in checksums(state.model)]
    same = int(state.step) == step_before and np.allclose(before, after, rtol=0, atol=0)
    restored = record("after restore_checkpoint", state,
                      f" (restore {restore_s:.0f} s; step {int(state.step)}, parameter checksums "
                      f"{'identical' if same else 'DIFFER'})")
    shutil.rmtree(path, ignore_errors=True)
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)

    share_all = after_steps["share"]
    lines = [
        f"LLaMA from `redeqx.models`: {n_params / 1e6:.0f} M parameters (hidden {args.hidden}, {args.layers} layers, "
        f"{args.heads} heads, intermediate {args.intermediate}, vocab {args.vocab}); 8 simulated CPU devices, mesh "
        f"{mesh.shape['data']} data x {mesh.shape['model']} model, `fsdp=True`; AdamW, fp32; batch {args.batch} x "
        f"{args.seq} tokens; {args.steps} steps (losses {', '.join(f'{x:.3f}' for x in losses)}; "
        f"{np.median(times[1:]) if len(times) > 1 else times[0]:.1f} s a step after the first).",
        "",
        "| phase | params + Adam in all | share (total / 8) | largest on one device | / share | all live arrays, "
        "largest device | process RSS | peak RSS |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in phases:
        lines.append(f"| {r['phase']} | {r['total'] / GB:.3f} GB | {r['share'] / GB:.3f} GB | "
                     f"{r['max_tree'] / GB:.3f} GB | {r['max_tree'] / r['share']:.3f} | {r['max_live'] / GB:.3f} GB | "
                     f"{r['rss'] / GB:.2f} GB | {r['peak_rss'] / GB:.2f} GB |")
    lines += [
        "",
        f"The planner, for the same step (`redeqx.plan(..., fsdp=True)`, {plan_s:.0f} s to compile on abstract "
        f"shapes): per device parameters {plan.parameters / GB:.3f} GB + optimizer state {plan.optimizer / GB:.3f} GB "
        f"= {(plan.parameters + plan.optimizer) / GB:.3f} GB (measured after the steps: "
        f"{after_steps['max_tree'] / GB:.3f} GB), temporaries {plan.temporaries / GB:.3f} GB (gradients "
        f"{plan.gradients / GB:.3f} GB), peak {plan.peak / GB:.3f} GB; collectives "
        + ", ".join(f"{k} {v['count']} x = {v['bytes'] / GB:.3f} GB" for k, v in plan.collectives.items()) + ".",
        "",
        f"Process memory: peak RSS {restored['peak_rss'] / GB:.2f} GB over the whole run (at start, after importing "
        f"JAX, {rss0 / GB:.2f} GB) against 8 x the planned per-device peak = {n_dev * plan.peak / GB:.2f} GB and "
        f"8 x the share of params + Adam = {n_dev * share_all / GB:.2f} GB; the 8 simulated devices share this "
        "process's memory, so RSS is what all 8 hold together: a model or optimizer state gathered whole on any "
        f"device would have added {share_all * (n_dev - 1) / GB:.2f} GB. Checkpoint: {on_disk / GB:.2f} GB on disk, "
        f"saved in {save_s:.0f} s, restored in {restore_s:.0f} s into an abstract target with "
        f"{'identical' if same else 'DIFFERENT'} parameter checksums and step.",
    ]
    if others:
        lines += ["", "The planner for the same model, batch and `fsdp=True` on the other splits of the 8 devices "
                  "(per device; GB):", "",
                  "| n_model_shards x data | parameters | optimizer state | temporaries | peak | 8 x peak |",
                  "|---|---|---|---|---|---|"]
        for k, q in sorted({**others, args.n_model_shards: plan}.items()):
            lines.append(f"| {k} x {n_dev // k} | {q.parameters / GB:.3f} | {q.optimizer / GB:.3f} | "
                         f"{q.temporaries / GB:.3f} | {q.peak / GB:.3f} | {n_dev * q.peak / GB:.2f} |")
    report(args, "A 0.5B model on 8 devices with fsdp (benchmarks/large_model.py)", "\n".join(lines))


if __name__ == "__main__":
    main()
