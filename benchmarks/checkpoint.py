"""Checkpoint save/restore time and size, synchronous vs asynchronous, and the
training time an asynchronous save costs.

    python -m benchmarks.checkpoint                 # 100M parameters; writes benchmarks/RESULTS.md
    python -m benchmarks.checkpoint --width 256 --depth 1 --steps 2 --no-write   # a quick try

A TrainState (MLP of ``depth + 1`` square ``width`` layers, AdamW) on 8
simulated CPU devices at n_model_shards 1 and 4 (at 1 every device holds a
full copy in host memory: 100M parameters peak near 17 GB): the sync save's
time and bytes on disk, a restore into an abstract target, how long
`CheckpointManager.save` blocks and how long until its write is on disk, and
the steps run while it is written against steps with no save in flight.

Host memory and time beside plain orbax's (a 1 GiB stacked leaf, a whole 1B LLaMA state, one
process and two) are `benchmarks/checkpoint_memory.py`'s: each variant needs a fresh process.
"""

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks._common import cpu_devices, parser, report

cpu_devices(8)

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import redeqx  # noqa: E402


def loss_fn(model, batch, key):
    return jnp.mean(jax.vmap(model)(batch["x"]) ** 2)


def timed_steps(train_step, state, batch, n):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        state, metrics = train_step(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t)
    return state, times


def mlp_state(n_model_shards, width, depth):
    """The MLP's train state (AdamW) on ``n_model_shards``: (state, mesh, specs, make, optimizer, n_params)."""
    mesh = redeqx.make_mesh(n_model_shards)
    make = lambda key: eqx.nn.MLP(width, width, width, depth=depth, use_bias=False, key=key)  # noqa: E731
    model, optimizer = make(jax.random.key(0)), optax.adamw(1e-4)
    specs = redeqx.sharding_rules(model, mesh)
    state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1))
    return state, mesh, specs, make, optimizer, sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))


def bench(n_model_shards, width, depth, n_steps, root: Path):
    state, mesh, specs, make, optimizer, n_params = mlp_state(n_model_shards, width, depth)
    train_step = redeqx.make_train_step(loss_fn, optimizer, mesh, specs)
    rows = mesh.shape["data"]
    batch = next(redeqx.batches([{"x": jnp.ones(width)}] * rows, lambda es: {"x": jnp.stack([e["x"] for e in es])},
                                1, mesh))
    state, _ = timed_steps(train_step, state, batch, 2)  # compile, warm up

    # sync save and restore (a first save compiles the checksums and warms orbax up)
    redeqx.save_checkpoint(root / "warmup", state)
    shutil.rmtree(root / "warmup")
    t = time.perf_counter()
    redeqx.save_checkpoint(root / "sync", state)
    t_sync = time.perf_counter() - t
    size = sum(f.stat().st_size for f in (root / "sync").rglob("*") if f.is_file())

    # steps with no save, and steps while an async save is written, interleaved
    manager = redeqx.CheckpointManager(root / "async", keep_last=1)
    state, plain = timed_steps(train_step, state, batch, n_steps)
    t = time.perf_counter()
    manager.save(state)
    t_block = time.perf_counter() - t
    state, during = timed_steps(train_step, state, batch, n_steps)
    t = time.perf_counter()
    manager.wait()
    t_tail = time.perf_counter() - t  # write still running after the steps
    t_async_total = t_block + sum(during) + t_tail
    state, plain2 = timed_steps(train_step, state, batch, n_steps)
    manager.close()
    shutil.rmtree(root / "async")

    # restore last, with the training state gone: one full state in memory at a time
    del state
    like = eqx.filter_eval_shape(redeqx.init_state, eqx.filter_eval_shape(make, jax.random.key(0)), optimizer, mesh,
                                 specs, key=jax.random.key(1))
    t = time.perf_counter()
    restored = redeqx.restore_checkpoint(root / "sync", like, mesh, specs)
    jax.block_until_ready(restored)
    t_restore = time.perf_counter() - t
    del restored
    shutil.rmtree(root / "sync")
    base = statistics.median(plain + plain2)
    lost = t_block + sum(during) - n_steps * base
    return {
        "n_model_shards": n_model_shards, "params": n_params, "state_bytes": 3 * 4 * n_params, "disk_bytes": size,
        "sync_save_s": t_sync, "restore_s": t_restore, "async_block_s": t_block,
        "async_until_on_disk_s": t_async_total, "step_s": base, "step_during_async_s": statistics.mean(during),
        "step_ratio": statistics.mean(during) / base, "async_lost_s": lost,
    }


def main():
    p = parser(__doc__)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--depth", type=int, default=5, help="hidden layers; depth + 1 square linear layers")
    p.add_argument("--steps", type=int, default=4, help="steps timed with and without a save in flight")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in (1, 4):
            r = bench(n, args.width, args.depth, args.steps, Path(tmp) / f"m{n}")
            print(r, flush=True)
            rows.append(r)
    mb = lambda b: f"{b / 2**20:,.0f} MiB"  # noqa: E731
    lines = [
        f"TrainState of an MLP with {args.depth + 1} linear layers {args.width}x{args.width} "
        f"({rows[0]['params'] / 1e6:.1f}M parameters, adamw: {mb(rows[0]['state_bytes'])} of float32), "
        f"{len(jax.devices())} simulated CPU devices on {os.cpu_count()} CPU cores; "
        f"{args.steps} steps timed with and without an async save in flight.",
        "",
        "| n_model_shards | bytes on disk | sync save | restore (abstract target) | async save blocks | async on disk after "
        "| step | step during async write | ratio | time lost to one async save / sync save |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['n_model_shards']} | {mb(r['disk_bytes'])} | {r['sync_save_s']:.2f} s | {r['restore_s']:.2f} s | "
            f"{r['async_block_s']:.2f} s | {r['async_until_on_disk_s']:.2f} s | {r['step_s']:.3f} s | "
            f"{r['step_during_async_s']:.3f} s | {r['step_ratio']:.2f}x | "
            f"{r['async_lost_s']:.2f} s / {r['sync_save_s']:.2f} s = {r['async_lost_s'] / r['sync_save_s']:.2f} |"
        )
    report(args, "Checkpoints (benchmarks/checkpoint.py)", "\n".join(lines))


if __name__ == "__main__":
    main()
