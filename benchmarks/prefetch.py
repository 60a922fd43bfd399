"""Prefetch: does collating the next batch overlap the running step?

    python -m benchmarks.prefetch            # writes its section of benchmarks/RESULTS.md
    python -m benchmarks.prefetch --rounds 1 --steps 3 --step-ms 5 --collate-ms 4 --per-device 2 --no-write

A step of fixed cost (8 jitted matmuls sized to take ``--step-ms``) fed by
redeqx.batches with a collate_fn that sleeps ``--collate-ms``. Two loops: one
that reads the loss after every step (as Logger.log does), one that never
waits for a step (JAX's asynchronous dispatch overlaps it already). Rounds
alternate prefetch=0 and 2; wall and process CPU time per step from the end of
the first step to the last, medians over rounds.
"""

import os
import statistics
import time

from benchmarks._common import cpu_devices, parser, report, timed

cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import redeqx  # noqa: E402


def make_step(n: int, reps: int = 8):
    """``reps`` (n, n) matmuls that depend on the batch; its cost grows as n^3.
    Unrolled, not a loop: a GPU runs it without the host driving each
    iteration, so the loop's thread is free while it runs."""
    w = jax.random.normal(jax.random.key(0), (n, n), jnp.float32) / np.sqrt(n)

    @jax.jit
    def step(w, batch):
        c = w + jnp.mean(batch["x"])
        for _ in range(reps):
            c = jnp.tanh(c @ w)
        return jnp.mean(c)

    return lambda batch: step(w, batch)


def calibrate(batch, target_s):
    """The matrix size that makes one step take ``target_s`` (median of 5)."""
    n, took = 64, 0.0
    while took < target_s / 8 and n < 1 << 15:
        n *= 2
        step = make_step(n)
        took = statistics.median(timed(lambda: step(batch), 5))
    for _ in range(2):  # the time is close to n^3: refine twice
        n = max(64, 32 * round(n * (target_s / took) ** (1 / 3) / 32))
        step = make_step(n)
        took = statistics.median(timed(lambda: step(batch), 5))
    return step, n


def one_round(step, examples, collate_fn, per_device, mesh, prefetch, n_steps, wait):
    """(wall, cpu) seconds per step over ``n_steps`` batches, from the end of
    the first step (which fills the pipeline) until the last step's result is
    ready: throughput, also when the loop runs ahead of the device."""
    for i, batch in enumerate(redeqx.batches(examples, collate_fn, per_device, mesh, prefetch=prefetch)):
        if i == n_steps:
            break
        loss = step(batch)
        if wait or i == 0:
            float(loss)  # what a loop that logs its loss every step does
        if i == 0:
            t, c = time.perf_counter(), time.process_time()
    jax.block_until_ready(loss)
    return (time.perf_counter() - t) / (n_steps - 1), (time.process_time() - c) / (n_steps - 1)


def main():
    p = parser(__doc__)
    for name, kind, default in (("step-ms", float, 50.0), ("collate-ms", float, 40.0), ("dim", int, 256),
                                ("per-device", int, 8), ("steps", int, 12), ("rounds", int, 8)):
        p.add_argument(f"--{name}", type=kind, default=default)
    args = p.parse_args()

    mesh = redeqx.make_mesh(1)  # every device on the data axis
    size = args.per_device * mesh.shape["data"]
    rng = np.random.default_rng(0)
    examples = [rng.normal(size=args.dim).astype(np.float32) for _ in range(size * (args.steps + 1))]

    def slow_collate(rows):
        time.sleep(args.collate_ms / 1000)
        return {"x": np.stack(rows)}

    probe = next(redeqx.batches(examples, lambda rows: {"x": np.stack(rows)}, args.per_device, mesh, prefetch=0))
    step, n = calibrate(probe, args.step_ms / 1000)

    results = {}
    for wait in (True, False):
        got = {0: [], 2: []}
        for r in range(args.rounds):
            for prefetch in ((0, 2) if r % 2 == 0 else (2, 0)):
                got[prefetch].append(one_round(step, examples, slow_collate, args.per_device, mesh, prefetch,
                                               args.steps, wait))
        results[wait] = {p: tuple(map(statistics.median, zip(*runs))) for p, runs in got.items()}

    step_alone = statistics.median(timed(lambda: step(probe), 10))
    lines = [
        f"{len(jax.devices())} x {jax.devices()[0].device_kind} ({jax.devices()[0].platform}; data = {mesh.shape['data']}), "
        f"{os.cpu_count()} CPU cores; global batch {size} x {args.dim}; step = 8 matmuls of {n} x {n}, "
        f"{step_alone * 1e3:.0f} ms alone; collate_fn sleeps {args.collate_ms:.0f} ms; "
        f"{args.rounds} rounds x {args.steps} steps per setting, medians over rounds.",
        "",
        "| loop | prefetch | wall s/step | CPU s/step | wall vs prefetch=0 |",
        "|---|---|---|---|---|",
    ]
    for wait, label in ((True, "reads the loss every step"), (False, "never waits for a step")):
        base = results[wait][0][0]
        for p in (0, 2):
            wall, cpu = results[wait][p]
            lines.append(f"| {label} | {p} | {wall:.4f} | {cpu:.4f} | {wall / base:.2f} |")
    report(args, "Prefetch (benchmarks/prefetch.py)", "\n".join(lines))


if __name__ == "__main__":
    main()
