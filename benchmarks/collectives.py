"""Bytes moved by one training step, read from the compiled program, against
the analytic count of the plan it should be.

    python -m benchmarks.collectives             # writes the table to benchmarks/RESULTS.md
    python -m benchmarks.collectives --ks 2 --hidden 64 --heads 4 --intermediate 128 --vocab 256 --seq 32 --no-write

The zoo's LLaMA (hidden 1024, 4 layers, batch 8 x 512, AdamW) on 8 CPU
devices at n_model_shards 1-8, with and without fsdp, listed and stacked:
each step planned on abstract shapes by the rules read from its program (as
`redeqx.plan` plans it), its collectives' bytes per device read off the HLO
and counted as XLA:GPU/TPU move them (tests/accelerator_count.py),
against Megatron-LM's count (tests/megatron_count.py) and ZeRO-3's (each
fsdp-split parameter all-gathered forward and backward, its gradient
reduce-scattered).
"""

import itertools
import math
import time
import warnings

from benchmarks._common import cpu_devices, next_token_loss, param_count, parser, report

cpu_devices(8)

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from accelerator_count import accelerator_collectives  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402
from megatron_count import megatron_bytes  # noqa: E402

import redeqx  # noqa: E402
from redeqx import models  # noqa: E402

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def mib(x) -> str:
    return f"{x / 2**20:.1f}"


def per_device_bytes(abstract, specs, mesh):
    """(bytes of every parameter on one device, bytes the fsdp-split leaves
    have once gathered over ``data``, bytes of the leaves fsdp left alone)."""
    total = gathered = rest = 0
    leaves = jax.tree.leaves(abstract, is_leaf=lambda x: x is None)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda s: s is None or isinstance(s, P))
    for leaf, spec in zip(leaves, spec_leaves, strict=True):
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            continue
        spec = P() if spec is None else spec
        shard = NamedSharding(mesh, spec).shard_shape(leaf.shape)
        b = math.prod(shard) * leaf.dtype.itemsize
        total += b
        if "data" in jax.tree.leaves(tuple(spec)):
            gathered += b * mesh.shape["data"]
        else:
            rest += b
    return total, gathered, rest


def measure(config, n_model_shards, fsdp, args):
    mesh = redeqx.make_mesh(n_model_shards)
    n_data = mesh.shape["data"]

    def make(key):
        return models.LlamaForCausalLM(config, key=key)

    abstract = eqx.filter_eval_shape(make, jax.random.key(0))
    batch = {"ids": jax.ShapeDtypeStruct((args.batch, args.seq + 1), jnp.int32)}
    with warnings.catch_warnings():  # the program's plan, as `plan` makes it: both columns count one plan
        warnings.simplefilter("ignore")
        specs = redeqx.sharding_rules(abstract, mesh, fsdp=fsdp, loss_fn=next_token_loss, batch=batch)
    params, gathered, rest = per_device_bytes(abstract, specs, mesh)
    t0 = time.perf_counter()
    p = redeqx.plan(make, next_token_loss, optax.adamw(1e-4), batch, mesh, fsdp=fsdp, explore=False)
    compile_s = time.perf_counter() - t0
    measured = {k: p.collectives.get(k, {"count": 0, "bytes": 0}) for k in KINDS}
    state = redeqx.init_state(abstract, optax.adamw(1e-4), mesh, specs, key=jax.random.key(0))
    step = redeqx.make_train_step(next_token_loss, optax.adamw(1e-4), mesh, specs)
    sharded = {"ids": jax.ShapeDtypeStruct(batch["ids"].shape, jnp.int32, sharding=NamedSharding(mesh, P("data")))}
    accelerator = sum(v["bytes"] for v in accelerator_collectives(step, state, sharded).values())

    local_batch = args.batch // n_data
    activations = megatron_bytes(config.hidden_size, config.num_hidden_layers, local_batch, args.seq, 0) \
        if n_model_shards > 1 else 0
    if fsdp and n_data > 1:
        analytic = activations + 2 * gathered + gathered // n_data + rest
        one_gather = analytic - gathered  # the forward gather kept for the backward pass
        plan_name = "ZeRO-3"
    else:
        analytic = one_gather = activations + (params if n_data > 1 else 0)
        plan_name = "Megatron"
    return dict(n_model_shards=n_model_shards, n_data=n_data, fsdp=fsdp, measured=measured, accelerator=accelerator,
                stacked=config.scan_layers,
                total=sum(v["bytes"] for v in measured.values()), analytic=analytic, one_gather=one_gather,
                plan=plan_name,
                params=params, gathered=gathered, rest=rest, compile_s=compile_s)


def main():
    p = parser(__doc__, hidden=1024, layers=4, heads=16, intermediate=2816, vocab=32000, seq=512,
               batch=8)  # batch: global, sequences per step
    p.add_argument("--ks", default="1,2,4,8", help="n_model_shards values")
    args = p.parse_args()

    rows = []
    for k, fsdp, stacked in itertools.product(map(int, args.ks.split(",")), (False, True), (False, True)):
        config = models.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                                    intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                                    num_attention_heads=args.heads, max_position_embeddings=max(2048, args.seq),
                                    scan_layers=stacked)
        rows.append(measure(config, k, fsdp, args))
        print({key: v for key, v in rows[-1].items() if key != "measured"}, flush=True)

    n_params = param_count(eqx.filter_eval_shape(lambda key: models.LlamaForCausalLM(config, key=key), jax.random.key(0)))
    lines = [
        f"LLaMA (redeqx.models) hidden {args.hidden}, {args.layers} layers, {args.heads} heads, intermediate "
        f"{args.intermediate}, vocab {args.vocab} ({n_params / 1e6:.1f} M parameters, {n_params * 4 / 2**20:.0f} MiB "
        f"fp32); a batch of {args.batch} x {args.seq} tokens, AdamW, 8 simulated CPU devices. Bytes per device per "
        "step, each collective counted by its result (`plan(...).collectives`, read from the compiled HLO, a loop "
        "counted once per iteration); beside it, the count as XLA:GPU/TPU move them (tests/accelerator_count.py: "
        "the all-reduces of added partial sums merged, as their compilers do and XLA:CPU does not); MiB. Layers "
        "listed and stacked (`scan_layers`).",
        "",
        "| layers | n_model_shards x data | fsdp | all-reduce | all-gather | reduce-scatter | other | XLA:CPU total "
        "| as an accelerator moves them | analytic | plan | ratio (accelerator) | ratio, gathering once |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        m = r["measured"]
        other = sum(m[k]["bytes"] for k in ("all-to-all", "collective-permute"))
        ratio = f"{r['accelerator'] / r['analytic']:.4f}" if r["analytic"] else ("-" if r["accelerator"] == 0 else "inf")
        once = f"{r['accelerator'] / r['one_gather']:.4f}" if r["plan"] == "ZeRO-3" else ""

        def cell(kind):
            return f"{mib(m[kind]['bytes'])} ({m[kind]['count']})" if m[kind]["count"] else "0"

        lines.append(f"| {'stacked' if r['stacked'] else 'listed'} | {r['n_model_shards']} x {r['n_data']} "
                     f"| {'yes' if r['fsdp'] else 'no'} | {cell('all-reduce')} "
                     f"| {cell('all-gather')} | {cell('reduce-scatter')} | {mib(other)} | {mib(r['total'])} "
                     f"| {mib(r['accelerator'])} | {mib(r['analytic'])} | {r['plan']} | {ratio} | {once} |")
    lines += ["", "Counts of each kind in brackets. Gathered per pass vs measured all-gather: "
              + "; ".join(f"{r['n_model_shards']} x {r['n_data']}: gathered {mib(r['gathered'])} MiB per pass, "
                          f"measured all-gather {mib(r['measured']['all-gather']['bytes'])} MiB"
                          for r in rows if r["plan"] == "ZeRO-3") + "."]
    report(args, "Collective bytes per step (benchmarks/collectives.py)", "\n".join(lines))


if __name__ == "__main__":
    main()
