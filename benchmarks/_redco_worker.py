"""One redco 0.4.23 run for `python -m benchmarks.vs_redco`: Hugging Face's Flax GPT-2
trained by redco's Deployer + Trainer, as redco's users write it. Run by the
redco virtual environment's python (see vs_redco.py --setup); nothing of
redeqx is imported here, nor redco there: it writes one JSON file for the
driver.

Timing: redco's own loop (`Trainer.train`) runs the steps; a Deployer whose
`log_metrics` (called once per step, after the step's metrics reach the host)
records the clock gives per-step intervals, collate and host transfer
included, as the redeqx worker's loop does.

HLO: the Trainer keeps its compiled step in `trainer._p_train_step` (a pjit,
or a pmap when n_model_shards=1); redco has no public accessor, so this
lowers that very object with the arguments redco passes it.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from importlib.metadata import version  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.traverse_util import flatten_dict  # noqa: E402
from redco import Deployer, Trainer  # noqa: E402
from transformers import FlaxGPT2LMHeadModel, GPT2Config  # noqa: E402


class TimedDeployer(Deployer):
    """A Deployer that notes the clock each time the Trainer logs a step's metrics."""

    marks: list

    def log_metrics(self, metrics, step):
        super().log_metrics(metrics=metrics, step=step)
        usage = resource.getrusage(resource.RUSAGE_SELF)  # the kernel's share: system time, page faults
        self.marks.append((time.perf_counter(), time.process_time(), float(metrics["loss"]), usage.ru_stime,
                           usage.ru_minflt))


def collate_fn(examples):
    tokens = np.stack([e["tokens"] for e in examples]).astype(np.int32)
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}


def loss_fn(rng, state, params, batch, is_training):
    logits = state.apply_fn(input_ids=batch["input_ids"], params=params, dropout_rng=rng, train=is_training)[0]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


def partitioned_text(lowered) -> str:
    """The step right after SPMD partitioning (pjit), compiled once more with
    XLA's dump on; a pmap step (n_model_shards=1) is not partitioned, and its
    lowered HLO already holds its explicit all-reduces. (redeqx._hlo has the
    pjit half of this; this worker runs in redco's own venv, without redeqx.)"""
    with tempfile.TemporaryDirectory() as d:
        try:
            lowered.compile({"xla_dump_to": d, "xla_dump_hlo_pass_re": "spmd-partitioning"})
        except TypeError:  # a pmap's lowering takes no compiler options
            return lowered.as_text(dialect="hlo")
        files = glob.glob(os.path.join(d, "*after_spmd-partitioning*.txt"))
        if files:
            return max((open(f).read() for f in files), key=len)
    return lowered.as_text(dialect="hlo")


def flops_of(compiled):
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0]
    return float(cost.get("flops", float("nan")))


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
    args = p.parse_args()

    tokens = np.load(args.data)
    examples = [{"tokens": row} for row in tokens]

    deployer = TimedDeployer(jax_seed=0, n_model_shards=args.k, verbose=False)
    deployer.marks = []
    config = GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.width, n_layer=args.layers,
                        n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = FlaxGPT2LMHeadModel(config, seed=0)
    params = model.params
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(args.lr, weight_decay=0.01))
    trainer = Trainer(deployer=deployer, collate_fn=collate_fn, apply_fn=model, loss_fn=loss_fn, params=params,
                      optimizer=optimizer, params_sharding_rules=deployer.get_sharding_rules(params))
    data_shards = jax.device_count() // args.k
    per_device = args.batch // data_shards

    t = time.perf_counter()
    trainer.train(examples[: args.warmup * args.batch], per_device_batch_size=per_device, desc="warm-up")
    warmup_s = time.perf_counter() - t
    first_loss = deployer.marks[0][2]
    deployer.marks = []
    # steps + 1 logged steps give `steps` step-to-step intervals
    timed = examples[args.warmup * args.batch: (args.warmup + args.steps + 1) * args.batch]
    trainer.train(timed, per_device_batch_size=per_device, desc="timed")
    marks = deployer.marks
    wall = [b[0] - a[0] for a, b in zip(marks, marks[1:])]
    cpu = [b[1] - a[1] for a, b in zip(marks, marks[1:])]
    sys_s = [b[3] - a[3] for a, b in zip(marks, marks[1:])]
    faults = [b[4] - a[4] for a, b in zip(marks, marks[1:])]

    out = {
        "side": "redco",
        "versions": {n: version(n) for n in ("redco", "jax", "jaxlib", "flax", "optax", "transformers")},
        "devices": jax.device_count(),
        "mesh": dict(deployer.mesh.shape) if deployer.mesh is not None else {"pmap": jax.local_device_count()},
        "wall": wall,
        "cpu": cpu,
        "sys": sys_s,
        "faults": faults,
        "first_loss": first_loss,
        "last_loss": marks[-1][2],
        "warmup_s": warmup_s,
        "n_params": int(sum(x.size for x in jax.tree.leaves(params))),
    }
    specs = trainer._state_spec.params if trainer._state_spec is not None else None
    if specs is not None:
        out["plan"] = {"/".join(k): str(v) for k, v in flatten_dict(specs).items()}
    if args.hlo:
        batch = next(iter(deployer.get_model_input_batches(
            examples=examples, per_device_batch_size=per_device, collate_fn=collate_fn, shuffle=False,
            shuffle_rng=None, desc="hlo")))
        rng = deployer.gen_model_step_rng()
        step = trainer._p_train_step  # what Trainer.train calls (pjit, or pmap for n_model_shards=1)
        with deployer.mesh if deployer.mesh is not None else contextlib.nullcontext():
            lowered = step.lower(rng, trainer.state, batch)
        compiled = lowered.compile()
        with open(args.hlo, "w") as f:
            f.write(compiled.as_text())
        with open(args.hlo + ".spmd", "w") as f:  # the driver counts its collectives as XLA:GPU/TPU move them
            f.write(partitioned_text(lowered))
        out["flops"] = flops_of(compiled)
        memory = compiled.memory_analysis()  # XLA:CPU allocates the temporaries afresh at every call
        out["temp_bytes"] = int(memory.temp_size_in_bytes) if memory is not None else None
    with open(args.out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
