"""The user GPT's train step as redeqx builds it, compiled by libtpu: the
step's own figures on an accelerator's compiler, to hold each change of how
steps are built to (issue 21: no regression in temporaries or bytes).

The user GPT of tests/user_gpt.py (the vs_redco workload, 16 sequences per
data shard), compiled by libtpu for a TPU v4 slice of 8 chips ahead of time on
this CPU-only machine (``jax.experimental.topologies``; no TPU attached,
nothing runs), at n_model_shards 1, 2 and 4. Reported from the compiled
programs: transposes and copies, the temporaries, XLA's bytes-accessed
estimate, and the collectives, next to the count of tests/accelerator_count.py
(read on XLA:CPU) and the Megatron plan's analytic count; beside them, the
same figures as measured at 176d703, before issue 21 (when the steps computed
every `eqx.nn.Linear` as ``x @ W.T``).

    python benchmarks/table1.py --setup-tpu      # once: benchmarks/.venv-tpu with libtpu
    python benchmarks/tpu_programs.py            # writes its section of benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
MIB = 2**20


def _model_and_batch(mesh):
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import redeqx
    from user_gpt import GPT, loss_fn

    abstract = eqx.filter_eval_shape(lambda k: GPT(key=k), jax.random.key(0))
    specs = redeqx.sharding_rules(abstract, mesh)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-4))
    state = redeqx.init_state(abstract, optimizer, mesh, specs, key=jax.random.key(0))
    batch = {"tokens": jax.ShapeDtypeStruct((16 * mesh.shape["data"], 257), jnp.int32,
                                            sharding=NamedSharding(mesh, P("data")))}
    return loss_fn, optimizer, specs, state, batch


# 176d703's default TPU step (linears as x @ W.T, norms as written): K -> (temporaries MiB, bytes accessed MiB)
BEFORE = {1: (309.6, 5655), 2: (120.1, 3202), 4: (36.0, 1873)}


def tpu_worker(k: int) -> dict:
    """In the libtpu venv: compile the default train step for a v4 slice of 8 chips."""
    from jax.experimental import topologies

    import redeqx
    from redeqx._hlo import DTYPE_BYTES, _LINE, array_shapes, collective_summary

    chips = topologies.get_topology_desc(platform="tpu", topology_name="v4:2x2x2", chip_config_name="megacore",
                                         chips_per_host_bounds=(2, 2, 1), num_slices=1).devices
    mesh = redeqx.make_mesh(k, devices=chips)
    loss_fn, optimizer, specs, state, batch = _model_and_batch(mesh)
    compiled = redeqx.make_train_step(loss_fn, optimizer, mesh, specs).lower(state, batch).compile()
    text = compiled.as_text()
    ops, nbytes = collections.Counter(), collections.Counter()
    for line in text.splitlines():
        m = _LINE.search(line)
        if m and m.group("op") in ("transpose", "copy"):
            ops[m.group("op")] += 1
            nbytes[m.group("op")] += sum(DTYPE_BYTES[d] * math.prod(shape) for d, shape in array_shapes(m.group("shape")))
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return dict(k=k, transposes=ops["transpose"], copies=ops["copy"],
                transpose_copy_bytes=nbytes["transpose"] + nbytes["copy"],
                temporaries=compiled.memory_analysis().temp_size_in_bytes,
                bytes_accessed=float(cost.get("bytes accessed", 0.0)), collectives=collective_summary(text))


def cpu_worker(k: int) -> dict:
    """On 8 simulated CPU devices: the count redeqx's tests use, and Megatron's."""
    import jax

    import redeqx
    from megatron_count import megatron_bytes
    from accelerator_count import accelerator_collectives
    from redeqx._trees import per_device_shape as _per_device_shape

    mesh = redeqx.make_mesh(k)
    loss_fn, optimizer, specs, state, batch = _model_and_batch(mesh)
    step = redeqx.make_train_step(loss_fn, optimizer, mesh, specs)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))
    grad_bytes = sum(4 * math.prod(_per_device_shape(x.shape, s, mesh))
                     for x, s in zip(jax.tree.leaves(state.model), spec_leaves))
    return dict(k=k, model=sum(v["bytes"] for v in accelerator_collectives(step, state, batch).values()),
                xla_cpu=sum(v["bytes"] for v in redeqx.collective_summary(step, state, batch).values()),
                megatron=megatron_bytes(256, 4, 16, 256, grad_bytes) if k > 1 else grad_bytes, grad_bytes=grad_bytes)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, k = args.worker[0], int(args.worker[1])
        print(json.dumps(tpu_worker(k) if kind == "tpu" else cpu_worker(k)), flush=True)
        return
    from _common import cpu8_env, libtpu, run_worker

    tpu_python, tpu_env = libtpu()
    rows = []
    for k in (1, 2, 4):
        tpu = run_worker(tpu_python, __file__, ["--worker", "tpu", str(k)], tpu_env)
        rows.append((k, tpu, run_worker(sys.executable, __file__, ["--worker", "cpu", str(k)], cpu8_env())))
    lines = [
        "The vs_redco user GPT (tests/user_gpt.py: 4 layers, width 256, vocab 8192, 256 tokens, tied embedding, "
        "clip + AdamW, fp32), 16 sequences per data shard, its default train step compiled by libtpu for 8 TPU v4 "
        "chips ahead of time (no TPU attached). Per chip, from the compiled programs. `Megatron` is the plan's "
        "analytic count (tests/megatron_count.py; at K=1 the gradients' bytes); `before` is the same step at "
        "176d703 (linears computed as `x @ W.T` by a swapped-in subclass).", "",
        "| K | transposes / copies (MiB) | temporaries | before | bytes accessed | before "
        "| all-reduce bytes (libtpu) | accelerator count (XLA:CPU) | XLA:CPU's count | Megatron |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    for k, r, cpu in rows:
        ar = sum(v["bytes"] for v in r["collectives"].values())
        temp, accessed = BEFORE[k]
        lines.append(
            f"| {k} | {r['transposes']} / {r['copies']} ({r['transpose_copy_bytes'] / MIB:.1f}) "
            f"| {r['temporaries'] / MIB:.1f} MiB | {temp} MiB | {r['bytes_accessed'] / MIB:.0f} MiB | {accessed} MiB "
            f"| {ar / MIB:.2f} MiB | {cpu['model'] / MIB:.2f} MiB | {cpu['xla_cpu'] / MIB:.2f} MiB "
            f"| {cpu['megatron'] / MIB:.2f} MiB |")
    report = "\n".join(lines)
    print(report)
    if not args.no_write:
        from _common import write_section

        write_section("The user GPT's step on the TPU compiler (benchmarks/tpu_programs.py)", report)


if __name__ == "__main__":
    main()
