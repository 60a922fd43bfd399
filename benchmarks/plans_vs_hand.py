"""Models whose program the rules once read worse than a hand plan, against that hand plan.

    python -m benchmarks.plans_vs_hand            # writes its RESULTS.md section
    python -m benchmarks.plans_vs_hand --no-write

For each model (the tests' own), the collective bytes of one SGD training step per device as an
accelerator moves them (tests/accelerator_count.py), with the specs of ``sharding_rules(model,
mesh, loss_fn=..., batch=...)`` (program) and of a hand plan (the names' specs with the layers
placed by ``overrides=``: experts split, or each expert's hidden units, Megatron's column and row),
at 2 and 4 model shards on 8 simulated CPU devices. ``--before PATH`` also reads the program with
the redeqx source at PATH (a checkout's ``src``), in a subprocess, for the "before" column.
"""

import json
import os
import subprocess
import sys

from benchmarks._common import cpu_devices, parser, report, worker_env

cpu_devices(8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

def cases():
    """``(name, model, loss, batch, hand overrides per n_model_shards)``."""
    import equinox as eqx
    import test_rules_moe as moe
    import test_rules_program as prog
    import written_otherwise as w
    from tiny_transformer import collate_tokens, lm_loss, token_examples

    key = jax.random.key(0)
    tokens = collate_tokens(token_examples(16, seq_len=8, vocab=moe.VOCAB))
    by_experts = [(r"moe\.(w_in|w_out)", P("model", None, None)), (r"moe\.b_in", P("model", None))]
    yield ("dense MoE, gates in an einsum of their own, 8 experts", moe.MoELM(moe.GatedAfter, 8, key=key), lm_loss,
           tokens, lambda n: by_experts)
    yield ("MoE LM (tests/test_rules_moe.py), 6 experts", moe.MoELM(moe.MoE, 6, key=key), lm_loss, tokens,
           lambda n: by_experts[:1] if 6 % n == 0 else [(r"moe\.w_in", P(None, "model", None)),
                                                        (r"moe\.w_out", P(None, None, "model"))])
    yield ("MoE LM, SparseMoeBlock, 6 experts", moe.MoELM(moe.SparseMoeBlock, 6, key=key), lm_loss, tokens,
           lambda n: [(r"moe\.w[123]", P("model", None, None))] if 6 % n == 0 else
           [(r"moe\.w[13]", P(None, "model", None)), (r"moe\.w2", P(None, None, "model"))])
    yield ("MoE LM, jax.lax.ragged_dot experts, 8", moe.MoELM(moe.RaggedMoE, 8, key=key), moe.ragged_loss, tokens,
           lambda n: [(r"moe\.w_in", P(None, "model", None)), (r"moe\.w_out", P(None, None, "model"))])
    vectors = {"x": prog.VECTORS["x"], "y": prog.VECTORS["y"]}
    normformer = eqx.nn.Sequential([eqx.nn.Linear(16, 16, key=jax.random.key(0)),
                                    *(prog.NormFormerBlock(k) for k in jax.random.split(jax.random.key(1), 2)),
                                    eqx.nn.LayerNorm(16), eqx.nn.Linear(16, 10, key=jax.random.key(2))])
    yield ("NormFormer blocks (a LayerNorm on the hidden units)", normformer, w.vector_loss, vectors,
           lambda n: [(r"layers\.[12]\.fc1\.weight", P("model", None)), (r"layers\.[12]\.fc1\.bias", P("model")),
                      (r"layers\.[12]\.norm\.", P("model")), (r"layers\.[12]\.fc2\.weight", P(None, "model"))])
    import test_rules_choice as choice
    yield ("residual MLP without norms (32 -> 64, 2 blocks of 256)", choice.ResidualMLP(key), choice.loss_fn,
           {"x": np.zeros((512, 32), np.float32), "y": np.zeros((512,), np.int32)},
           lambda n: [(r"fc1\.weight", P("model", None)), (r"fc1\.bias", P("model")),
                      (r"fc2\.weight", P(None, "model")), (r"fc2\.bias|stem|head", P())])
    import test_rules_cells_convs as convs
    images = {"x": np.random.default_rng(0).normal(size=(16, 4, 8, 8)).astype(np.float32),
              "y": np.zeros((16,), np.int32)}
    yield ("residual conv net, 128 channels, GroupNorm(16, 256) in its blocks, GroupNorm on its stream",
           convs.GroupNormNet(256, 16, 128, key=key), convs.loss_fn,
           images, lambda n: [(r"conv1\.weight", P("model", None, None, None)),
                              (r"conv1\.bias", P("model", None, None)), (r"blocks\.\d+\.norm\.", P("model")),
                              (r"conv2\.weight", P(None, "model", None, None)),
                              (r"stem|head|norm_out|conv2\.bias", P())])
    yield ("Equinox LM: vmapped lookup, fused (D, 2, F) gate-up", prog.FusedGateUpLM(key), w.gpt_loss, prog.TOKENS,
           lambda n: [(r"w12", P(None, None, "model")), (r"w3", P("model", None))])


def measure(only_program: bool) -> dict:
    from accelerator_count import step_bytes

    out = {}
    for name, model, loss, batch, hand in cases():
        for n in (2, 4):
            program = step_bytes(model, loss, batch, n, loss_fn=loss, batch=batch)[0]
            by_hand = None if only_program else step_bytes(model, loss, batch, n, overrides=hand(n))[0]
            out[f"{name}|{n}"] = (program, by_hand)
            print(name, n, program, by_hand, flush=True)
    return out


def main():
    p = parser(__doc__)
    p.add_argument("--before", default=None, help="a redeqx src directory to read the programs with first")
    p.add_argument("--program-only", action="store_true",
                   help="print only the program plans' bytes, as JSON (what --before runs)")
    args = p.parse_args()
    if args.program_only:
        print(json.dumps(measure(True)))
        return
    before = {}
    if args.before:
        env = worker_env(8)
        env["PYTHONPATH"] = os.pathsep.join([args.before, env["PYTHONPATH"]])
        run = subprocess.run([sys.executable, "-m", "benchmarks.plans_vs_hand", "--program-only"], env=env,
                             capture_output=True, text=True, check=True)
        before = json.loads(run.stdout.strip().splitlines()[-1])
    now = measure(False)
    rows = ["| model | shards | before: program (B) | program (B) | hand (B) | program / hand |", "|---|---|---|---|---|---|"]
    for k, (program, by_hand) in now.items():
        name, n = k.split("|")
        was = f"{before[k][0]:,}" if k in before else ""
        rows.append(f"| {name} | {n} | {was} | {program:,} | {by_hand:,} | {program / by_hand:.3f} |")
    report(args, "Plans read from the program against hand plans (benchmarks/plans_vs_hand.py)", f"""
Collective bytes of one SGD training step per device, as an accelerator's XLA moves them
(`tests/accelerator_count.py`), on 8 simulated CPU devices (`make_mesh(shards)`: data x model), with the specs
the rules read from the program and with a hand plan (the names' specs with the layers placed by `overrides=`).
Where the program is under the hand plan, the rules kept a small head or table whole (cheaper, said in
`explain`). "before": the program read by redeqx at {args.before or '(not given)'}. The tests' models.

{chr(10).join(rows)}
""")


if __name__ == "__main__":
    main()
