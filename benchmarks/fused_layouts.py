"""A projection cut by index (vit-pytorch's ``to_qkv(x).chunk(3)``, a GLU's ``chunk(2)``) against the same
model with its pieces an inner dim, the layout the rules split Megatron's way and the warnings advise.

    python -m benchmarks.fused_layouts            # writes its RESULTS.md section
    python -m benchmarks.fused_layouts --tpu      # the same, compiled by libtpu for 8 TPU v4 chips
    python -m benchmarks.fused_layouts --no-write

For each model, one SGD step per device with the specs ``sharding_rules(model, mesh, loss_fn=...,
batch=...)`` reads from the program, in each layout (`plans_vs_hand.figures`: collective bytes as an
accelerator moves them, the compiled program's FLOPs and peak bytes), at 2 and 4 model shards of 8
devices, nothing run; beside them, what the warnings said of the cut layout. The layouts compute the
same function (weights in another order), so the cut layout's figures over the interleaved one's are
what writing it so costs.
"""

from benchmarks._common import compiler, parser, report, serve, worker


def cases():
    """``(name, model in each layout: {layout: model}, loss, batch)``."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    import test_rules_fused_qkv as fused
    import written_otherwise as w

    images = {"x": np.zeros((32, 3, 224, 224), np.float32), "y": np.zeros((32,), np.int32)}
    yield ("vit-pytorch ViT-B (768 wide, 12 heads, 2 layers), 32 images of 224 x 224 in 16 x 16 patches",
           {layout: w.VitPytorch(224, 16, 768, 2, 12, layout, 1000, key=jax.random.key(0))
            for layout in ("chunk", "interleaved")}, w.image_loss, images)
    k1, k2 = jax.random.split(jax.random.key(0))

    def glu_loss(model, batch, key):
        return jnp.mean(jax.vmap(model)(batch["x"]) ** 2)

    yield ("a GLU's value and gate from one projection (1024 -> 2 x 4096 -> 1024), 16 x 64 tokens",
           {name: fused.GatedMLP(eqx.nn.Linear(1024, 8192, use_bias=False, key=k1),
                                 eqx.nn.Linear(4096, 1024, use_bias=False, key=k2), interleaved)
            for name, interleaved in (("chunk", False), ("interleaved", True))},
           glu_loss, {"x": np.zeros((16, 64, 1024), np.float32)})
    import test_rules_alone as alone

    yield ("DiT at DiT-XL's width (1152, 2 blocks, 16 patches of 8 images): its fused QKV cut by timm's reshape, "
           "beside an MLP the rules split", {layout: alone.DiT(1152, key=jax.random.key(0), interleaved=interleaved)
                                             for layout, interleaved in (("chunk", False), ("interleaved", True))},
           alone.noise_loss, alone.noisy_patches(abstract=False))


def measure(tpu: bool) -> dict:
    """``{"name|shards": {layout: figures, "warned": text}}``."""
    import warnings

    import equinox as eqx
    import jax

    import redeqx
    from benchmarks._common import compile_devices
    from benchmarks.plans_vs_hand import figures

    jax.config.update("jax_numpy_rank_promotion", "raise")
    devices, out = compile_devices(8, tpu), {}
    for name, models, loss, batch in cases():
        for n in (2, 4):
            row = {layout: figures(model, loss, batch, n, devices, loss_fn=loss, batch=batch)
                   for layout, model in models.items()}
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                redeqx.sharding_rules(eqx.filter_eval_shape(lambda: models["chunk"]),
                                      redeqx.make_mesh(n, devices=devices), loss_fn=loss, batch=batch)
            said = [str(c.message) for c in caught]
            row["warned"] = "yes, with the layout that splits" if any("inner dim" in s for s in said) else (
                "yes" if said else "no")
            out[f"{name}|{n}"] = row
            print(name, n, row, flush=True)
    return out


def main():
    p = parser(__doc__)
    p.add_argument("--tpu", action="store_true", help="compile with libtpu for 8 TPU v4 chips (none attached)")
    args = p.parse_args()
    python, env = compiler(args.tpu)
    found = worker(__file__, "measure", python=python, env=env, tpu=args.tpu)
    rows = ["| model | shards | chunk (B) | interleaved (B) | chunk / interleaved: bytes | FLOPs | peak "
            "| warned |", "|---|---|---|---|---|---|---|---|"]
    for k, row in found.items():
        name, n = k.split("|")
        cut, split = row["chunk"], row["interleaved"]
        rows.append(f"| {name} | {n} | {cut['bytes']:,} | {split['bytes']:,} | {cut['bytes'] / split['bytes']:.2f} | "
                    f"{cut['flops'] / split['flops']:.2f} | {cut['peak'] / split['peak']:.2f} | {row['warned']} |")
    where = ("libtpu's compiled step for 8 TPU v4 chips (none attached: benchmarks/.venv-tpu), its own collectives"
             if args.tpu else "8 simulated CPU devices, the bytes as an accelerator's XLA moves them "
             "(`tests/accelerator_count.py`)")
    report(args, "Projections cut by index against their interleaved layout (benchmarks/fused_layouts.py"
           + (" --tpu)" if args.tpu else ")"), f"""
One SGD step per device on {where}, at `make_mesh(shards)` (data x model), with the specs the rules read
from each layout's program: cut by `chunk` (kept whole with the projection after it: no spec gives a device
matching parts of every piece) and interleaved (the pieces an inner dim: split Megatron's way). "warned":
whether `sharding_rules` warned about the cut layout, naming the layout that splits.

{chr(10).join(rows)}
""")


if __name__ == "__main__" and not serve(globals()):
    main()
