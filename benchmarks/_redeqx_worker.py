"""One redeqx run for benchmarks/vs_redco.py: the plain-Equinox GPT of
tests/user_gpt.py trained with redeqx's public API only. Writes one JSON file
for the driver (the same fields as _redco_worker.py).

Timing: the user's loop (`for batch in redeqx.batches(...)`) with the loss
read back to the host each step, as redco's Trainer does for its progress
bar; per-step intervals run from one step's loss on the host to the next's,
so collate and host transfer are included on both sides.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from importlib.metadata import version  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import redeqx  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from accelerator_count import partitioned_text  # noqa: E402
from user_gpt import GPT, collate_fn, loss_fn  # noqa: E402


def apply_as_xw():
    """The user GPT's layers applied as ``x @ W.T + b`` to a (tokens, features)
    array instead of ``jax.vmap(linear)(x)``: the same parameters, paths and
    specs, computed in the order XLA:CPU's dot emitter takes without transposes
    (``vmap`` of ``W @ x`` lowers to ``dot_general(W, x)``, (out, batch, tokens),
    then a transpose)."""
    import jax.numpy as jnp
    import user_gpt

    def dense(layer, x):
        return x @ layer.weight.T + layer.bias

    def attention(self, x):
        t, c = x.shape
        h = self.n_heads
        q, k, v = (dense(lin, x).reshape(t, h, c // h) for lin in (self.query, self.key, self.value))
        att = jnp.einsum("thd,shd->hts", q, k) / jnp.sqrt(c // h).astype(x.dtype)
        causal = jnp.tril(jnp.ones((t, t), bool))
        att = jax.nn.softmax(jnp.where(causal, att, jnp.finfo(att.dtype).min), axis=-1)
        return dense(self.proj, jnp.einsum("hts,shd->thd", att, v).reshape(t, c))

    user_gpt.Attention.__call__ = attention
    user_gpt.MLP.__call__ = lambda self, x: dense(self.fc2, jax.nn.gelu(dense(self.fc1, x)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--k", type=int, required=True)
    p.add_argument("--batch", type=int, required=True, help="global batch (rows per step)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--data", required=True, help=".npy of (n, seq + 1) int32 tokens")
    p.add_argument("--out", required=True)
    p.add_argument("--hlo", default=None, help="also write the compiled step's HLO text here")
    p.add_argument("--shard-mean-loss", action="store_true",
                   help="make_train_step(shard_mean_loss=True): per-shard gradients, one all-reduce")
    p.add_argument("--no-donate", action="store_true", help="a copy of the step without donation (to time its cost)")
    p.add_argument("--profile", default=None, help="record the timed steps with jax.profiler into this folder")
    p.add_argument("--matmul", choices=("wx", "xw"), default="wx",
                   help="wx: the model as written (vmap of eqx.nn.Linear, W @ x per token); xw: the same parameters "
                        "applied as x @ W.T on a whole sequence (Flax's order), to time what that order costs")
    args = p.parse_args()

    tokens = np.load(args.data)
    n = (args.warmup + args.steps) * args.batch  # the mark after warm-up + `steps` more
    examples = [{"tokens": row} for row in tokens[:n]]

    if args.matmul == "xw":
        apply_as_xw()
    mesh = redeqx.make_mesh(args.k)
    model = GPT(vocab=args.vocab, seq=args.seq, width=args.width, layers=args.layers, heads=args.heads,
                key=jax.random.key(0))
    specs = redeqx.sharding_rules(model, mesh)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(args.lr, weight_decay=0.01))
    state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1))
    train_step = redeqx.make_train_step(loss_fn, optimizer, mesh, specs, shard_mean_loss=args.shard_mean_loss)
    if args.no_donate:
        train_step._compiled.donate = False
    per_device = args.batch // mesh.shape["data"]

    marks, losses = [], []
    t = time.perf_counter()
    for i, batch in enumerate(redeqx.batches(examples, collate_fn, per_device, mesh, shuffle=True,
                                             key=jax.random.key(2))):
        state, metrics = train_step(state, batch)
        losses.append(float(metrics["loss"]))  # to the host, as a progress bar would
        if i == args.warmup - 1:
            warmup_s = time.perf_counter() - t
            if args.profile:
                jax.profiler.start_trace(args.profile, create_perfetto_trace=True)
        if i >= args.warmup - 1:  # the mark after the last warm-up step starts the first interval
            usage = resource.getrusage(resource.RUSAGE_SELF)  # the kernel's share: system time, page faults
            marks.append((time.perf_counter(), time.process_time(), usage.ru_stime, usage.ru_minflt))
    if args.profile:
        jax.profiler.stop_trace()
    wall = [b[0] - a[0] for a, b in zip(marks, marks[1:])]
    cpu = [b[1] - a[1] for a, b in zip(marks, marks[1:])]
    sys_s = [b[2] - a[2] for a, b in zip(marks, marks[1:])]
    faults = [b[3] - a[3] for a, b in zip(marks, marks[1:])]

    out = {
        "side": "redeqx",
        "versions": {n: version(n) for n in ("redeqx", "jax", "jaxlib", "equinox", "optax")},
        "devices": jax.device_count(),
        "mesh": dict(mesh.shape),
        "wall": wall,
        "cpu": cpu,
        "sys": sys_s,
        "faults": faults,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "warmup_s": warmup_s,
        "n_params": int(sum(x.size for x in jax.tree.leaves(model) if isinstance(x, jax.Array))),
        "plan": {jax.tree_util.keystr(kp): str(spec) for kp, spec in jax.tree_util.tree_flatten_with_path(
            specs, is_leaf=lambda x: isinstance(x, P))[0]},
    }
    if args.hlo:
        compiled = train_step.lower(state, batch).compile()
        with open(args.hlo, "w") as f:
            f.write(compiled.as_text())
        with open(args.hlo + ".spmd", "w") as f:  # the driver counts its collectives as XLA:GPU/TPU move them
            f.write(partitioned_text(train_step, state, batch))
        cost = compiled.cost_analysis()
        if isinstance(cost, (list, tuple)):
            cost = cost[0]
        out["flops"] = float(cost.get("flops", float("nan")))
        memory = compiled.memory_analysis()  # XLA:CPU allocates the temporaries afresh at every call
        out["temp_bytes"] = int(memory.temp_size_in_bytes) if memory is not None else None
    with open(args.out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
