"""The ten models of issue 40's first-day review (and four more written as a researcher would:
ConvNeXt, wav2vec2, ALBERT, a Mamba with eqx.nn.Conv1d) against their hand plans.

    python -m benchmarks.reviewed_models                           # this tree only; writes its RESULTS.md section
    python -m benchmarks.reviewed_models --before /path/to/old/src  # and a "before" column from another tree's src
    python -m benchmarks.reviewed_models --models rwkv,unet --no-write

For each model of tests/reviewed_models.py (each with its loss, batch and
hand-written Megatron-style plan, ``HAND``): the collective bytes of one SGD
training step as an accelerator moves them (tests/accelerator_count.py, the
measure of tests/test_rules_reviewed.py), per device, with the specs of
``sharding_rules(model, mesh, loss_fn=..., batch=...)`` and with the hand
plan, at 2 and 4 model shards of 8 simulated CPU devices. Each source tree is
measured in its own worker process (``PYTHONPATH`` naming the tree's ``src``);
the models, batches and hand plans are this tree's.
"""

import json
import sys
from pathlib import Path

from benchmarks._common import parser, report, serve, timed, worker, worker_env

TARGET = 1.15  # issue 40: every model at most this many times its hand plan's bytes
SHARDS = (2, 4)


def planning_seconds(model, mesh, **rules) -> float:
    """The best of three timed calls of ``sharding_rules(model, mesh, **rules)``, after one untimed."""
    import warnings

    import redeqx

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return min(timed(lambda: redeqx.sharding_rules(model, mesh, **rules), 4)[1:])


def llama_1b_seconds() -> float:
    """`planning_seconds` of the zoo's 1B LLaMA (TinyLlama's shape, 22 layers stacked, abstract) with
    its loss and a batch of 8 x 2048 tokens, at n_model_shards=4."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    import redeqx
    from redeqx import models

    config = models.LlamaConfig(num_hidden_layers=22, scan_layers=True, vocab_size=32000, hidden_size=2048,
                                intermediate_size=5632, num_attention_heads=32, num_key_value_heads=4)
    model = eqx.filter_eval_shape(lambda k: models.LlamaForCausalLM(config, key=k), jax.random.key(0))

    def loss(model, batch, key):
        logits = jax.vmap(model)(batch["ids"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["ids"][:, 1:]).mean()

    batch = {"ids": jax.ShapeDtypeStruct((8, 2049), jnp.int32)}
    return planning_seconds(model, redeqx.make_mesh(4), loss_fn=loss, batch=batch)


def measure(names: list[str]) -> dict:
    """{model: {shards: [plan bytes, hand bytes, sharding_rules seconds] or an error}, "llama1b": seconds},
    with the redeqx this process imports."""
    import jax
    from jax.sharding import PartitionSpec as P

    jax.config.update("jax_numpy_rank_promotion", "raise")
    import reviewed_models as R
    from test_rules_reviewed import step_bytes

    import redeqx

    out = {"redeqx": str(Path(redeqx.__file__).parent)}
    for name in names:
        make, loss, batch = {**R.MODELS, **R.RESEARCHER_MODELS}[name]
        model, out[name] = make(jax.random.key(0)), {}
        for n in SHARDS:
            try:
                plan, _ = step_bytes(model, loss, batch, n, loss_fn=loss, batch=batch)  # (bytes, specs)
                hand, _ = step_bytes(model, loss, batch, n, overrides=R.HAND[name] + [(r".", P())])
                seconds = planning_seconds(model, redeqx.make_mesh(n), loss_fn=loss, batch=batch)
                out[name][str(n)] = [plan, hand, seconds]
            except Exception as e:  # say it in the table rather than stop the run
                out[name][str(n)] = f"{type(e).__name__}: {str(e).partition('it raised: ')[2] or str(e)}"[:160]
            print(f"  {name} n={n}: {out[name][str(n)]}", file=sys.stderr, flush=True)
    out["llama1b"] = llama_1b_seconds()
    print(f"  llama1b: {out['llama1b']:.3f} s", file=sys.stderr, flush=True)
    return out


def validate(names: list[str]) -> dict:
    """{model: {shards: [estimated saving, compiled saving] (bytes)}}: what the weights the rules keep
    whole by their estimate (`sharding/_roles.py`, `Pricing`) save by that estimate, against what the
    compiled steps move with and without pricing (every priced choice left as proven or as the names
    split it), in one process."""
    import jax

    jax.config.update("jax_numpy_rank_promotion", "raise")
    import reviewed_models as R
    from test_rules_reviewed import step_bytes

    import redeqx
    from redeqx.sharding import _decide, _public

    out = {}
    for name in names:
        make, loss, batch = {**R.MODELS, **R.RESEARCHER_MODELS}[name]
        model, out[name] = make(jax.random.key(0)), {}
        for n in SHARDS:
            mesh = redeqx.make_mesh(n)
            decider = _decide._Decider(model, mesh, (), False, None, _public.program_facts(model, loss, batch))
            decider.run()
            estimated = sum(split - whole for _, split, whole in decider.pricing.taken)
            priced, _ = step_bytes(model, loss, batch, n, loss_fn=loss, batch=batch)
            budget, _decide.WHOLE_MEMORY_BYTES = _decide.WHOLE_MEMORY_BYTES, 0  # nothing may be kept whole
            try:
                unpriced, _ = step_bytes(model, loss, batch, n, loss_fn=loss, batch=batch)
            finally:
                _decide.WHOLE_MEMORY_BYTES = budget
            out[name][str(n)] = [estimated, unpriced - priced, len(decider.pricing.taken)]
            print(f"  {name} n={n}: {out[name][str(n)]}", file=sys.stderr, flush=True)
    return out


def validation_table(found: dict) -> str:
    rows = ["| model | shards | choices priced whole | estimated saving (KiB) | compiled saving (KiB) |",
            "|---|---|---|---|---|"]
    for name in [n for n in MODEL_ORDER if n in found]:
        for n in SHARDS:
            est, compiled, count = found[name][str(n)]
            if count:
                rows.append(f"| {name} | {n} | {count} | {est / 1024:.1f} | {compiled / 1024:.1f} |")
    return "\n".join(rows)


def cell(measured) -> tuple[str, str, str]:
    """(plan / hand KiB, ratio, sharding_rules ms) of one measurement."""
    if isinstance(measured, str):
        return f"error: {measured}", "", ""
    plan, hand, *seconds = measured  # older JSON: no time
    ratio = plan / hand
    return (f"{plan / 1024:.1f} / {hand / 1024:.1f}", f"{ratio:.3f}{'' if ratio <= TARGET else ' **over**'}",
            f"{seconds[0] * 1e3:.0f}" if seconds else "")


def table(runs: dict) -> str:
    """A row per model and shard count, a (bytes, ratio) pair of columns per run."""
    head = "| model | shards | " + " | ".join(f"{r}: plan / hand (KiB) | {r}: ratio | {r}: rules (ms)"
                                             for r in runs) + " |"
    rows = [head, "|---|---|" + "---|---|---|" * len(runs)]
    names = next(iter(runs.values())).keys() - {"redeqx", "llama1b"}
    order = [n for n in MODEL_ORDER if n in names]
    for name in order:
        for n in SHARDS:
            cells = [c for run in runs.values() for c in cell(run[name][str(n)])]
            rows.append(f"| {name} | {n} | " + " | ".join(cells) + " |")
    rows.append("| LLaMA 1B (22 stacked layers, abstract), rules only | 4 | " + " | ".join(
        f" | | {run['llama1b'] * 1e3:.0f}" if "llama1b" in run else " | | " for run in runs.values()) + " |")
    return "\n".join(rows)


MODEL_ORDER = ("mixer", "rwkv", "haiku", "nnx", "mamba", "unet", "gnn", "t5", "perceiver", "moe",
               "convnext", "wav2vec2", "albert", "mamba2")  # the last four: written as a researcher would


def main():
    p = parser(__doc__)
    p.add_argument("--before", type=Path, default=None, help="another source tree's src/ for a 'before' column")
    p.add_argument("--models", default=",".join(MODEL_ORDER), help="comma-separated names of tests/reviewed_models")
    p.add_argument("--json", type=Path, default=None, help="also write the measurements to this JSON file")
    p.add_argument("--validate", action="store_true", help="only the estimate of priced choices against the "
                   "compiled steps' bytes, in its own section")
    args = p.parse_args()
    names = args.models.split(",")
    if args.validate:
        found = worker(__file__, "validate", names=names)
        report(args, "What the rules' estimate of a split's cost says, against the compiled steps", f"""
For each reviewed model whose plan keeps weights whole because the rules' estimate says that moves fewer bytes
a step (`sharding_rules` with `loss_fn`/`batch`; see docs/guides/sharding_rules.md, "What a split costs"): the
bytes those choices save by the estimate, and by the compiled SGD steps with and without them (every priced
choice left split as the program proved it or as the names split it), as an accelerator's XLA moves them
(`tests/accelerator_count.py`), per device, on 8 simulated CPU devices.

{validation_table(found)}
""")
        return
    runs = {}
    if args.before:
        runs["before"] = worker(__file__, "measure", env=worker_env(8, PYTHONPATH=str(args.before.resolve())),
                                names=names)
    runs["after" if args.before else "this tree"] = worker(__file__, "measure", names=names)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    over = [f"{name} at {n}" for name in names for n in SHARDS
            if not isinstance(m := runs[list(runs)[-1]][name][str(n)], str) and m[0] > TARGET * m[1]]
    report(args, "The reviewed models against their hand plans", f"""
Collective bytes of one SGD training step per device, as an accelerator's XLA moves them
(`tests/accelerator_count.py`), with the specs of `sharding_rules(model, mesh, loss_fn=..., batch=...)` (plan)
and of the hand-written Megatron-style plan of `tests/reviewed_models.py` (hand), on 8 simulated CPU devices
(`make_mesh(shards)`: data x model). Target: plan <= {TARGET}x hand at 2 and 4 shards. "rules (ms)": the
best of three calls of that `sharding_rules` (after one untimed), alone on this machine.
{f"Before: redeqx at `{args.before}`. " if args.before else ""}Over the target now: {", ".join(over) or "none"}.

{table(runs)}
""")


if __name__ == "__main__" and not serve(globals()):
    main()
