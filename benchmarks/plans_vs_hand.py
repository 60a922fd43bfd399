"""Models whose program the rules once read worse than a hand plan, against that hand plan.

    python -m benchmarks.plans_vs_hand            # writes its RESULTS.md section
    python -m benchmarks.plans_vs_hand --tpu      # the same, compiled by libtpu for 8 TPU v4 chips
    python -m benchmarks.plans_vs_hand --no-write

For each model (the tests' own), one SGD training step per device with the specs of
``sharding_rules(model, mesh, loss_fn=..., batch=...)`` (program) and of a hand plan (the names'
specs with the layers placed by ``overrides=``: experts split, or each expert's hidden units,
Megatron's column and row), at 2 and 4 model shards of 8 devices: its collective bytes as an
accelerator moves them (on 8 simulated CPU devices, tests/accelerator_count.py; with ``--tpu``,
libtpu's compiled program, benchmarks/.venv-tpu, no TPU attached), and the compiled program's FLOPs
and peak memory. ``--before PATH`` also reads the program with the redeqx source at PATH (a
checkout's ``src``), in a worker, for the "before" columns.
"""

import os

from benchmarks._common import compiler, parser, report, serve, source_named, worker

def cases():
    """``(name, model, loss, batch, hand overrides per n_model_shards[, model state])``."""
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P
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
    conv_megatron = [(r"conv1\.weight", P("model", None, None, None)), (r"conv1\.bias", P("model", None, None)),
                     (r"blocks\.\d+\.norm\.", P("model")), (r"conv2\.weight", P(None, "model", None, None)),
                     (r"stem|head|norm_out|conv2\.bias", P())]
    yield ("residual conv net, 128 channels, GroupNorm(16, 256) in its blocks, GroupNorm on its stream",
           convs.GroupNormNet(256, 16, 128, key=key), convs.loss_fn, images, lambda n: conv_megatron)
    photos = {"x": np.random.default_rng(0).normal(size=(32, 4, 32, 32)).astype(np.float32),
              "y": np.zeros((32,), np.int32)}
    yield ("the same net, GroupNorm(32, 256), over 32 x 32 pixels", convs.GroupNormNet(256, 32, 128, key=key),
           convs.loss_fn, photos, lambda n: conv_megatron)
    yield ("MobileNetV2 without norms, 10 inverted residual blocks of 16 (96) channels, 16 x 16 pixels",
           choice.MobileNet(10, key), choice.loss_fn,
           {"x": np.random.default_rng(0).normal(size=(16, 3, 16, 16)).astype(np.float32),
            "y": np.zeros((16,), np.int32)},
           lambda n: [(r"expand\.weight|dw\.weight", P("model", None, None, None)),
                      (r"project\.weight", P(None, "model", None, None))])
    yield ("EfficientNet-style MBConv blocks with squeeze-excite, 4 of 64 (256) channels, 16 x 16 pixels",
           choice.EfficientNetStack(key), choice.loss_fn,
           {"x": np.random.default_rng(0).normal(size=(16, 3, 16, 16)).astype(np.float32),
            "y": np.zeros((16,), np.int32)},
           lambda n: [(r"expand\.weight|dw\.weight|se2\.weight", P("model", None, None, None)),
                      (r"expand\.bias|dw\.bias|se2\.bias", P("model", None, None)),
                      (r"proj\.weight|se1\.weight", P(None, "model", None, None)), (r"stem|head|\.bias", P())])
    import test_rules_alone as alone
    yield ("DiT at DiT-XL's width (1152, 2 blocks, 16 patches of 8 images): Megatron's pairs, each adaLN modulation row-parallel alone, the rest whole",
           alone.DiT(1152, key=key), alone.noise_loss, alone.noisy_patches(abstract=False),
           lambda n: [(r"time1\.weight|fc1\.weight", P("model", None)), (r"time1\.bias|fc1\.bias", P("model")),
                      (r"time2\.weight|fc2\.weight|modulation\.weight", P(None, "model")),
                      (r"stem|head|qkv|proj|classes", P())])
    yield ("Swin window attention laid out per head (256 wide, 8 heads, 64 windows of 16 tokens), a relative "
           "position bias looked up by a NumPy index array", prog.WindowAttention(256, 8, 16, key=key),
           prog.window_loss, {"x": np.zeros((64, 16, 256), np.float32), "y": np.zeros((64, 16, 256), np.float32)},
           lambda n: [(r"qkv\.weight", P("model", None)), (r"qkv\.bias", P("model")),
                      (r"proj\.weight", P(None, "model")), (r"table", P(None, "model"))])
    yield ("GCN with gather and segment_sum (8 -> 512 x 3, 16 graphs of 64 nodes and 256 edges)",
           w.GCN(8, 512, 3, key=key), w.graph_regression_loss, w.graphs(16, 64, 256),
           lambda n: [(r"layers\.[02]\.lin\.weight", P("model", None)), (r"layers\.[02]\.lin\.bias", P("model")),
                      (r"layers\.1\.lin\.weight|readout\.weight", P(None, "model"))])
    yield ("Equinox LM: vmapped lookup, fused (D, 2, F) gate-up", prog.FusedGateUpLM(key), w.gpt_loss, prog.TOKENS,
           lambda n: [(r"w12", P(None, None, "model")), (r"w3", P("model", None))])
    import test_rules_reparametrised as rep
    sound = {"x": np.random.default_rng(0).normal(size=(16, 1, 256)).astype(np.float32),
             "y": np.random.default_rng(1).normal(size=(16, 1, 256)).astype(np.float32)}
    yield ("vocoder units of weight-normalised Conv1d (64 -> 256 -> 64), 16 clips of 256 samples",
           rep.Vocoder(key, 64), rep.mse, sound,
           lambda n: [(r"units\.\d+\.wide\.(layer\.weight|layer\.bias|g)", P("model")),
                      (r"units\.\d+\.back\.layer\.weight", P(None, "model")), (r".", P())])
    yield ("cosine-softmax head over 4,096 classes (an MLP 8 -> 512 -> 256, normalised class vectors)",
           rep.CosineClassifier(key, 4096, 256), rep.xent,
           {"x": np.zeros((32, 8), np.float32), "y": np.zeros((32,), np.int32)},
           lambda n: [(r"body\.layers\.0\.", P("model")), (r"body\.layers\.1\.weight", P(None, "model")),
                      (r"classes", P("model")), (r".", P())])
    yield ("nGPT: every matrix normalised at use (128 wide, 4 heads, 512 hidden, 2 blocks, 512 vocabulary), "
           "16 x 32 tokens", rep.NormalizedGPT(key, 512, 128, 4, 512), rep.next_token,
           {"ids": np.zeros((16, 33), np.int32)},
           lambda n: [(r"w[qkvug]$|s_qk|s_[uv]$|^embed$|^unembed$|s_z", P("model")), (r"w[od]$", P(None, "model")),
                      (r".", P())])
    disc, disc_state = eqx.nn.make_with_state(rep.Discriminator)(key, 64)
    yield ("GAN discriminator, spectral-normalised Conv2d (3 -> 64 -> 256 -> 64), 16 images of 16 x 16",
           disc, rep.gan_loss, {"x": np.zeros((16, 3, 16, 16), np.float32), "real": np.zeros((16,), np.float32)},
           lambda n: [(r"wide\.layer\.(weight|bias)", P("model")), (r"back\.layer\.weight", P(None, "model")),
                      (r".", P())],
           disc_state)
    import test_rules_ops as two
    yield ("tied autoencoder, raw arrays (x @ W, h @ W.T; 512 -> 2048), 64 vectors", two.TiedAE(key, 512, 2048),
           two.mse, {"x": np.zeros((64, 512), np.float32)},
           lambda n: [(r"^w$", P(None, "model")), (r"^b$", P("model"))])
    yield ("tied conv autoencoder (Conv 64 -> 256, then conv_transpose of the same kernel), 16 images of 8 x 8",
           two.TiedConvAE(key), two.mse, {"x": np.zeros((16, 64, 8, 8), np.float32)},
           lambda n: [(r"^k$", P("model", None, None, None))])
    yield ("causal depthwise conv with jnp.convolve between projections (128 -> 512 -> 128), 16 x 16 tokens",
           two.ConvolveMixer(key), two.lm_loss, {"t": np.zeros((16, 17), np.int32)},
           lambda n: [(r"inp\.|filt", P("model")), (r"out\.weight", P(None, "model")), (r"emb|head|out\.bias", P())])
    yield ("VGG-style convs with eqx.nn.MaxPool2d between (3 -> 64 -> 256, pool, -> 64), 16 images of 16 x 16",
           convs.PooledConvs(eqx.nn.MaxPool2d(2, 2), key=key), convs.loss_fn,
           {"x": np.zeros((16, 3, 16, 16), np.float32), "y": np.zeros((16,), np.int32)},
           lambda n: [(r"c2\.", P("model")), (r"c3\.weight", P(None, "model")), (r"c1|c3\.bias|head", P())])
    rows = {"x": np.zeros((8, 16, 64), np.float32)}
    pair = lambda n: [(r"up\.", P("model")), (r"down\.weight", P(None, "model")), (r"down\.bias", P())]  # noqa: E731
    yield ("a row written whole with lax.dynamic_update_slice between a pair (64 -> 256 -> 64), 8 x 16 rows",
           two.Between(lambda h: jax.lax.dynamic_update_slice(h, 2 * h[:1], (0, 0)), key), two.mse, rows, pair)
    yield ("a long convolution over time by FFT between a pair (64 -> 256 -> 64), 8 x 16 rows; hand: split",
           two.Between(two._fft_conv, key), two.mse, rows, pair)
    yield ("one-hot embedding tied to the head (one_hot(t) @ emb, x @ emb.T; 1,024 x 256, MLP 1,024), 16 x 32 tokens",
           two.OneHotTiedLM(key), two.lm_loss, {"t": np.zeros((16, 33), np.int32)},
           lambda n: [(r"^emb$|up\.", P("model")), (r"down\.weight", P(None, "model")), (r"down\.bias", P())])
    yield from _inner_gradients(key, P)


def _inner_gradients(key, P):
    """Models differentiated inside their loss (tests/test_rules_inner_grads.py) and one whose weights
    are sampled at every step (tests/test_rules_reparametrised.py), at wider widths."""
    import numpy as np

    import test_rules_inner_grads as inner

    rng = np.random.default_rng(0)
    megatron = lambda fc1, fc2: [(fc1 + r"\.weight", P("model", None)), (fc1 + r"\.bias", P("model")),  # noqa: E731
                                 (fc2 + r"\.weight", P(None, "model")), (r".", P())]
    yield ("WGAN-GP critic (64 -> 1024 -> 64 -> 1), its gradient penalty's jax.grad in the loss, 64 vectors",
           inner.Critic(key, 64, 1024), inner.gradient_penalty, {"x": rng.normal(size=(64, 64)).astype(np.float32)},
           lambda n: megatron("fc1", "fc2"))
    yield ("physics-informed net (2 -> 512 x 3 -> 1, tanh) on Burgers' residual (second derivative), 256 points",
           inner.PINN(key, (2, 512, 512, 512, 1)), inner.burgers,
           {"x": rng.uniform(-1, 1, 256).astype(np.float32), "t": rng.uniform(0, 1, 256).astype(np.float32)},
           lambda n: megatron(r"layers\.1", r"layers\.2"))
    yield ("GAN discriminator with the R1 penalty (Conv 3 -> 64 -> 256 -> 64, residual), 16 images of 16 x 16",
           inner.ConvCritic(key), inner.r1, {"x": rng.normal(size=(16, 3, 16, 16)).astype(np.float32)},
           lambda n: [(r"c2\.weight", P("model", None, None, None)), (r"c2\.bias", P("model", None, None)),
                      (r"c3\.weight", P(None, "model", None, None)), (r".", P())])
    yield ("energy whose gradient gives forces (128 wide, 4 stacked layers of 1024 under a scan), 32 molecules of "
           "12 atoms",
           inner.Energy(key, 128, 1024, 4), inner.forces,
           {"pos": rng.normal(size=(32, 12, 3)).astype(np.float32) * 2, "e": np.zeros(32, np.float32),
            "f": np.zeros((32, 12, 3), np.float32)},
           lambda n: [(r"fc1\.weight", P(None, "model", None)), (r"fc1\.bias", P(None, "model")),
                      (r"fc2\.weight", P(None, None, "model")), (r".", P())])
    yield ("MAML on sinusoids (examples/meta_learning's loss, a 1 -> 1024 -> 1024 -> 1 MLP, one inner step), "
           "32 tasks of 10 + 10 points", inner.sine_mlp(key, 1024), inner.maml,
           {k: rng.normal(size=(32, 10, 1)).astype(np.float32) for k in ("xs", "ys", "xq", "yq")},
           lambda n: megatron(r"layers\.0", r"layers\.1"))
    yield ("MAML on sinusoids through residual blocks stacked under a scan (1 -> 64, 3 blocks of 64 -> 512), 16 tasks "
           "of 10 + 10 points", inner.StackedMLP(key, 3, 64, 512), inner.maml,
           {k: rng.normal(size=(16, 10, 1)).astype(np.float32) for k in ("xs", "ys", "xq", "yq")},
           lambda n: [(r"blocks\.fc1\.weight", P(None, "model", None)), (r"blocks\.fc1\.bias", P(None, "model")),
                      (r"blocks\.fc2\.weight", P(None, None, "model")), (r".", P())])
    heads = [(r"qkv\.\d\.weight", P("model", None)), (r"out\.weight", P(None, "model")), (r"W0", P("model")), (r".", P())]
    sequences = {"x": rng.normal(size=(16, 32, 256)).astype(np.float32), "y": rng.integers(0, 8, (16, 32))}
    yield ("test-time-training layer (TTT-Linear: a gradient step on per-head fast weights from a learned W0 each "
           "token; 256 wide, 8 heads of 32), 16 sequences of 32", inner.FastWeights(key, "ttt", 256, 8, 32),
           inner.token_classes, sequences, lambda n: heads)
    yield ("linear attention with a learned initial state (256 wide, 8 heads of 32), 16 sequences of 32",
           inner.FastWeights(key, "linear", 256, 8, 32), inner.token_classes, sequences, lambda n: heads)
    import test_rules_topk as topk
    yield ("TopK sparse autoencoder (128 -> 2048 latents, top 32, written back with zeros.at[rows, idx].set), 256 "
           "rows", topk.SAE(key, 128, 2048), topk.reconstruction(topk.WRITES["rows"], 32),
           {"x": rng.normal(size=(256, 128)).astype(np.float32)}, lambda n: topk.HAND)
    import test_rules_reparametrised as rep
    yield ("Bayes by backprop (mu + softplus(rho) * eps; 64 -> 1024 -> 10), 64 vectors",
           rep.BayesMLP(key, 64, 1024, 10), rep.elbo,
           {"x": rng.normal(size=(64, 64)).astype(np.float32), "y": np.arange(64) % 10},
           lambda n: [(r"fc1\.(mu|rho)", P("model", None)), (r"fc1\.b", P("model")),
                      (r"fc2\.(mu|rho)", P(None, "model")), (r".", P())])


def figures(model, loss, data, n: int, devices, state=None, optimizer=None, **rules) -> dict:
    """One SGD step of ``model`` under ``sharding_rules(model, make_mesh(n, devices=devices),
    **rules)``, compiled once (abstract: nothing runs): the collective bytes per device as an
    accelerator moves them (libtpu's own program; on CPU devices, the partitioned program's sums
    merged as the accelerators' compilers merge them), the compiled program's FLOPs and its peak
    bytes per device (arguments + outputs - aliased + temporaries). ``state``: the model's state, for a
    model that has one (spectral normalisation's power iteration). ``optimizer``: instead of SGD."""
    import warnings

    import equinox as eqx
    import jax
    import optax
    from accelerator_count import compiled_and_partitioned_text, reassociated_collectives

    import redeqx
    from redeqx.planner._hlo import collectives, summarise
    from redeqx.planner._plan import _abstract_batch

    mesh = redeqx.make_mesh(n, devices=devices)
    abstract = eqx.filter_eval_shape(lambda: model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        specs = redeqx.sharding_rules(abstract, mesh, **rules)
    optimizer = optax.sgd(0.1) if optimizer is None else optimizer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # optax's default Muon rule on a stack warns (benchmarks/muon.py)
        state = redeqx.init_state(abstract, optimizer, mesh, specs, key=jax.random.key(1), model_state=state)
    step = redeqx.make_train_step(loss, optimizer, mesh, specs)
    with jax.set_mesh(mesh):
        lowered = step.trace(state, _abstract_batch(data, mesh)).lower()
    if devices[0].platform == "tpu":
        compiled = lowered.compile()
        found = collectives(compiled.as_text())
    else:
        compiled, text = compiled_and_partitioned_text(lowered)
        found = reassociated_collectives(text)
    m, cost = compiled.memory_analysis(), compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    # (XLA:GPU compiling for GPUs it does not have gives no cost analysis: FLOPs None)
    return dict(bytes=sum(v["bytes"] for v in summarise(found).values()), flops=float(cost["flops"]) if cost else None,
                peak=m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
                + m.temp_size_in_bytes)


def measure(only_program: bool, tpu: bool) -> dict:
    """``{"name|shards": (program's figures, hand plan's or None)}`` of every case (`figures`)."""
    import jax

    from benchmarks._common import compile_devices

    jax.config.update("jax_numpy_rank_promotion", "raise")
    devices, out = compile_devices(8, tpu), {}
    for name, model, loss, batch, hand, *state in cases():
        state = state[0] if state else None  # a model with state (spectral normalisation's u, v)
        for n in (2, 4):
            program = figures(model, loss, batch, n, devices, state, loss_fn=loss, batch=batch,
                              **({"model_state": state} if state is not None else {}))
            by_hand = None if only_program else figures(model, loss, batch, n, devices, state, overrides=hand(n))
            out[f"{name}|{n}"] = (program, by_hand)
            print(name, n, program, by_hand, flush=True)
    return out


def main():
    p = parser(__doc__)
    p.add_argument("--before", default=None, help="a redeqx src directory to read the programs with first")
    p.add_argument("--tpu", action="store_true", help="compile with libtpu for 8 TPU v4 chips (none attached)")
    args = p.parse_args()
    python, env = compiler(args.tpu)
    before = {}
    if args.before:
        old = dict(env, PYTHONPATH=os.pathsep.join([os.path.abspath(args.before), env["PYTHONPATH"]]))
        before = worker(__file__, "measure", python=python, env=old, only_program=True, tpu=args.tpu)
    now = worker(__file__, "measure", python=python, env=env, only_program=False, tpu=args.tpu)
    rows = ["| model | shards | before: program (B) | program (B) | hand (B) | program / hand: bytes | FLOPs "
            "| peak | before: program / hand, FLOPs, peak |", "|---|---|---|---|---|---|---|---|---|"]
    for k, (program, by_hand) in now.items():
        name, n = k.split("|")
        was = before.get(k, [None])[0]
        ratios = [f"{x[key] / by_hand[key]:.2f}" if x else "" for x in (program, was) for key in ("flops", "peak")]
        was_bytes = f"{was['bytes']:,}" if was else ""
        rows.append(f"| {name} | {n} | {was_bytes} | {program['bytes']:,} | {by_hand['bytes']:,} | "
                    f"{program['bytes'] / by_hand['bytes']:.3f} | {ratios[0]} | {ratios[1]} | "
                    f"{', '.join(ratios[2:])} |")
    where = ("libtpu's compiled step for 8 TPU v4 chips (none attached: benchmarks/.venv-tpu), its own collectives"
             if args.tpu else "8 simulated CPU devices, the bytes as an accelerator's XLA moves them "
             "(`tests/accelerator_count.py`)")
    title = "Plans read from the program against hand plans (benchmarks/plans_vs_hand.py" + (
        " --tpu)" if args.tpu else ")")
    report(args, title, f"""
Collective bytes of one SGD training step per device, on {where}, at `make_mesh(shards)` (data x model),
with the specs the rules read from the program and with a hand plan (the names' specs with the layers placed
by `overrides=`); beside them, the program plan's FLOPs and peak bytes per device (the compiled program's
figures) over the hand plan's. Where the program is under the hand plan in bytes, the rules kept a small head
or table whole (cheaper in bytes and FLOPs, said in `explain`). "before": the program read by redeqx at
{source_named(args.before)}. The tests' models.

{chr(10).join(rows)}
""")


if __name__ == "__main__" and not serve(globals()):
    main()
