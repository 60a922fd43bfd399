"""Muon (``optax.contrib.muon``) on a stacked LM, by the compiler that runs the step: optax's default
rule against `redeqx.muon_dimensions`, and the momentum's layout.

    python -m benchmarks.muon --before /path/to/old/src   # writes its RESULTS.md section
    python -m benchmarks.muon --no-write

One training step per device of the zoo's LLaMA (stacked: ``scan_layers=True``), compiled (nothing
run) by XLA:CPU (8 simulated devices) and libtpu (8 TPU v4 chips, none attached:
benchmarks/.venv-tpu), at 1 and 2 model shards (data 8; data 4 x model 2), with AdamW for scale,
Muon with optax's default rule (2-D arrays: on a stack the embedding, the head and the norm scales;
every layer's matrices on AdamW) and Muon with ``muon_dimensions`` (each layer's matrices), and
AdamW and ``muon_dimensions`` again with ``fsdp=True`` (each large weight split over ``data`` on a
matrix dim as well). Figures:
the collective bytes per device as the compiler moves them, the compiled program's FLOPs and peak
bytes per device (`plans_vs_hand.figures`), each compile in its own process. ``--before``: the same
with the redeqx at that src directory (for its section in RESULTS.md: the commit before the one that
moved an fsdp-split stack's Muon momentum to ``data`` on the layer axis; under fsdp it mirrored its
weight's spec, and the partitioner gathered the matrices for the Newton-Schulz products).
"""

import os

from benchmarks._common import compiler, parser, report, serve, source_named, worker

OPTIMIZERS = ("AdamW", "Muon, optax's default rule", "Muon, muon_dimensions", "AdamW, fsdp",
              "Muon, muon_dimensions, fsdp")
LAYERS, HIDDEN, FFN, VOCAB, TOKENS, ROWS = 8, 512, 1408, 2048, 128, 32


def _case():
    import jax
    import jax.numpy as jnp

    from redeqx.models import LlamaConfig, LlamaForCausalLM, cross_entropy

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                         num_attention_heads=8, max_position_embeddings=TOKENS)

    def loss(model, batch, key):
        logits = jax.vmap(model)(batch["input_ids"])
        return cross_entropy(logits[:, :-1], batch["input_ids"][:, 1:])

    model = LlamaForCausalLM(config, key=jax.random.key(0))
    return model, loss, {"input_ids": jax.ShapeDtypeStruct((ROWS, TOKENS), jnp.int32)}


def measure(platform: str, which: int, n: int) -> dict:
    """The figures of optimizer ``which`` at ``n`` model shards, compiled for ``platform``'s 8 devices."""
    import jax
    import optax

    import redeqx
    from benchmarks._common import tpu_v4_devices
    from benchmarks.plans_vs_hand import figures

    jax.config.update("jax_numpy_rank_promotion", "raise")
    devices = tpu_v4_devices(8) if platform == "tpu" else jax.devices()[:8]
    model, loss, batch = _case()
    name = OPTIMIZERS[which]
    if name.startswith("AdamW"):
        optimizer = optax.adamw(1e-3)
    elif "default" in name:
        optimizer = optax.contrib.muon(0.02, adam_learning_rate=1e-3)
    else:
        dims = redeqx.muon_dimensions(model, loss, batch)
        optimizer = optax.contrib.muon(0.02, adam_learning_rate=1e-3, muon_weight_dimension_numbers=dims)
    found = figures(model, loss, batch, n, devices, optimizer=optimizer, loss_fn=loss, batch=batch,
                    fsdp=name.endswith("fsdp"))
    print(platform, OPTIMIZERS[which], n, found, flush=True)
    return found


def main():
    p = parser(__doc__)
    p.add_argument("--before", default=None, help="a redeqx src directory to compile the steps with first")
    args = p.parse_args()
    compilers = {"XLA:CPU": (*compiler(False), "cpu"), "libtpu": (*compiler(True), "tpu")}
    rows = ["| compiler | optimizer | model shards | before: bytes / FLOPs / peak (MiB, G, MiB) | now | now / before: "
            "bytes | FLOPs | peak |", "|---|---|---|---|---|---|---|---|"]
    text = lambda f: f"{f['bytes'] / 2**20:.2f} / {f['flops'] / 1e9:.2f} / {f['peak'] / 2**20:.1f}"  # noqa: E731
    for label, (python, env, platform) in compilers.items():
        old = args.before and dict(env, PYTHONPATH=os.pathsep.join([os.path.abspath(args.before), env["PYTHONPATH"]]))
        for which, name in enumerate(OPTIMIZERS):
            for n in (1, 2):
                was = worker(__file__, "measure", python=python, env=old, platform=platform, which=which, n=n) \
                    if old else None
                fig = worker(__file__, "measure", python=python, env=env, platform=platform, which=which, n=n)
                ratios = " | ".join(f"{fig[x] / was[x]:.2f}" if was and was[x] else "n/a"
                                    for x in ("bytes", "flops", "peak"))
                rows.append(f"| {label} | {name} | {n} | {text(was) if was else ''} | {text(fig)} | {ratios} |")
    report(args, "Muon on a stacked LM (benchmarks/muon.py)", f"""
One AdamW or Muon training step per device of the zoo's LLaMA, stacked ({LAYERS} layers, hidden {HIDDEN},
MLP {FFN}, vocabulary {VOCAB}; {ROWS} rows of {TOKENS} tokens), on 8 devices (model shards 1: data 8;
2: data 4 x model 2), compiled by each compiler with the specs the rules read from the program: collective
bytes per device as that compiler moves them (on XLA:CPU, as an accelerator's XLA would), the compiled
program's FLOPs and its peak bytes per device. Muon's rule: optax's default (every 2-D array: here the
embedding, the head and the stacked norm scales; each layer's matrices on AdamW) or
`redeqx.muon_dimensions` (each layer's attention and MLP matrices). "before": redeqx at
{source_named(args.before)}. Muon's momentum of a stacked matrix is split over `data` on its layer axis
where the layer count divides by `data`, also under fsdp, where it now moves `data` from the matrix dim
fsdp split to the layer axis (before, under fsdp, it mirrored its weight's spec).

{chr(10).join(rows)}
""")


if __name__ == "__main__" and not serve(globals()):
    main()
