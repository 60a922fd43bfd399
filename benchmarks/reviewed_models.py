"""The ten models of issue 40's first-day review against their hand plans.

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

from benchmarks._common import parser, report, serve, worker, worker_env

TARGET = 1.15  # issue 40: every model at most this many times its hand plan's bytes
SHARDS = (2, 4)


def measure(names: list[str]) -> dict:
    """{model: {shards: [plan bytes, hand bytes] or an error}}, with the redeqx this process imports."""
    import jax
    from jax.sharding import PartitionSpec as P

    jax.config.update("jax_numpy_rank_promotion", "raise")
    import reviewed_models as R
    from test_rules_reviewed import step_bytes

    import redeqx

    out = {"redeqx": str(Path(redeqx.__file__).parent)}
    for name in names:
        make, loss, batch = R.MODELS[name]
        model, out[name] = make(jax.random.key(0)), {}
        for n in SHARDS:
            try:
                plan = step_bytes(model, loss, batch, n, loss_fn=loss, batch=batch)
                hand = step_bytes(model, loss, batch, n, overrides=R.HAND[name] + [(r".", P())])
                out[name][str(n)] = [plan, hand]
            except Exception as e:  # say it in the table rather than stop the run
                out[name][str(n)] = f"{type(e).__name__}: {str(e).partition('it raised: ')[2] or str(e)}"[:160]
            print(f"  {name} n={n}: {out[name][str(n)]}", file=sys.stderr, flush=True)
    return out


def cell(measured) -> tuple[str, str]:
    """(plan / hand KiB, ratio) of one measurement."""
    if isinstance(measured, str):
        return f"error: {measured}", ""
    plan, hand = measured
    ratio = plan / hand
    return f"{plan / 1024:.1f} / {hand / 1024:.1f}", f"{ratio:.3f}{'' if ratio <= TARGET else ' **over**'}"


def table(runs: dict) -> str:
    """A row per model and shard count, a (bytes, ratio) pair of columns per run."""
    head = "| model | shards | " + " | ".join(f"{r}: plan / hand (KiB) | {r}: ratio" for r in runs) + " |"
    rows = [head, "|---|---|" + "---|---|" * len(runs)]
    names = next(iter(runs.values())).keys() - {"redeqx"}
    order = [n for n in MODEL_ORDER if n in names]
    for name in order:
        for n in SHARDS:
            cells = [c for run in runs.values() for c in cell(run[name][str(n)])]
            rows.append(f"| {name} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


MODEL_ORDER = ("mixer", "rwkv", "haiku", "nnx", "mamba", "unet", "gnn", "t5", "perceiver", "moe")


def main():
    p = parser(__doc__)
    p.add_argument("--before", type=Path, default=None, help="another source tree's src/ for a 'before' column")
    p.add_argument("--models", default=",".join(MODEL_ORDER), help="comma-separated names of tests/reviewed_models")
    p.add_argument("--json", type=Path, default=None, help="also write the measurements to this JSON file")
    args = p.parse_args()
    names = args.models.split(",")
    runs = {}
    if args.before:
        runs["before"] = worker(__file__, "measure", env=worker_env(8, PYTHONPATH=str(args.before.resolve())),
                                names=names)
    runs["after" if args.before else "this tree"] = worker(__file__, "measure", names=names)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    over = [f"{name} at {n}" for name in names for n in SHARDS
            if not isinstance(m := runs[list(runs)[-1]][name][str(n)], str) and m[0] > TARGET * m[1]]
    report(args, "Issue 40's ten reviewed models against their hand plans", f"""
Collective bytes of one SGD training step per device, as an accelerator's XLA moves them
(`tests/accelerator_count.py`), with the specs of `sharding_rules(model, mesh, loss_fn=..., batch=...)` (plan)
and of the hand-written Megatron-style plan of `tests/reviewed_models.py` (hand), on 8 simulated CPU devices
(`make_mesh(shards)`: data x model). Target: plan <= {TARGET}x hand at 2 and 4 shards.
{f"Before: redeqx at `{args.before}`. " if args.before else ""}Over the target now: {", ".join(over) or "none"}.

{table(runs)}
""")


if __name__ == "__main__" and not serve(globals()):
    main()
