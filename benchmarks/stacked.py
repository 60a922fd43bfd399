"""Stacked layers (``scan_layers=True``, one layer's program in a ``lax.scan``)
against listed layers, each step compiled on abstract shapes in a fresh
process by XLA:CPU (8 simulated devices) and by libtpu for a TPU v4 slice
(ahead of time; ``python -m benchmarks.table1 --setup-tpu`` once).

    python -m benchmarks.stacked                          # every section; writes RESULTS.md
    python -m benchmarks.stacked --sections families --compilers cpu --families llama --no-write

Sections: ``compile`` (the zoo LLaMA at 4-80 layers: compile time,
temporaries), ``families`` (every zoo family at 16 layers, with and without
remat: also FLOPs and collective bytes), ``user`` (a user's own stack,
tests/stacked_gpt.py, with each ``scan_residuals`` and remat policy),
``table1`` (OPT-66B with fsdp on 64 devices) and ``depth`` (the user's stack
by depth on libtpu, a section of its own).
"""

from __future__ import annotations

import dataclasses
import time

from benchmarks._common import (FAST_COMPILE, compile_devices, compiled_figures, compiler, parser, report, serve,
                                worker)

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import redeqx  # noqa: E402
from redeqx import models  # noqa: E402

MIB, GIB = 2**20, 2**30
COMPILE_LAYERS = (4, 16, 32, 80)
DEPTHS = (4, 8, 16, 32)
FAMILIES = ("llama", "gpt2", "opt", "gptj", "t5", "bart")
COMPILERS = {"cpu": "XLA:CPU", "tpu": "libtpu"}


def _loss(model, batch, key):
    ids = batch["ids"]
    logits = jax.vmap(model)(ids[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()


def _llama(layers: int, stacked: bool, hidden=1024, intermediate=2816, heads=16):
    config = models.LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=intermediate,
                                num_hidden_layers=layers, num_attention_heads=heads, max_position_embeddings=4096,
                                scan_layers=stacked)
    return lambda k: models.LlamaForCausalLM(config, key=k)


def _family(name: str, stacked: bool, layers: int = 16):
    """A family's constructor and loss at hidden 512, ``layers`` layers (per stack)."""
    m = models
    cls, config = {
        "llama": (m.LlamaForCausalLM, m.LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1408,
                                                    num_hidden_layers=layers, num_attention_heads=8)),
        "gpt2": (m.GPT2LMHeadModel, m.GPT2Config(vocab_size=32000, n_positions=1024, n_embd=512, n_layer=layers,
                                                 n_head=8)),
        "opt": (m.OPTForCausalLM, m.OPTConfig(vocab_size=32000, hidden_size=512, num_hidden_layers=layers,
                                              ffn_dim=2048, num_attention_heads=8)),
        "gptj": (m.GPTJForCausalLM, m.GPTJConfig(vocab_size=32000, n_positions=1024, n_embd=512, n_layer=layers,
                                                 n_head=8, rotary_dim=32)),
        "t5": (m.T5ForConditionalGeneration, m.T5Config(vocab_size=32000, d_model=512, d_kv=64, d_ff=1408,
                                                        num_layers=layers, num_heads=8, feed_forward_proj="gated-gelu",
                                                        tie_word_embeddings=False)),
        "bart": (m.BartForConditionalGeneration, m.BartConfig(
            vocab_size=32000, d_model=512, encoder_layers=layers, decoder_layers=layers, encoder_attention_heads=8,
            decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048, max_position_embeddings=1024)),
    }[name]
    config = dataclasses.replace(config, scan_layers=stacked)
    shift = m.shift_right if name in ("t5", "bart") else None

    def loss(model, batch, key):
        if shift is None:
            return _loss(model, batch, key)
        ids = batch["ids"][:, :256]
        logits = jax.vmap(lambda s: model(s, shift(s, config)))(ids)
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids).mean()

    return (lambda k: cls(config, key=k)), loss


def compiled_step(platform: str, k: int, make, loss, rows: int, seq: int, key: str = "ids", **step_kw) -> dict:
    """Trace and compile the train step on abstract shapes; its figures."""
    from redeqx.planner._hlo import loop_factor

    mesh = redeqx.make_mesh(k, devices=compile_devices(8, platform == "tpu"))
    t0 = time.perf_counter()
    model = eqx.filter_eval_shape(make, jax.random.key(0))
    specs = redeqx.sharding_rules(model, mesh)
    state = redeqx.init_state(model, optax.adamw(1e-4), mesh, specs, key=jax.random.key(0))
    step = redeqx.make_train_step(loss, optax.adamw(1e-4), mesh, specs, **step_kw)
    lowered = step.lower(state, {key: jax.ShapeDtypeStruct((rows * mesh.shape["data"], seq + 1), jnp.int32)})
    t1 = time.perf_counter()
    compiled = lowered.compile()
    f = compiled_figures(compiled)
    return dict(trace_s=t1 - t0, compile_s=time.perf_counter() - t1, temp=f["temporaries"],
                flops=f["flops"] * loop_factor(lowered.as_text(dialect="hlo")),
                collectives=sum(v["bytes"] for v in redeqx.collective_summary(compiled.as_text()).values()))


def compile_worker(platform: str, layers: int, stacked: bool) -> dict:
    return compiled_step(platform, 4, _llama(layers, stacked), _loss, rows=1, seq=512)


def family_worker(platform: str, name: str, stacked: bool, remat: bool) -> dict:
    make, loss = _family(name, stacked)
    return compiled_step(platform, 4, make, redeqx.remat(loss) if remat else loss, rows=4, seq=512)


def user_worker(platform: str, k: int, stacked: bool, remat: str, layers: int = 8) -> dict:
    from stacked_gpt import GPT, loss_fn, unstacked

    def make(key):
        model = GPT(vocab=8192, seq=256, width=256, layers=layers, heads=4, key=key)
        return model if stacked else unstacked(model)

    loss = loss_fn if remat in ("no", "all") else redeqx.remat(loss_fn, keep=remat)
    return compiled_step(platform, k, make, loss, rows=16, seq=256, key="tokens",
                         scan_residuals="all" if remat == "all" else "products")


def table1_worker(platform: str) -> dict:
    config = models.OPTConfig(hidden_size=9216, num_hidden_layers=64, ffn_dim=36864, num_attention_heads=72,
                              vocab_size=50272, max_position_embeddings=2048, scan_layers=True)
    mesh = redeqx.make_mesh(8, devices=compile_devices(64, platform == "tpu"))
    out = {}
    for label, kw in (("fsdp=True", dict(fsdp=True)),
                      ("fsdp + remat + bf16", dict(fsdp=True, remat=True, compute_dtype=jnp.bfloat16))):
        t0 = time.perf_counter()
        p = redeqx.plan(lambda k: models.OPTForCausalLM(config, key=k), _loss, optax.adamw(1e-5),
                        {"ids": jax.ShapeDtypeStruct((mesh.shape["data"], 513), jnp.int32)}, mesh,
                        device_memory="32GB", explore=False, **kw)
        out[label] = dict(peak=p.peak, params_adam=p.parameters + p.optimizer, temporaries=p.temporaries,
                          fits=bool(p.fits), refused=p.refused, compile_s=time.perf_counter() - t0)
    return out


def _run(fn: str, platform: str, devices: int = 8, **kwargs) -> dict:
    """``fn(platform, **kwargs)`` in a fresh process of that compiler."""
    python, env = compiler(platform == "tpu", devices, FAST_COMPILE if devices > 8 else "")
    got = worker(__file__, fn, python=python, env=env, platform=platform, **kwargs)
    print(fn, platform, kwargs, got, flush=True)
    return got


def _pair(fn: str, platform: str, **kwargs) -> tuple[dict, dict]:
    return _run(fn, platform, stacked=False, **kwargs), _run(fn, platform, stacked=True, **kwargs)


def compile_section(compilers) -> list[str]:
    lines = ["Compile time of the zoo LLaMA's train step (hidden 1024, 512 tokens, AdamW, n_model_shards 4 on 8 "
             "devices), on abstract shapes, each in a fresh process:", "",
             "| compiler | layers | listed: trace + compile | stacked: trace + compile | listed temporaries "
             "| stacked temporaries |", "|---|---|---|---|---|---|"]
    for platform in compilers:
        for layers in COMPILE_LAYERS:
            a, b = _pair("compile_worker", platform, layers=layers)
            lines.append(f"| {COMPILERS[platform]} | {layers} | {a['trace_s']:.1f} + {a['compile_s']:.1f} s "
                         f"| {b['trace_s']:.1f} + {b['compile_s']:.1f} s | {a['temp'] / GIB:.2f} GiB "
                         f"| {b['temp'] / GIB:.2f} GiB |")
    return lines


def families_section(compilers, families) -> list[str]:
    lines = ["Each family at hidden 512, 16 layers (per stack), 512 tokens, 4 sequences per data shard, n_model_shards "
             "4 on 8 devices, AdamW, compiled on abstract shapes: listed against stacked (collectives and FLOPs "
             "counted once per loop iteration):", "",
             "| family | compiler | remat | compile listed / stacked | temporaries listed / stacked (ratio) "
             "| FLOPs ratio | collective bytes ratio |", "|---|---|---|---|---|---|---|"]
    for name in families:
        for platform in compilers:
            for remat in (False, True):
                a, b = _pair("family_worker", platform, name=name, remat=remat)
                ta, tb = a["trace_s"] + a["compile_s"], b["trace_s"] + b["compile_s"]
                lines.append(f"| {name} | {COMPILERS[platform]} | {'yes' if remat else 'no'} | {ta:.1f} / {tb:.1f} s "
                             f"| {a['temp'] / MIB:.0f} / {b['temp'] / MIB:.0f} MiB ({b['temp'] / a['temp']:.2f}) "
                             f"| {b['flops'] / a['flops']:.3f} | {b['collectives'] / max(a['collectives'], 1):.3f} |")
    return lines


def user_section(compilers) -> list[str]:
    labels = {"no": "default (scan_residuals='products')", "all": "scan_residuals='all'",
              "dots": "remat(keep='dots')", "nothing": "remat(keep='nothing')"}
    lines = ["A user's own stack (tests/stacked_gpt.py: eqx.nn blocks built by eqx.filter_vmap and run by lax.scan; "
             "width 256, 8 layers, 256 tokens, vocab 8192, 16 sequences per data shard, AdamW) against the same "
             "weights listed, on 8 devices:", "",
             "| compiler | K | step | temporaries listed / stacked (ratio) "
             "| collective bytes listed / stacked (ratio) |",
             "|---|---|---|---|---|"]
    for platform in compilers:
        for k in (2, 4):
            for remat, label in labels.items():
                a, b = _pair("user_worker", platform, k=k, remat=remat)
                lines.append(f"| {COMPILERS[platform]} | {k} | {label} | {a['temp'] / MIB:.1f} / {b['temp'] / MIB:.1f} "
                             f"MiB ({b['temp'] / a['temp']:.2f}) | {a['collectives'] / MIB:.2f} / "
                             f"{b['collectives'] / MIB:.2f} MiB ({b['collectives'] / max(a['collectives'], 1):.3f}) |")
    return lines


def table1_section(compilers) -> list[str]:
    lines = ["OPT-66B on 64 devices (n_model_shards 8 x data 8, 512 tokens, one sequence per data shard), stacked "
             "layers, planned whole:", "",
             "| compiler | setting | peak / chip | fits 32 GB? | params + Adam | temporaries | compile |",
             "|---|---|---|---|---|---|---|"]
    for platform in compilers:
        for label, r in _run("table1_worker", platform, 64).items():
            lines.append(f"| {COMPILERS[platform]} | {label} | {r['peak'] / 1e9:.2f} GB"
                         f"{' (refused)' if r['refused'] else ''} | {'yes' if r['fits'] else 'no'} "
                         f"| {r['params_adam'] / 1e9:.2f} GB | {r['temporaries'] / 1e9:.2f} GB "
                         f"| {r['compile_s']:.0f} s |")
    return lines


def depth_section() -> list[str]:
    lines = ["The user's stack of \"Stacked layers\" (tests/stacked_gpt.py, width 256, 256 tokens, vocab 8192, 16 "
             "sequences per data shard, AdamW, the default step) against the same weights listed, compiled by libtpu "
             "for 8 TPU v4 chips at n_model_shards K, by depth:", "",
             "| K | layers | temporaries listed | stacked | ratio |", "|---|---|---|---|---|"]
    for k in (2, 4):
        for layers in DEPTHS:
            a, b = _pair("user_worker", "tpu", k=k, remat="no", layers=layers)
            lines.append(f"| {k} | {layers} | {a['temp'] / MIB:.1f} MiB | {b['temp'] / MIB:.1f} MiB "
                         f"| {b['temp'] / a['temp']:.3f} |")
    return lines


def main():
    if serve(globals()):
        return
    p = parser(__doc__)
    p.add_argument("--sections", default="compile,families,user,table1,depth")
    p.add_argument("--compilers", default="cpu,tpu", help="cpu (XLA:CPU) and/or tpu (libtpu)")
    p.add_argument("--families", default=",".join(FAMILIES))
    args = p.parse_args()
    wanted, compilers = args.sections.split(","), args.compilers.split(",")
    parts = []
    for name, section in (("compile", lambda: compile_section(compilers)),
                          ("families", lambda: families_section(compilers, args.families.split(","))),
                          ("user", lambda: user_section(compilers)), ("table1", lambda: table1_section(compilers))):
        if name in wanted:
            parts += ([""] if parts else []) + section()
    if parts:
        report(args, "Stacked layers (benchmarks/stacked.py)", "\n".join(parts))
    if "depth" in wanted:
        report(args, "A user's stack by depth on libtpu (benchmarks/stacked.py --sections depth)",
               "\n".join(depth_section()))


if __name__ == "__main__":
    main()
