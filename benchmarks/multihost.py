"""Step time of 2 processes x 4 devices vs 1 process x 8 devices, same global batch.

    python -m benchmarks.multihost            # writes the ratio to benchmarks/RESULTS.md
    python -m benchmarks.multihost --rounds 1 --steps 2 --no-write

The same TinyLM, n_model_shards=2, on 8 simulated CPU devices under
``python -m redeqx.launch -n 1`` and ``-n 2``, alternating in rounds: the
ratio is the cost of crossing processes (on CPU, gloo over loopback TCP).
"""

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._common import ROOT, add_tiny_lm_args, parser, report, worker_env


def worker(args) -> None:
    """One process of a launched run: time ``args.steps`` train steps."""
    import jax
    import optax

    import redeqx

    from tiny_transformer import TinyLM, collate_tokens, lm_loss, token_examples

    redeqx.initialize()  # a no-op under redeqx.launch
    mesh = redeqx.make_mesh(n_model_shards=2)
    model = TinyLM(vocab=args.vocab, dim=args.dim, n_heads=8, hidden=4 * args.dim, n_layers=args.layers,
                   key=jax.random.key(0))
    specs = redeqx.sharding_rules(model, mesh)
    optimizer = optax.adamw(1e-3)
    state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1))
    step = redeqx.make_train_step(lm_loss, optimizer, mesh, specs)
    batch = next(redeqx.batches(token_examples(args.batch, seq_len=args.seq, vocab=args.vocab), collate_tokens,
                                args.batch // mesh.shape["data"], mesh))
    for _ in range(3):  # compile and warm up
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t)
    if jax.process_index() == 0:
        Path(args.worker).write_text(json.dumps({"times": times, "processes": jax.process_count(),
                                                 "devices": len(jax.devices()), "loss": float(metrics["loss"])}))


def launch(n_processes: int, args, out: Path) -> dict:
    cmd = [sys.executable, "-m", "redeqx.launch", "-n", str(n_processes), "--devices", "8", __file__,
           "--worker", str(out), "--dim", str(args.dim), "--layers", str(args.layers), "--vocab", str(args.vocab),
           "--seq", str(args.seq), "--batch", str(args.batch), "--steps", str(args.steps)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=worker_env())
    if done.returncode:
        sys.exit(f"{n_processes}-process run failed:\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def main():
    p = parser(__doc__)
    add_tiny_lm_args(p, rounds=3)
    p.add_argument("--worker", default=None, help="(a launched process: write its times to this file)")
    args = p.parse_args()
    if args.worker:
        return worker(args)

    times = {1: [], 2: []}
    losses = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for n in (1, 2):
                got = launch(n, args, Path(tmp) / f"{n}_{r}.json")
                assert got["processes"] == n and got["devices"] == 8
                times[n] += got["times"]
                losses[n] = got["loss"]
                print(f"round {r}: {n} process(es): median step {statistics.median(got['times']) * 1e3:.2f} ms")
    one, two = statistics.median(times[1]), statistics.median(times[2])
    print(f"1 process x 8 devices: {one * 1e3:.2f} ms; 2 processes x 4 devices: {two * 1e3:.2f} ms; "
          f"ratio {two / one:.2f} (losses {losses[1]:.5f} / {losses[2]:.5f})")

    body = "\n".join([
        f"TinyLM dim={args.dim} layers={args.layers} vocab={args.vocab}, global batch {args.batch} x {args.seq} "
        f"tokens, AdamW, n_model_shards=2 (data=4 x model=2) on 8 simulated CPU devices; median over "
        f"{args.rounds} alternating rounds x {args.steps} steps, each round a fresh `python -m redeqx.launch`.",
        "",
        "| setting | step time | ratio to 1 process |",
        "|---|---|---|",
        f"| 1 process x 8 devices | {one * 1e3:.2f} ms | 1.00 |",
        f"| 2 processes x 4 devices (gloo over 127.0.0.1) | {two * 1e3:.2f} ms | {two / one:.2f} |",
    ])
    report(args, "Multi-host step time (benchmarks/multihost.py)", body)


if __name__ == "__main__":
    main()
