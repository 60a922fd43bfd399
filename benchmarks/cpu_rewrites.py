"""Each rewrite redeqx once applied for XLA:CPU's sake, compiled by an
accelerator's compiler both ways: libtpu for a TPU v4 slice of 8 chips, ahead
of time on this CPU-only machine (no TPU attached, nothing runs), next to
XLA:CPU on 8 simulated devices. Issue 21 keeps a rewrite only where an
accelerator's own program says it pays (or it fixes a correctness problem).

    python benchmarks/table1.py --setup-tpu      # once: benchmarks/.venv-tpu with libtpu
    python benchmarks/cpu_rewrites.py            # writes its section of benchmarks/RESULTS.md

Variants, each a train step (AdamW, fp32) at n_model_shards 2 and 4:

- ``linears``: the user GPT of tests/user_gpt.py (width 256, 4 layers, 16
  sequences of 256 tokens per data shard) with `eqx.nn.Linear` (``W @ x``)
  or with a layer computing ``x @ W.T`` (what the old steps swapped in);
- ``norms``: the same GPT with `eqx.nn.LayerNorm` as written, or recomputed
  in the backward pass (`jax.checkpoint`, what the old CPU steps did);
- ``remat``: the same GPT at 8 layers with no remat, each block under
  `jax.checkpoint`, or under the checkpoint whose recomputation is tied to
  the incoming gradient (`redeqx._cpu.tied_checkpoint`);
- ``fused``: the zoo LLaMA (hidden 512, 4 layers, 8 heads, vocab 8192) with
  Q/K/V and gate/up as one joined matmul with its own backward pass (old
  ``redeqx.models._fused``), or as separate layers; only where the installed
  redeqx still has the joined form.

Figures per device from the compiled programs: temporaries, XLA's
bytes-accessed estimate, FLOPs, and the collectives' bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
MIB = 2**20
KS = (2, 4)


def _gpt_variant(linears: str, norms: str, remat: str, layers: int):
    """The user GPT's classes, rebuilt with the requested layers."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    import user_gpt

    class RowsLinear(eqx.Module):
        weight: jax.Array
        bias: jax.Array

        def __call__(self, x):
            return x @ self.weight.T + self.bias

    class RecomputedNorm(eqx.Module):
        norm: eqx.nn.LayerNorm

        def __call__(self, x):
            return jax.checkpoint(lambda n, x: n(x))(self.norm, x)

    def convert(model):
        if linears == "x @ W.T":
            is_linear = lambda x: isinstance(x, eqx.nn.Linear)  # noqa: E731
            model = jax.tree.map(lambda x: RowsLinear(x.weight, x.bias) if is_linear(x) else x, model,
                                 is_leaf=is_linear)
        if norms == "recomputed":
            is_norm = lambda x: isinstance(x, eqx.nn.LayerNorm)  # noqa: E731
            model = jax.tree.map(lambda x: RecomputedNorm(x) if is_norm(x) else x, model, is_leaf=is_norm)
        return model

    class Checkpointed(eqx.Module):
        block: eqx.Module
        how: object = eqx.field(static=True)

        def __call__(self, *args):
            if self.how == "jax.checkpoint":
                return jax.checkpoint(lambda block, *a: block(*a))(self.block, *args)
            # the block's arrays as the function's own (not tied to the gradient), as redeqx.remat did
            return _tied_checkpoint()(jax.tree_util.Partial(type(self.block).__call__, self.block))(*args)

    def loss_fn(model, batch, key):
        if remat != "none":
            model = eqx.tree_at(lambda m: m.blocks, model, [Checkpointed(b, remat) for b in model.blocks])
        return user_gpt.loss_fn(model, batch, key)

    def make(key):
        return convert(user_gpt.GPT(layers=layers, key=key))

    del jnp
    return make, loss_fn


def _tied_checkpoint():
    try:
        from redeqx._cpu import tied_checkpoint
    except ImportError:  # before issue 21, redeqx.checkpoint itself was tied
        from redeqx._remat import checkpoint as tied_checkpoint
    return tied_checkpoint


def _compile(make, loss_fn, mesh, per_shard, seq):
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import redeqx

    abstract = eqx.filter_eval_shape(make, jax.random.key(0))
    specs = redeqx.sharding_rules(abstract, mesh)
    optimizer = optax.adamw(1e-4)
    state = redeqx.init_state(abstract, optimizer, mesh, specs, key=jax.random.key(0))
    batch = {"tokens": jax.ShapeDtypeStruct((per_shard * mesh.shape["data"], seq + 1), jnp.int32,
                                        sharding=NamedSharding(mesh, P("data")))}
    return redeqx.make_train_step(loss_fn, optimizer, mesh, specs).lower(state, batch).compile()


def _figures(compiled) -> dict:
    from redeqx import collective_summary

    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return dict(temporaries=compiled.memory_analysis().temp_size_in_bytes,
                bytes_accessed=float((cost or {}).get("bytes accessed", 0.0)),
                flops=float((cost or {}).get("flops", 0.0)),
                collectives=sum(v["bytes"] for v in collective_summary(compiled.as_text()).values()))


def _zoo(fused: bool):
    """The zoo LLaMA's constructor and loss, with its Q/K/V and gate/up joined
    (as the installed redeqx does) or called one by one."""
    import jax
    import optax

    from redeqx import models
    from redeqx.models import _layers, _llama

    if not fused:
        separate = lambda x, layers, units=None: [layer(x) for layer in layers]  # noqa: E731
        _llama.fused_linears = separate
    config = models.LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                                num_attention_heads=8)

    def loss_fn(model, batch, key):
        tokens = batch["tokens"]
        logits = jax.vmap(model)(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    del _layers
    return (lambda key: models.LlamaForCausalLM(config, key=key)), loss_fn


def _has_joined_matmuls() -> bool:
    try:
        from redeqx.models import _llama

        return hasattr(_llama, "fused_linears")
    except ImportError:
        return False


def cases():
    yield "linears", [("W @ x", {"linears": "W @ x"}), ("x @ W.T", {"linears": "x @ W.T"})]
    yield "norms", [("as written", {"norms": "as written"}), ("recomputed", {"norms": "recomputed"})]
    yield "remat", [("none", {"remat": "none"}), ("jax.checkpoint", {"remat": "jax.checkpoint"}),
                    ("tied", {"remat": "tied"})]
    yield "fused", [("joined", {"fused": True}), ("separate", {"fused": False})]


def worker(platform: str, k: int, case: str, variant: str) -> dict:
    import redeqx

    try:  # before issue 21 the steps swapped users' linears and norms on their own: measure as written
        import redeqx._layout as layout

        layout.as_computed = lambda model, platform: model
    except ImportError:
        pass
    if platform == "tpu":
        from jax.experimental import topologies

        devices = topologies.get_topology_desc(platform="tpu", topology_name="v4:2x2x2", chip_config_name="megacore",
                                               chips_per_host_bounds=(2, 2, 1), num_slices=1).devices
    else:
        import jax

        devices = jax.devices()
    mesh = redeqx.make_mesh(k, devices=devices)
    kw = dict(dict(cases())[case])[variant]
    if case == "fused":
        make, loss_fn = _zoo(kw["fused"])
        return _figures(_compile(make, loss_fn, mesh, 8, 256))
    options = {"linears": "W @ x", "norms": "as written", "remat": "none", **kw}
    layers = 8 if case == "remat" else 4
    make, loss_fn = _gpt_variant(options["linears"], options["norms"], options["remat"], layers)
    return _figures(_compile(make, loss_fn, mesh, 16, 256))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--cases", default="linears,norms,remat,fused")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        platform, k, case, variant = args.worker
        print(json.dumps(worker(platform, int(k), case, variant)), flush=True)
        return
    from _common import cpu8_env, libtpu, run_worker

    tpu_python, tpu_env = libtpu()
    wanted = args.cases.split(",")
    lines = ["| case | K | variant | libtpu temporaries | libtpu bytes accessed | libtpu collectives | libtpu FLOPs "
             "| XLA:CPU temporaries | XLA:CPU collectives |", "|---|---|---|---|---|---|---|---|---|"]
    for case, variants in cases():
        if case not in wanted or (case == "fused" and not _has_joined_matmuls()):
            continue
        for k in KS:
            for variant, _ in variants:
                argv = ["--worker", "tpu", str(k), case, variant]
                tpu = run_worker(tpu_python, __file__, argv, tpu_env)
                cpu = run_worker(sys.executable, __file__, ["--worker", "cpu", str(k), case, variant], cpu8_env())
                row = (f"| {case} | {k} | {variant} | {tpu['temporaries'] / MIB:.1f} MiB | "
                       f"{tpu['bytes_accessed'] / MIB:.0f} MiB | {tpu['collectives'] / MIB:.2f} MiB | "
                       f"{tpu['flops']:.3e} | {cpu['temporaries'] / MIB:.1f} MiB | {cpu['collectives'] / MIB:.2f} MiB |")
                print(row, flush=True)
                lines.append(row)
    report = "\n".join(lines)
    if not args.no_write:
        from _common import write_section

        write_section("Rewrites for XLA:CPU, compiled by libtpu (benchmarks/cpu_rewrites.py)", report)


if __name__ == "__main__":
    main()
