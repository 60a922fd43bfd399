"""Why the default train step all-reduces a tied embedding's gradient twice at
one model shard (issue 11's K=1 byte target), and which route would reduce it
once. Two probes on a small tied model (lookup ``E[ids]``, LM head ``h @ E.T``,
batch split over ``data``):

1. libtpu's own program for 8 TPU v4 chips, ahead of time (no TPU attached):
   how many all-reduces of the table's size, with the lookup as indexing, and
   with a lookup whose backward scatters into a base libtpu cannot see is zero
   (behind an optimization barrier).
2. JAX's explicit sharding on 8 simulated CPU devices: parameters typed
   ``P(reduced={'data'})`` get ``unreduced`` gradients, which one `reshard`
   reduces once, summed. Does a tied model whose lookup is a one-hot matmul
   (dots only) get one all-reduce and the one-device gradients; and which
   everyday operations refuse a reduced parameter.

    python benchmarks/table1.py --setup-tpu      # once: benchmarks/.venv-tpu with libtpu
    python benchmarks/tied_gradient.py           # writes its section of benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
V, D, B, T = 8192, 256, 64, 128  # the vs_redco GPT's table; 8 rows of 128 tokens per chip


def _loss(lookup):
    import jax
    import jax.numpy as jnp

    def loss(E, W, ids):
        h = jnp.tanh(lookup(E, ids) @ W)
        logp = jax.nn.log_softmax(h @ E.T)
        return -jnp.mean(jnp.take_along_axis(logp, ids[..., None], -1))

    return loss


def _table_all_reduces(text: str) -> int:
    """All-reduces (alone or in a tuple) with an operand of the table's shape."""
    return sum(len(re.findall(rf"f32\[{V},{D}\]", line.split("all-reduce(")[0]))
               for line in text.splitlines() if re.search(r" all-reduce(-start)?\(", line))


def tpu_worker() -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

    chips = topologies.get_topology_desc(platform="tpu", topology_name="v4:2x2x2", chip_config_name="megacore",
                                         chips_per_host_bounds=(2, 2, 1), num_slices=1).devices
    mesh = Mesh(np.array(chips).reshape(8), ("data",), axis_types=(AxisType.Auto,))

    @jax.custom_vjp
    def hidden_base(E, ids):
        return E[ids]

    def backward(ids, ct):
        base = jax.lax.optimization_barrier(jnp.zeros((V, D), ct.dtype))
        return base.at[ids].add(ct), None

    hidden_base.defvjp(lambda E, ids: (E[ids], ids), backward)
    args = (jax.ShapeDtypeStruct((V, D), jnp.float32, sharding=NamedSharding(mesh, P())),
            jax.ShapeDtypeStruct((D, D), jnp.float32, sharding=NamedSharding(mesh, P())),
            jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=NamedSharding(mesh, P("data"))))
    out = {}
    lookups = {"indexing": lambda E, ids: E[ids],
               "indexing, its scatter's zero base behind a barrier": hidden_base,
               "a one-hot matmul": lambda E, ids: jax.nn.one_hot(ids, V, dtype=E.dtype) @ E}
    for name, lookup in lookups.items():
        grad = jax.jit(jax.grad(_loss(lookup), argnums=(0, 1)), out_shardings=NamedSharding(mesh, P()))
        out[name] = _table_all_reduces(grad.lower(*args).compile().as_text())
    return out


def cpu_worker() -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P, reshard

    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    one_hot = _loss(lambda E, ids: jax.nn.one_hot(ids, V, dtype=E.dtype) @ E)
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    E0, W0 = 0.02 * jax.random.normal(k1, (V, D)), 0.02 * jax.random.normal(k2, (D, D))
    ids0 = jax.random.randint(k3, (B, T), 0, V)
    want = jax.grad(_loss(lambda E, ids: E[ids]), argnums=(0, 1))(E0, W0, ids0)
    out = {"refused": {}}
    with jax.set_mesh(mesh):
        reduced = NamedSharding(mesh, P(None, None, reduced={"data"}))
        E, W = jax.device_put(E0, reduced), jax.device_put(W0, reduced)
        ids = jax.device_put(ids0, NamedSharding(mesh, P("data")))
        step = jax.jit(lambda *a: [reshard(g, P()) for g in jax.grad(one_hot, argnums=(0, 1))(*a)])
        out["one_hot_table_all_reduces"] = _table_all_reduces(step.lower(E, W, ids).compile().as_text())
        got = step(E, W, ids)
        out["one_hot_max_abs_diff"] = max(float(np.max(np.abs(np.asarray(g) - np.asarray(w))))
                                          for g, w in zip(got, want))
        w = jax.device_put(jnp.ones(D), NamedSharding(mesh, P(None, reduced={"data"})))
        x = jax.device_put(jnp.ones((B, D)), NamedSharding(mesh, P("data")))
        ops = {"bias add (x + w)": lambda w, E, x, ids: jnp.sum(x + w),
               "scale (x * w)": lambda w, E, x, ids: jnp.sum(x * w),
               "lookup (E[ids])": lambda w, E, x, ids: jnp.sum(E[ids]),
               "scale under vmap": lambda w, E, x, ids: jnp.sum(jax.vmap(lambda r: r * w)(x))}
        for name, fn in ops.items():
            try:
                jax.jit(jax.grad(fn, argnums=(0, 1))).lower(w, E, x, ids)
            except Exception as e:  # noqa: BLE001 - the probe reports what JAX says
                out["refused"][name] = f"{type(e).__name__}: {str(e).splitlines()[0][:110]}"
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--worker", choices=("tpu", "cpu"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(tpu_worker() if args.worker == "tpu" else cpu_worker()), flush=True)
        return
    import jax
    from _common import cpu8_env, libtpu, run_worker

    tpu_python, tpu_env = libtpu()
    tpu = run_worker(tpu_python, __file__, ["--worker", "tpu"], tpu_env)
    cpu = run_worker(sys.executable, __file__, ["--worker", "cpu"], cpu8_env())

    lines = [
        f"Tied table {V} x {D} (fp32, 8 MiB), batch {B} x {T} tokens split over 8 data shards, at one model shard.", "",
        "| probe | all-reduces of the table |", "|---|---|",
        *(f"| libtpu, lookup as {name} | {n} |" for name, n in tpu.items()),
        f"| JAX explicit sharding, parameters `reduced`, lookup as a one-hot matmul | "
        f"{cpu['one_hot_table_all_reduces']} (gradients within {cpu['one_hot_max_abs_diff']:.1e} of one device) |", "",
        f"Operations JAX {jax.__version__} refuses on a `reduced` parameter meeting a batch split over `data`:", "",
        *(f"- {name}: `{why}`" for name, why in cpu["refused"].items()),
    ]
    indexing, hidden, dots = tpu.values()
    if indexing == 2 and dots == 1:
        lines += ["", (
            "Reading: libtpu sums two all-reduces of dots into one (the one-hot row), so the second reduction of "
            "the table is the lookup's scatter-add: libtpu moves the head's term into the scatter's base before "
            "partitioning, and its partitioner reduces that base, then the scattered table again"
            + (", even when the base it is given is hidden behind a barrier." if hidden == 2 else ".")
            + " A one-hot lookup reduces once but adds a vocabulary-sized matmul per token to each step; "
            "`make_train_step(..., shard_mean_loss=True)` reduces once by computing each data shard's gradients "
            "apart, for a loss that is a mean over rows. The general route, parameters typed `reduced` over "
            "`data` so that every use's gradient stays unreduced until one sum, works for dots"
            + (" (one all-reduce)" if cpu["one_hot_table_all_reduces"] == 1 else "")
            + (" but not for the operations listed above, which every Equinox model has (biases, norm scales, "
               "embedding lookups)." if cpu["refused"] else "."))]

    print("\n".join(lines))
    if not args.no_write:
        from _common import write_section

        write_section("A tied embedding's gradient at one model shard (benchmarks/tied_gradient.py)", "\n".join(lines))


if __name__ == "__main__":
    main()
