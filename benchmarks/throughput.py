"""Training throughput and model FLOPs utilisation of a LLaMA-style model, redeqx
vs a hand-written jax.jit + optax loop, on whatever accelerator is present.

    python -m benchmarks.throughput                       # CPU: a small model, tokens/s only
    python -m benchmarks.throughput --size 1b --seq 2048 --batch 8 --no-hand --json out.json  # on a GPU
    python -m benchmarks.throughput --from-json out.json  # write a GPU run's results to RESULTS.md
    python -m benchmarks.throughput --size moe1b --seq 2048 --batch 8 --variants stacked+remat --no-hand --json moe.json

Sizes ``moe*`` are Mixtral-style (8 experts, top-2) with a dense twin of the
same active parameters (``moe1b``'s is ``1b``, TinyLlama-1.1B's shapes).
Variants, alternated in rounds: the zoo LLaMA in bf16 compute (fp32 master
weights, AdamW), stacked (":N" sets scan_unroll) or listed, with or without
remat, and the hand-written step. MFU: 6 x active non-embedding parameters x
tokens plus attention's FLOPs (causal halved) over the device's peak; on a
GPU the step must use cuDNN's flash attention (checked); the planner's peak
is compared with the measured one (first variant).
"""

import os

from benchmarks._common import alternate, next_token_loss, parser, report

if "cpu" in os.environ.get("JAX_PLATFORMS", "cpu") and not os.environ.get("REDEQX_BENCH_GPU"):
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import json  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import redeqx  # noqa: E402
from redeqx import models  # noqa: E402

SIZES = {  # LLaMA-style shapes; 1b is TinyLlama-1.1B's
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
               num_attention_heads=32, num_key_value_heads=4),
    "moe-tiny-dense": dict(vocab_size=512, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2),
}
# Mixtral-style: 8 experts of half the dense twin's width, top-2 (1b's active parameters, ~3.4B in all)
MOE_SIZES = {"moe1b": dict(SIZES["1b"], intermediate_size=2816, num_local_experts=8, num_experts_per_tok=2),
             "moe-tiny": dict(SIZES["moe-tiny-dense"], intermediate_size=256, num_local_experts=8,
                              num_experts_per_tok=2)}


def make_config(size: str, **kw):
    """The size's config: a `MixtralConfig` for the MoE sizes, else a `LlamaConfig`."""
    if size in MOE_SIZES:
        return models.MixtralConfig(**MOE_SIZES[size], **kw)
    return models.LlamaConfig(**SIZES[size], **kw)


def model_class(config):
    return models.MixtralForCausalLM if isinstance(config, models.MixtralConfig) else models.LlamaForCausalLM
PEAK_BF16 = {"H100 80GB HBM3": 989.4e12, "H100 PCIe": 756.5e12, "H200": 989.4e12, "A100": 312e12}


def device_peak() -> float | None:
    kind = jax.devices()[0].device_kind
    return next((v for k, v in PEAK_BF16.items() if k in kind), None)


def model_flops_per_token(config, seq: int) -> float:
    """6 N for the matmuls of forward + backward (N the active parameters:
    without the embedding lookup, with the LM head; of an MoE, the k experts
    a token goes through and the router), plus attention: 4 matmuls of seq x
    hidden per token per layer, x3 for backward, halved for the causal mask."""
    c = config
    heads = c.num_attention_heads
    d = getattr(c, "head_dim", None) or c.hidden_size // heads
    kv = (c.num_key_value_heads or heads) * d
    k, experts = getattr(c, "num_experts_per_tok", 1), getattr(c, "num_local_experts", 0)
    mlp = 3 * c.hidden_size * c.intermediate_size * k + c.hidden_size * experts
    per_layer = c.hidden_size * (heads * d + 2 * kv) + heads * d * c.hidden_size + mlp
    n = c.num_hidden_layers * per_layer + c.hidden_size * c.vocab_size
    attention = 12 * c.num_hidden_layers * seq * heads * d / 2
    return 6 * n + attention


def hand_written(optimizer, static):
    """The same step a user would write with jax.jit and optax."""

    def step(params, opt_state, batch):
        def loss(p):
            model = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                                 eqx.combine(p, static))
            return next_token_loss(model, batch, None)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return jax.jit(step, donate_argnums=(0, 1))


def products_apart(loss_fn):
    """``loss_fn`` with the zoo's LLaMA multiplying each projection alone (gate and up as two
    products, Q, K and V as three), as before `redeqx.models._layers.joined_linears` (the
    ``+apart`` variant: the join's A/B, side by side)."""
    import redeqx.models._llama as llama

    def apart(model, batch, key):
        both = llama.joined_linears
        llama.joined_linears = lambda x, layers, joined=True: both(x, layers, joined=False)
        try:  # traced once: the step's program keeps what this call made
            return loss_fn(model, batch, key)
        finally:
            llama.joined_linears = both

    return apart


def parse_variant(text: str) -> tuple[str, str, int | bool | None, bool, bool]:
    """``"stacked:2+remat+fp8"`` -> (the text, "stacked", 2, remat: True, fp8: True); ``+apart``
    is read off the text (`products_apart`)."""
    spec, *options = text.strip().split("+")
    layout, _, unroll = spec.partition(":")
    if layout not in ("stacked", "listed") or (unroll and (layout == "listed" or not unroll.isdigit())) or \
            not set(options) <= {"remat", "fp8", "apart"}:
        raise SystemExit(f"--variants: {text!r} is not stacked[:N] or listed, then +remat, +fp8 and/or +apart")
    return text.strip(), layout, int(unroll) if unroll else None, "remat" in options, "fp8" in options


def run(args) -> dict:
    mesh = redeqx.make_mesh(1)
    optimizer = optax.adamw(1e-4, weight_decay=0.1)
    rng = np.random.default_rng(0)
    # each variant: "stacked" or "listed", then ":N" (the stack's scan_unroll; default: the family's
    # per-platform choice), then "+remat"
    variants = [parse_variant(v) for v in args.variants.split(",")]
    configs = {spec: make_config(args.size, max_position_embeddings=max(2048, args.seq),
                                 scan_layers=layout == "stacked", scan_unroll=unroll)
               for spec, layout, unroll, _, _ in variants}  # equal configs are one config (a frozen dataclass)
    config = next(iter(configs.values()))
    batch = {"ids": rng.integers(0, config.vocab_size, (args.batch, args.seq + 1)).astype(np.int32)}
    tokens = args.batch * args.seq
    out = {"device": jax.devices()[0].device_kind, "platform": jax.devices()[0].platform, "jax": jax.__version__,
           "size": args.size, "seq": args.seq, "batch": args.batch, "tokens_per_step": tokens,
           "model_flops_per_step": model_flops_per_token(config, args.seq) * tokens, "variants": {}}

    # One state per config (the layout and the stack's unroll, which lives in the model's static
    # config), shared by its steps with and without remat (each step donates it and returns the next).
    steps, states, calls, texts, first = {}, {}, {}, {}, True
    for spec, _, _, remat, fp8 in variants:
        config = configs[spec]
        make = lambda key, c=config: model_class(c)(c, key=key)  # noqa: E731
        fn = redeqx.remat(next_token_loss) if remat else next_token_loss
        fn = products_apart(fn) if "+apart" in spec else fn
        if first and getattr(args, "plan", True):  # what the planner expects of the first step, compiled before anything is placed
            plan = redeqx.plan(make, fn, optimizer, batch, mesh, compute_dtype=jnp.bfloat16, explore=False)
        base = (jax.devices()[0].memory_stats() or {}).get("bytes_in_use", 0)
        if config not in states:
            model = redeqx.init_model(make, mesh, key=jax.random.key(0))
            out["parameters"] = int(sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))))
            out["active_parameters"] = int((model_flops_per_token(config, 0) / 6) + config.hidden_size * config.vocab_size)
            states[config] = redeqx.init_state(model, optimizer, mesh, redeqx.sharding_rules(model, mesh),
                                               key=jax.random.key(1))
            del model
        specs = redeqx.sharding_rules(states[config].model, mesh)
        name = f"redeqx bf16, {spec}"
        v = out["variants"][name] = {}
        try:  # a variant that fails to build is reported as such; the others still run (a GPU lease is short)
            steps[name] = redeqx.make_train_step(fn, optimizer, mesh, specs, compute_dtype=jnp.bfloat16, fp8=fp8)
            t = time.perf_counter()
            lowered = steps[name].lower(states[config], batch)
            compiled = lowered.compile()
            v["compile_s"] = time.perf_counter() - t  # trace + compile
            text = lowered.as_text().lower()
            v["flash_attention"] = "fmha" in text or "cudnn" in text
            v["temp_bytes"] = compiled.memory_analysis().temp_size_in_bytes
            texts[name] = compiled.as_text() if getattr(args, "profile", None) and not texts else None
            states[config], metrics = steps[name](states[config], batch)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            v["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            first = False  # the plan and the device's peak belonged to this variant
            continue
        calls[name] = config
        if config not in {calls[n] for n in list(calls)[:-1]}:  # the state's first step: the initial weights
            v["first_loss"] = float(metrics["loss"])
        if first and getattr(args, "plan", True):  # the only state alive: the device's peak is this step's
            v.update(plan_peak_bytes=plan.peak, compiled_flops_per_step=plan.flops)
        if first:
            peak_in_use = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
            if peak_in_use:
                v["measured_peak_bytes"] = peak_in_use - base
            first = False
    if args.hand:
        spec = variants[0][0]
        model = model_class(configs[spec])(configs[spec], key=jax.random.key(0))
        specs = redeqx.sharding_rules(model, mesh)
        params, static = eqx.partition(redeqx.shard(model, specs, mesh), eqx.is_inexact_array)
        del model
        hand = hand_written(optimizer, static)
        hand_state = {"params": params, "opt_state": optimizer.init(params)}
        name = f"hand-written jax.jit bf16, {spec}"
        out["variants"][name] = {}
        calls[name] = None

    def call(name):
        if calls[name] is not None:
            config = calls[name]
            states[config], metrics = steps[name](states[config], batch)
            return metrics["loss"]
        hand_state["params"], hand_state["opt_state"], loss = hand(hand_state["params"], hand_state["opt_state"], batch)
        return loss

    medians = alternate({name: lambda name=name: call(name) for name in calls}, args.rounds, args.steps, warmup=2,
                        per_step=False)
    stats = jax.devices()[0].memory_stats() or {}
    peak = device_peak()
    for name, t in medians.items():
        v = out["variants"][name]
        v.update(step_s=t, tokens_per_s=tokens / t)
        if peak:
            v["mfu"] = out["model_flops_per_step"] / t / peak
    out["device_peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
    out["device_peak_flops"] = peak
    profiled = next((n for n, t in texts.items() if t), None)
    if profiled:
        out["profile"] = profile(lambda: call(profiled), texts[profiled], args.profile, medians[profiled])
        out["profile"]["variant"] = profiled
    return out


def profile(step, hlo_text: str, log_dir: str, step_s: float, steps: int = 3) -> dict:
    """``steps`` calls of ``step`` under JAX's profiler, the device's time by
    kind (`benchmarks._profile.breakdown`) and the bytes each kind moves by
    the program's text (``static``: `static_tally`); a failure is returned, not raised."""
    import glob

    from benchmarks._profile import breakdown, static_tally

    try:
        jax.block_until_ready(step())
        with jax.profiler.trace(log_dir):
            for _ in range(steps):
                jax.block_until_ready(step())
        xplane = max(glob.glob(f"{log_dir}/**/*.xplane.pb", recursive=True), key=os.path.getmtime)
        moved = static_tally(hlo_text, 1.0)  # each kind's bytes, read off the program: its floor at a bandwidth
        return {"steps": steps, "step_ms": step_s * 1e3, **breakdown(xplane, hlo_text, steps),
                "static": {"gb": moved["gb"], "kernels": moved["kernels"], "by_source": moved["by_source"]}}
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def table(out: dict) -> str:
    family = "Mixtral-style (8 experts, top-2)" if out["size"] in MOE_SIZES else "LLaMA-style"
    active = f", {out['active_parameters'] / 1e9:.2f}B active" if "active_parameters" in out else ""
    lines = [f"{family} {out['size']} ({out['parameters'] / 1e9:.2f}B parameters{active}), batch {out['batch']} x "
             f"{out['seq']} tokens, AdamW with fp32 master weights, bf16 compute; {out['device']} ({out['platform']}), "
             f"jax {out['jax']}; medians over alternating rounds.", "",
             "| variant | step | tokens/s | MFU | flash attention | trace + compile | temporaries | first loss "
             "| planned peak |", "|---|---|---|---|---|---|---|---|---|"]
    for name, v in out["variants"].items():
        if "error" in v:
            lines.append(f"| {name} | failed: {v['error']} | | | | | | | |")
            continue
        mfu = f"{v['mfu']:.1%}" if "mfu" in v else "n/a"
        flash = {True: "yes", False: "no"}.get(v.get("flash_attention"), "n/a")
        planned = f"{v['plan_peak_bytes'] / 2**30:.1f} GiB" if "plan_peak_bytes" in v else "n/a"
        if "measured_peak_bytes" in v:
            planned += f" (measured {v['measured_peak_bytes'] / 2**30:.1f} GiB)"
        compile_s = f"{v['compile_s']:.1f} s" if "compile_s" in v else "n/a"
        temps = f"{v['temp_bytes'] / 2**30:.2f} GiB" if "temp_bytes" in v else "n/a"
        loss = f"{v['first_loss']:.5f}" if "first_loss" in v else ""
        lines.append(f"| {name} | {v['step_s'] * 1e3:.1f} ms | {v['tokens_per_s']:,.0f} | {mfu} | {flash} | {compile_s} "
                     f"| {temps} | {loss} | {planned} |")
    lines += ["", "MFU counts the model's FLOPs (6 x active parameters x tokens + attention's, causal half) against the "
                  "device's dense bf16 peak. (The compiled program's own FLOP count is no guide on a GPU: XLA counts "
                  "nothing inside cuDNN's attention and cuBLAS calls.)"]
    if out.get("device_peak_bytes_in_use"):
        lines += ["", f"Device's measured peak over the whole run (all variants' states live at once): "
                      f"{out['device_peak_bytes_in_use'] / 2**30:.1f} GiB."]
    return "\n".join(lines)


def main():
    p = parser(__doc__, seq=128, batch=4, steps=5, rounds=3)
    p.add_argument("--size", choices=sorted(SIZES) + sorted(MOE_SIZES), default="tiny")
    p.add_argument("--variants", default="stacked,stacked+remat,listed,listed+remat",
                   help="comma-separated: the zoo LLaMA's layers stacked[:scan_unroll] or listed, +remat for "
                        "redeqx.remat, +fp8 for make_train_step(..., fp8=True), +apart for each projection "
                        "as its own product (products_apart); the stack's default scan_unroll "
                        "is the family's per-platform choice")
    p.add_argument("--no-hand", dest="hand", action="store_false",
                   help="leave out the hand-written step (on the first layout)")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--from-json", nargs="+",
                   help="write RESULTS.md from runs' JSON files (e.g. made on a GPU machine), one table each")
    args = p.parse_args()
    outs = [json.loads(Path(f).read_text()) for f in args.from_json] if args.from_json else [run(args)]
    if args.json and not args.from_json:
        Path(args.json).write_text(json.dumps(outs[0], indent=2))
    report(args, "Throughput and MFU (benchmarks/throughput.py)", "\n\n".join(table(o) for o in outs))

if __name__ == "__main__":
    main()
