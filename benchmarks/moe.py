"""Mixture of experts: FLOPs, bytes and TPU v4 plans (issue 31).

    python -m benchmarks.moe              # the CPU part (8 simulated devices): FLOPs and bytes ratios
    python -m benchmarks.moe --tpu        # + Mixtral-8x7B and Qwen3-30B-A3B planned for TPU v4 (libtpu)
    python -m benchmarks.moe --cached     # the section from the cached probes

Probes run in subprocesses, cached in benchmarks/results/moe_<part>.json;
the section is rewritten from whatever is cached.

- FLOPs: a small Mixtral's train step (8 experts, top-2) against the dense
  LLaMA with the same active parameters and against a hand-written one-hot
  MoE, planned on one device by XLA:CPU (grouped matmuls counted by rows)
  and by libtpu for one TPU v4 chip.
- Bytes: an expert-parallel step's collectives as an accelerator moves them
  against an all-to-all plan (2 x tokens x k x hidden each way per MoE
  layer, plus attention's Megatron bytes and the gradient sum).
- TPU v4: the fewest 32 GiB chips that fit the real model's step (fp32
  AdamW; bf16 compute + remat; fsdp, 8 model shards), and its FLOPs per
  token against 6 x active parameters.
"""

import json
import math

from benchmarks._common import (HERE, compile_devices, compiler, next_token_loss, param_count, parser, report, serve,
                                worker)

CACHE = HERE / "results"
SLICES = (8, 16, 32, 64, 128, 256)  # TPU v4 chip counts with 8 model shards
HBM = 32 * 2**30
TITLE = "Mixture of experts (benchmarks/moe.py)"
SMALL = dict(hidden=64, expert=256, experts=8, k=2, layers=2, vocab=128, seq=64, batch=8)
SMALL_MODELS = ("dense", "moe", "onehot")


# ----------------------------------------------------------------------------- worker (imports JAX)

def _models(name, s=SMALL):
    """``make_model(key)`` of a model named in the probes."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from redeqx import models
    from redeqx.models._layers import ACTIVATIONS
    from redeqx.models._moe import MoE, route, router_stats

    class OneHotMoE(MoE):  # what users write by hand: every token through every expert, weighted by a one-hot
        def __call__(self, x, *, valid=None):
            logits = x.astype(jnp.float32) @ self.gate.weight.T.astype(jnp.float32)
            weights, index = route(logits, self.k, normalize=self.normalize_top_k)
            combine = jnp.einsum("tk,tke->te", weights, jax.nn.one_hot(index, self.n_experts)).astype(x.dtype)
            g, u, d = self.experts.stacks()
            h = ACTIVATIONS[self.activation](jnp.einsum("th,eih->tei", x, g)) * jnp.einsum("th,eih->tei", x, u)
            return jnp.einsum("tei,ehi,te->th", h, d, combine), router_stats(logits, index, valid)

    common = dict(vocab_size=s["vocab"], hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                  num_attention_heads=4, num_key_value_heads=4, scan_layers=False)
    moe_cfg = dict(intermediate_size=s["expert"], num_local_experts=s["experts"], num_experts_per_tok=s["k"])
    if name == "dense":
        return lambda key: models.LlamaForCausalLM(models.LlamaConfig(intermediate_size=s["k"] * s["expert"],
                                                                      **common), key=key)
    if name in ("moe", "onehot"):
        def make(key):
            m = models.MixtralForCausalLM(models.MixtralConfig(**moe_cfg, **common), key=key)
            for i in range(s["layers"] if name == "onehot" else 0):
                m = eqx.tree_at(lambda m: m.model.layers[i].block_sparse_moe, m,
                                OneHotMoE(s["hidden"], s["expert"], s["experts"], s["k"], key=jax.random.key(i)))
            return m
        return make
    if name == "Mixtral-8x7B":
        return lambda key: models.MixtralForCausalLM(models.MixtralConfig(), key=key)
    if name == "Qwen3-30B-A3B":
        return lambda key: models.Qwen3MoeForCausalLM(models.Qwen3MoeConfig(), key=key)
    raise ValueError(name)


def _active(abstract):
    """Parameters a token passes through: all but the experts not chosen (k of E) and the embedding table."""
    import jax

    total = experts = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(abstract):
        n = math.prod(leaf.shape)
        key = jax.tree_util.keystr(path)
        total += n
        experts += n if ".experts." in key else 0
        total -= n if "embed_tokens" in key else 0
    cfg = abstract.config
    e = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    return total - experts + experts * cfg.num_experts_per_tok // e


def _mesh(chips, tpu, n_model=1):
    import redeqx

    return redeqx.make_mesh(n_model, devices=compile_devices(chips, tpu))


def flops_probe(model, tpu=False, ragged=False):
    """The small models' train step FLOPs on one device (``ragged``: XLA's ragged_dot on a TPU, not megablox's)."""
    import jax
    import jax.numpy as jnp
    import optax

    import redeqx
    from redeqx.models import _grouped

    if ragged:  # ragged_dot's fallback (as when a mesh axis splits the operands) instead of megablox's kernels
        _grouped._whole = lambda: False

    batch = {"ids": jax.ShapeDtypeStruct((SMALL["batch"], SMALL["seq"] + 1), jnp.int32)}
    p = redeqx.plan(_models(model), next_token_loss, optax.adamw(1e-3), batch, _mesh(1, tpu), explore=False)
    return dict(flops=p.flops, note=p.note)


def tpu_probe(model, setting, chips, seq):
    """A real model's step planned on a TPU v4 slice of ``chips``."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    import redeqx

    from redeqx.planner import _plan
    from redeqx.planner._hlo import estimated_flops

    make, bf16, mesh = _models(model), setting == "bf16", _mesh(chips, True, 8)
    abstract = eqx.filter_eval_shape(make, jax.random.key(0))
    batch = {"ids": jax.ShapeDtypeStruct((mesh.shape["data"], seq + 1), jnp.int32)}
    texts, count = [], _plan._flops  # the compiled program, for its kernels' own cost estimates
    _plan._flops = lambda compiled: texts.append(compiled.as_text()) or count(compiled)
    p = redeqx.plan(make, next_token_loss, optax.adamw(1e-5), batch, mesh, fsdp=True, remat=bf16,
                    compute_dtype=jnp.bfloat16 if bf16 else None, device_memory=HBM, explore=False)
    params = param_count(abstract)
    return dict(fits=bool(p.fits), peak=p.peak, flops=p.flops, params=params, active=_active(abstract),
                tokens=mesh.shape["data"] * seq, chips=chips, refused=p.refused,
                kernels=estimated_flops(texts[-1], ("custom-call",)) if texts else 0.0, n_model=mesh.shape["model"])


def bytes_probe(n_model):
    """Bytes moved / the all-to-all plan's, for the test model of tests/test_moe_sharding.py."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import redeqx
    from accelerator_count import accelerator_collectives
    from test_moe_sharding import BATCH, _model, loss_fn

    model, mesh = _model(8), redeqx.make_mesh(n_model)
    specs = redeqx.sharding_rules(model, mesh)
    state = redeqx.init_state(model, optax.sgd(0.5), mesh, specs, key=jax.random.key(1))
    batch = jax.device_put({k: jnp.asarray(v) for k, v in BATCH.items()}, NamedSharding(mesh, P("data")))
    moved = sum(v["bytes"] for v in accelerator_collectives(
        redeqx.make_train_step(loss_fn, optax.sgd(0.5), mesh, specs), state, batch).values())
    grad = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state.model))
    b, t, h, layers, k = 16 // mesh.shape["data"], 8, 32, 2, 2
    act = b * t * h * 4
    attention = 2 * (1 + layers) * act + 3 * b * t * 4
    all_to_all = layers * 2 * (2 * b * t * k * h * 4)
    return dict(moved=moved, analytic=attention + all_to_all + grad, mesh=dict(mesh.shape))


# ----------------------------------------------------------------------------- driver (no JAX)

def _probe(fn, on_tpu=False, **kwargs):
    python, env = compiler(on_tpu)
    return worker(__file__, fn, python=python, env=env, **kwargs)


def cpu_part():
    return dict(flops={m: _probe("flops_probe", model=m) for m in SMALL_MODELS},
                bytes={n: _probe("bytes_probe", n_model=n) for n in (2, 4, 8)})


def tpu_part(seq):
    out = dict(flops={m: _probe("flops_probe", True, model=m, tpu=True) for m in SMALL_MODELS},
               ragged=_probe("flops_probe", True, model="moe", tpu=True, ragged=True))
    for model in ("Mixtral-8x7B", "Qwen3-30B-A3B"):
        for setting in ("fp32", "bf16"):
            for chips in SLICES:
                out[f"{model} {setting}"] = r = _probe("tpu_probe", True, model=model, setting=setting, chips=chips,
                                                       seq=seq)
                if r["fits"]:
                    break
    return out


def _section(cpu, tpu):
    lines = []
    if cpu or tpu:
        lines += [f"Train step FLOPs of a small Mixtral ({SMALL['experts']} experts of width {SMALL['expert']}, top-"
                  f"{SMALL['k']}, hidden {SMALL['hidden']}, {SMALL['layers']} layers, {SMALL['batch']} x "
                  f"{SMALL['seq']} tokens) against the dense LLaMA with the same active parameters (intermediate "
                  f"{SMALL['k'] * SMALL['expert']}) and against the same MoE by a hand-written one-hot dispatch, "
                  "one device, fp32 AdamW:", "",
                  "| compiler | dense LLaMA | MoE, grouped matmuls (ratio) | MoE, one-hot einsum (ratio) |",
                  "|---|---|---|---|"]
        for label, part in (("XLA:CPU, grouped matmuls by rows (`plan`)", cpu and cpu["flops"]),
                            ("libtpu, TPU v4, megablox's kernels (its own figure)", tpu and tpu["flops"]),
                            ("libtpu, TPU v4, XLA's `ragged_dot` (its own figure)",
                             tpu and "ragged" in tpu and {**tpu["flops"], "moe": tpu["ragged"]})):
            if part:
                f = {m: part[m]["flops"] for m in ("dense", "moe", "onehot")}
                lines.append(f"| {label} | {f['dense']:.3e} | {f['moe']:.3e} ({f['moe'] / f['dense']:.2f}x) | "
                             f"{f['onehot']:.3e} ({f['onehot'] / f['dense']:.2f}x) |")
        lines.append("")
    if cpu:
        lines += ["Collective bytes per device of an expert-parallel train step (tests/test_moe_sharding.py's "
                  "Mixtral: 8 experts, top-2, hidden 32, 2 layers, 16 x 8 tokens), as a GPU or TPU moves them, "
                  "against the all-to-all plan (2 x tokens x k x hidden floats per MoE layer each way + the "
                  "attention's Megatron bytes + the data-parallel gradient sum):", "",
                  "| mesh | moved | all-to-all plan | ratio |", "|---|---|---|---|"]
        for n, r in cpu["bytes"].items():
            lines.append(f"| data {r['mesh']['data']} x model {n} | {r['moved']} | {r['analytic']} | "
                         f"{r['moved'] / r['analytic']:.2f} |")
        lines.append("")
    rows = [(k, v) for k, v in (tpu or {}).items() if k not in ("flops", "ragged")]
    if rows:
        lines += ["The real models on TPU v4 (32 GiB a chip), planned ahead of time by libtpu: 8 model shards, fsdp, "
                  "one 2048-token sequence per data shard; the fewest chips whose step fits, and the plan's FLOPs "
                  "per token against 6 x active parameters (embedding excluded, attention's own FLOPs not in it):",
                  "", "| model, setting | params | active | fewest chips | peak/chip | FLOPs/token | 6 x active | ratio "
                  "| kernels by own rows: FLOPs/token, ratio |", "|---|---|---|---|---|---|---|---|---|"]
        for key, r in rows:
            per_token = r["flops"] * r["chips"] / r["tokens"]
            # each device's kernels are costed over every row it holds, its own experts' 1/n_model of them
            own = (r["flops"] - r.get("kernels", 0.0) * (1 - 1 / r.get("n_model", 1))) * r["chips"] / r["tokens"]
            chips = r["chips"] if r["fits"] else f"> {r['chips']}"
            lines.append(f"| {key.replace('fp32', 'fp32 AdamW').replace('bf16', 'bf16 + remat')} | "
                         f"{r['params'] / 1e9:.1f} B | {r['active'] / 1e9:.2f} B | {chips} | {r['peak'] / 2**30:.1f} GiB | "
                         f"{per_token:.3e} | {6 * r['active']:.3e} | {per_token / (6 * r['active']):.2f} | "
                         f"{own:.3e}, {own / (6 * r['active']):.2f} |")
        lines += ["", "libtpu's FLOP count is static. megablox's kernels (what redeqx runs on a TPU) count as their "
                  "cost estimate says, 2 x rows x in x out over every row the operand holds, the weight gradient "
                  "(`tgmm`) too; XLA's `ragged_dot` (redeqx's fallback where a mesh axis would split the operands) "
                  "counts its weight gradient over every expert the device holds. The kernels' count of the small "
                  "MoE is above the count by rows by the backward pass's recompute of the experts' forward, which "
                  "XLA merged with the forward's `ragged_dot` in this step but not with the kernels' custom calls. Under 8 model "
                  "shards each device's grouped matmuls hold all of its data shard's tokens x k assignments, only "
                  "its own experts' groups filled: `gmm` and `tgmm` visit only those groups' row tiles, the count "
                  "covers every row. So the ratios to 6 x active parameters bound from above what the chips "
                  "compute; the last column counts each device's kernels at its own experts' share of the rows "
                  "(1 / model shards of them, routing balanced). A TPU run would measure it."]
    return "\n".join(lines)


def main():
    if serve(globals()):
        return
    p = parser(__doc__)
    p.add_argument("--tpu", action="store_true", help="also plan for TPU v4 with libtpu (benchmarks/.venv-tpu)")
    p.add_argument("--cached", action="store_true", help="rewrite the section from the cached results")
    p.add_argument("--only-tpu", action="store_true", help="run the TPU part only (the CPU part from its cache)")
    p.add_argument("--seq", type=int, default=2048)
    args = p.parse_args()
    parts = {"cpu": (cpu_part, not (args.cached or args.only_tpu)),
             "tpu": (lambda: tpu_part(args.seq), not args.cached and (args.tpu or args.only_tpu))}
    for name, (run, due) in parts.items():
        if due:
            (CACHE / f"moe_{name}.json").write_text(json.dumps(run(), indent=1))
    load = [json.loads(f.read_text()) if f.exists() else None for f in (CACHE / "moe_cpu.json", CACHE / "moe_tpu.json")]
    report(args, TITLE, _section(*load))


if __name__ == "__main__":
    main()
