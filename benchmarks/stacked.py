"""Stacked layers (``scan_layers=True``: one layer's program in a ``lax.scan``)
against listed layers (a Python loop, every layer compiled), on the zoo's
LLaMA: what each costs to compile, to plan, to run and in memory; and redco's
Table 1 fsdp rows planned with stacked layers.

    python benchmarks/table1.py --setup-tpu     # once: benchmarks/.venv-tpu with libtpu
    python benchmarks/stacked.py                # writes its section of benchmarks/RESULTS.md
    python benchmarks/stacked.py --sections compile --no-write

Sections (``--sections``):

- ``compile``: the train step of the zoo LLaMA (hidden 1024, 16 heads, vocab
  32000, 512 tokens, one sequence per data shard, AdamW) at 4, 16, 32 and 80
  layers, listed and stacked, lowered and compiled on abstract shapes (nothing
  allocated) for n_model_shards=4 on 8 devices: XLA:CPU's simulated devices,
  and libtpu for a TPU v4 slice of 8 chips (ahead of time, no TPU attached).
  Each compile in a fresh process.
- ``families``: every family at 16 layers, listed and stacked, the default
  step and under `redeqx.remat`, on both compilers: compile time, temporaries,
  FLOPs and collective bytes.
- ``plan70b``: `redeqx.plan` of a LLaMA-70B-shaped model (80 layers, hidden
  8192, 64 heads, 8 KV heads), stacked, on abstract shapes: wall time and the
  plan.
- ``step``: step time (median over alternating steps) and temporaries of a
  smaller LLaMA (hidden 512, 8 layers, 256 tokens) on 8 simulated CPU
  devices, listed and stacked, each with and without `redeqx.remat`.
- ``user``: a user's own stack (tests/stacked_gpt.py: ``eqx.nn`` blocks
  built by ``eqx.filter_vmap``, run by ``lax.scan``; width 256, 8 layers, 256
  tokens, vocab 8192, 16 sequences per data shard) against the same weights
  listed, at n_model_shards 2 and 4: the default step (a scan keeps only
  its products, ``scan_residuals="products"``), JAX's own scan
  (``scan_residuals="all"``), and under `redeqx.remat` keeping ``"dots"`` or
  ``"nothing"``, on both compilers: temporaries and collective bytes.
- ``residuals``: step time on CPU of the user's stack with
  ``scan_residuals="products"`` (the default) and ``"all"``, alternated
  step by step in one process.
- ``table1``: OPT-66B with fsdp on 64 devices (n_model_shards 8), stacked, by
  XLA:CPU and by libtpu, next to the listed rows of "redco Table 1 ... by the
  TPU v4 compiler".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
GIB = 2**30

DEPTHS = (4, 8, 16, 32)  # the depth section's layer counts
COMPILE_LAYERS = (4, 16, 32, 80)


def _llama(layers: int, stacked: bool, hidden=1024, intermediate=2816, heads=16, kv_heads=None, vocab=32000):
    from redeqx import models

    return models.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                              num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                              max_position_embeddings=4096, scan_layers=stacked)


def _loss(model, batch, key):
    import jax
    import optax

    ids = batch["ids"]
    logits = jax.vmap(model)(ids[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()


def _devices(platform: str, n: int = 8):
    import jax

    if platform == "tpu":
        from jax.experimental import topologies

        shape = {8: "v4:2x2x2", 64: "v4:4x4x4"}[n]
        return topologies.get_topology_desc(platform="tpu", topology_name=shape, chip_config_name="megacore",
                                            chips_per_host_bounds=(2, 2, 1), num_slices=1).devices
    return jax.devices()


def compile_worker(platform: str, layers: int, stacked: bool) -> dict:
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    import redeqx
    from redeqx import models

    mesh = redeqx.make_mesh(4, devices=_devices(platform))
    config = _llama(layers, stacked)
    t0 = time.perf_counter()
    model = eqx.filter_eval_shape(lambda k: models.LlamaForCausalLM(config, key=k), jax.random.key(0))
    specs = redeqx.sharding_rules(model, mesh)
    state = redeqx.init_state(model, optax.adamw(1e-4), mesh, specs, key=jax.random.key(0))
    step = redeqx.make_train_step(_loss, optax.adamw(1e-4), mesh, specs)
    lowered = step.lower(state, {"ids": jax.ShapeDtypeStruct((mesh.shape["data"], 513), jnp.int32)})
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    return dict(trace_s=t1 - t0, compile_s=t2 - t1, temp=compiled.memory_analysis().temp_size_in_bytes)


FAMILIES = ("llama", "gpt2", "opt", "gptj", "t5", "bart")


def _family(name: str, stacked: bool, layers: int = 16):
    """A family's constructor and loss at hidden 512, ``layers`` layers (per stack)."""
    import dataclasses

    import optax
    from redeqx import models

    enc_dec = name in ("t5", "bart")
    cls, config = {
        "llama": (models.LlamaForCausalLM, models.LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1408,
                                                              num_hidden_layers=layers, num_attention_heads=8)),
        "gpt2": (models.GPT2LMHeadModel, models.GPT2Config(vocab_size=32000, n_positions=1024, n_embd=512,
                                                           n_layer=layers, n_head=8)),
        "opt": (models.OPTForCausalLM, models.OPTConfig(vocab_size=32000, hidden_size=512, num_hidden_layers=layers,
                                                        ffn_dim=2048, num_attention_heads=8)),
        "gptj": (models.GPTJForCausalLM, models.GPTJConfig(vocab_size=32000, n_positions=1024, n_embd=512,
                                                           n_layer=layers, n_head=8, rotary_dim=32)),
        "t5": (models.T5ForConditionalGeneration, models.T5Config(vocab_size=32000, d_model=512, d_kv=64, d_ff=1408,
                                                                  num_layers=layers, num_heads=8,
                                                                  feed_forward_proj="gated-gelu",
                                                                  tie_word_embeddings=False)),
        "bart": (models.BartForConditionalGeneration, models.BartConfig(
            vocab_size=32000, d_model=512, encoder_layers=layers, decoder_layers=layers, encoder_attention_heads=8,
            decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048, max_position_embeddings=1024)),
    }[name]
    config = dataclasses.replace(config, scan_layers=stacked)
    shift = {"t5": models.shift_right, "bart": models.shift_tokens_right}.get(name)

    def loss(model, batch, key):
        import jax

        ids = batch["ids"]
        if enc_dec:
            logits = jax.vmap(lambda s: model(s, shift(s, config)))(ids[:, :256])
            return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, :256]).mean()
        logits = jax.vmap(model)(ids[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

    return (lambda k: cls(config, key=k)), loss


def family_worker(platform: str, name: str, stacked: bool, remat: bool) -> dict:
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    import redeqx

    mesh = redeqx.make_mesh(4, devices=_devices(platform))
    make, loss = _family(name, stacked)
    t0 = time.perf_counter()
    model = eqx.filter_eval_shape(make, jax.random.key(0))
    specs = redeqx.sharding_rules(model, mesh)
    state = redeqx.init_state(model, optax.adamw(1e-4), mesh, specs, key=jax.random.key(0))
    step = redeqx.make_train_step(redeqx.remat(loss) if remat else loss, optax.adamw(1e-4), mesh, specs)
    lowered = step.lower(state, {"ids": jax.ShapeDtypeStruct((4 * mesh.shape["data"], 513), jnp.int32)})
    compiled = lowered.compile()
    from redeqx._hlo import loop_factor

    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return dict(compile_s=time.perf_counter() - t0, temp=compiled.memory_analysis().temp_size_in_bytes,
                flops=float(cost.get("flops", 0.0)) * loop_factor(lowered.as_text(dialect="hlo")),
                collectives=sum(v["bytes"] for v in redeqx.collective_summary(compiled.as_text()).values()))


def families_section() -> str:
    lines = ["| family | compiler | remat | compile listed / stacked | temporaries listed / stacked (ratio) "
             "| FLOPs ratio | collective bytes ratio |", "|---|---|---|---|---|---|---|"]
    for name in FAMILIES:
        for platform in ("cpu", "tpu"):
            for remat in (False, True):
                a, b = (_run("family", [platform, name, str(int(stacked)), str(int(remat))], platform)
                        for stacked in (False, True))
                row = (f"| {name} | {'XLA:CPU' if platform == 'cpu' else 'libtpu'} | {'yes' if remat else 'no'} "
                       f"| {a['compile_s']:.1f} / {b['compile_s']:.1f} s | {a['temp'] / 2**20:.0f} / "
                       f"{b['temp'] / 2**20:.0f} MiB ({b['temp'] / a['temp']:.2f}) | {b['flops'] / a['flops']:.3f} "
                       f"| {b['collectives'] / max(a['collectives'], 1):.3f} |")
                print(row, flush=True)
                lines.append(row)
    return "\n".join(lines)


def plan70b_worker() -> dict:
    import jax
    import jax.numpy as jnp
    import optax

    import redeqx
    from redeqx import models

    config = _llama(80, True, hidden=8192, intermediate=28672, heads=64, kv_heads=8)
    mesh = redeqx.make_mesh(8)
    t0 = time.perf_counter()
    p = redeqx.plan(lambda k: models.LlamaForCausalLM(config, key=k), _loss, optax.adamw(1e-5),
                    {"ids": jax.ShapeDtypeStruct((1, 1025), jnp.int32)}, mesh, fsdp=False, remat=True,
                    compute_dtype=jnp.bfloat16, device_memory="80GB", explore=False)
    return dict(wall_s=time.perf_counter() - t0, plan=str(p))


def step_worker(stacked: bool, remat: bool, rounds: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import redeqx
    from redeqx import models

    mesh = redeqx.make_mesh(2)
    config = _llama(8, stacked, hidden=512, intermediate=1408, heads=8, vocab=8192)
    model = redeqx.init_model(lambda k: models.LlamaForCausalLM(config, key=k), mesh, key=jax.random.key(0))
    specs = redeqx.sharding_rules(model, mesh)
    optimizer = optax.adamw(1e-4)
    state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1), donate_model=True)
    step = redeqx.make_train_step(redeqx.remat(_loss) if remat else _loss, optimizer, mesh, specs)
    batch = {"ids": jnp.asarray(np.random.default_rng(0).integers(0, 8192, (4 * mesh.shape["data"], 257)), jnp.int32)}
    temp = step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes
    state, metrics = step(state, batch)  # compile
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t)
    return dict(temp=temp, times=times, loss=float(metrics["loss"]))


def residuals_worker(rounds: int) -> dict:
    """The user's stack on 8 simulated CPU devices (n_model_shards 2), its
    step with scan_residuals "products" and "all", alternated step by step
    in this one process: median seconds per step and temporaries."""
    import jax
    import numpy as np
    import optax

    import redeqx

    sys.path.insert(0, str(HERE.parent / "tests"))
    from stacked_gpt import GPT, batch, loss_fn

    mesh = redeqx.make_mesh(2)
    model = GPT(vocab=1024, seq=128, width=128, layers=8, heads=4, key=jax.random.key(0))
    specs = redeqx.sharding_rules(model, mesh)
    data = batch(16 * mesh.shape["data"], seq=128, vocab=1024)
    variants = ("products", "all")
    states, steps, temps, times = {}, {}, {}, {v: [] for v in variants}
    for v in variants:
        states[v] = redeqx.init_state(model, optax.adamw(1e-3), mesh, specs, key=jax.random.key(1))
        steps[v] = redeqx.make_train_step(loss_fn, optax.adamw(1e-3), mesh, specs, scan_residuals=v)
        temps[v] = steps[v].lower(states[v], data).compile().memory_analysis().temp_size_in_bytes
        states[v], _ = steps[v](states[v], data)  # compile
    for i in range(rounds):
        for v in variants if i % 2 == 0 else variants[::-1]:
            t = time.perf_counter()
            states[v], metrics = steps[v](states[v], data)
            jax.block_until_ready(metrics)
            times[v].append(time.perf_counter() - t)
    return {v: dict(s=float(np.median(times[v])), temp=temps[v], loss=float(metrics["loss"])) for v in variants}


def user_worker(platform: str, k: int, stacked: bool, remat: str, layers: int = 8) -> dict:
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    import redeqx

    sys.path.insert(0, str(HERE.parent / "tests"))
    from stacked_gpt import GPT, loss_fn, unstacked

    mesh = redeqx.make_mesh(k, devices=_devices(platform))

    def make():
        model = GPT(vocab=8192, seq=256, width=256, layers=layers, heads=4, key=jax.random.key(0))
        return model if stacked else unstacked(model)

    model = eqx.filter_eval_shape(make)
    specs = redeqx.sharding_rules(model, mesh)
    state = redeqx.init_state(model, optax.adamw(1e-4), mesh, specs, key=jax.random.key(0))
    loss = loss_fn if remat in ("no", "all") else redeqx.remat(loss_fn, keep=remat)
    step = redeqx.make_train_step(loss, optax.adamw(1e-4), mesh, specs,
                                  scan_residuals="all" if remat == "all" else "products")
    batch = {"tokens": jax.ShapeDtypeStruct((16 * mesh.shape["data"], 257), jnp.int32)}
    compiled = step.lower(state, batch).compile()
    return dict(temp=compiled.memory_analysis().temp_size_in_bytes,
                collectives=sum(v["bytes"] for v in redeqx.collective_summary(compiled.as_text()).values()))


def table1_worker(platform: str) -> dict:
    import jax
    import jax.numpy as jnp
    import optax

    import redeqx
    from redeqx import models

    config = models.OPTConfig(hidden_size=9216, num_hidden_layers=64, ffn_dim=36864, num_attention_heads=72,
                              vocab_size=50272, max_position_embeddings=2048, scan_layers=True)
    mesh = redeqx.make_mesh(8, devices=_devices(platform, 64))
    out = {}
    for label, kw in (("fsdp=True", dict(fsdp=True)),
                      ("fsdp + remat + bf16", dict(fsdp=True, remat=True, compute_dtype=jnp.bfloat16))):
        t0 = time.perf_counter()
        p = redeqx.plan(lambda k: models.OPTForCausalLM(config, key=k), _loss, optax.adamw(1e-5),
                        {"ids": jax.ShapeDtypeStruct((mesh.shape["data"], 513), jnp.int32)}, mesh,
                        device_memory="32GB", explore=False, **kw)
        out[label] = dict(peak=p.peak, params_adam=p.parameters + p.optimizer, temporaries=p.temporaries,
                          fits=p.fits, refused=p.refused, compile_s=time.perf_counter() - t0)
    return out


def _run(kind: str, args: list[str], platform: str = "cpu", devices: int = 8):
    from _common import libtpu, run_worker

    if platform == "tpu":
        python, env = libtpu()
    else:
        from table1 import FAST_COMPILE  # the same buffer assignment, a faster compile (see there)

        flags = f"--xla_force_host_platform_device_count={devices}" + (f" {FAST_COMPILE}" if kind == "table1" else "")
        python, env = sys.executable, dict(os.environ, XLA_FLAGS=flags)
    return run_worker(python, __file__, ["--worker", kind, *args], env)


def compile_section() -> str:
    rows = {}
    for platform in ("cpu", "tpu"):
        for layers in COMPILE_LAYERS:
            for stacked in (False, True):
                r = _run("compile", [platform, str(layers), str(int(stacked))], platform)
                rows[(platform, layers, stacked)] = r
                print(platform, layers, "stacked" if stacked else "listed", r, flush=True)
    lines = ["| compiler | layers | listed: trace + compile | stacked: trace + compile | listed temporaries "
             "| stacked temporaries |", "|---|---|---|---|---|---|"]
    for platform in ("cpu", "tpu"):
        for layers in COMPILE_LAYERS:
            a, b = rows[(platform, layers, False)], rows[(platform, layers, True)]
            lines.append(f"| {'XLA:CPU' if platform == 'cpu' else 'libtpu (v4, 8 chips)'} | {layers} "
                         f"| {a['trace_s']:.1f} + {a['compile_s']:.1f} s | {b['trace_s']:.1f} + {b['compile_s']:.1f} s "
                         f"| {a['temp'] / GIB:.2f} GiB | {b['temp'] / GIB:.2f} GiB |")
    notes = []
    for platform in ("cpu", "tpu"):
        total = {s: [rows[(platform, n, s)]["trace_s"] + rows[(platform, n, s)]["compile_s"] for n in COMPILE_LAYERS]
                 for s in (False, True)}
        notes.append(f"{'XLA:CPU' if platform == 'cpu' else 'libtpu'}: stacked 32 layers / 4 layers = "
                     f"{total[True][2] / total[True][0]:.2f}x, 80 / 4 = {total[True][3] / total[True][0]:.2f}x "
                     f"(listed: {total[False][2] / total[False][0]:.2f}x, {total[False][3] / total[False][0]:.2f}x)")
    return "\n".join(lines + ["", "; ".join(notes) + "."])


def user_section() -> str:
    lines = ["| compiler | K | step | temporaries listed / stacked (ratio) | collective bytes listed / stacked (ratio) |",
             "|---|---|---|---|---|"]
    labels = {"no": "default (scan_residuals='products')", "all": "scan_residuals='all'",
              "dots": "remat(keep='dots')", "nothing": "remat(keep='nothing')"}
    for platform in ("cpu", "tpu"):
        for k in (2, 4):
            for remat in ("no", "all", "dots", "nothing"):
                a, b = (_run("user", [platform, str(k), str(int(stacked)), remat], platform)
                        for stacked in (False, True))
                row = (f"| {'XLA:CPU' if platform == 'cpu' else 'libtpu'} | {k} | {labels[remat]} "
                       f"| {a['temp'] / 2**20:.1f} / {b['temp'] / 2**20:.1f} MiB ({b['temp'] / a['temp']:.2f}) "
                       f"| {a['collectives'] / 2**20:.2f} / {b['collectives'] / 2**20:.2f} MiB "
                       f"({b['collectives'] / max(a['collectives'], 1):.3f}) |")
                print(row, flush=True)
                lines.append(row)
    return "\n".join(lines)


def depth_section() -> str:
    """The user's stack against its layers listed, by depth, on libtpu (default step)."""
    lines = ["| K | layers | temporaries listed | stacked | ratio |", "|---|---|---|---|---|"]
    for k in (2, 4):
        for layers in DEPTHS:
            a, b = (_run("user", ["tpu", str(k), str(int(stacked)), "no", str(layers)], "tpu") for stacked in (False, True))
            row = (f"| {k} | {layers} | {a['temp'] / 2**20:.1f} MiB | {b['temp'] / 2**20:.1f} MiB "
                   f"| {b['temp'] / a['temp']:.3f} |")
            print(row, flush=True)
            lines.append(row)
    return "\n".join(lines)


def step_section(rounds: int) -> str:
    results = {}
    for r in range(2):  # alternate the variants, twice
        for stacked in (False, True):
            for remat in (False, True):
                got = _run("step", [str(int(stacked)), str(int(remat)), str(rounds)])
                results.setdefault((stacked, remat), []).append(got)
                print(stacked, remat, got, flush=True)
    lines = ["| layers | remat | s / step (median) | temporaries | loss after 2 steps |", "|---|---|---|---|---|"]
    for (stacked, remat), runs in results.items():
        times = [t for run in runs for t in run["times"]]
        lines.append(f"| {'stacked' if stacked else 'listed'} | {'yes' if remat else 'no'} "
                     f"| {statistics.median(times):.3f} | {runs[0]['temp'] / 2**20:.1f} MiB | {runs[0]['loss']:.5f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="compile,families,user,residuals,plan70b,step,table1,depth",
                        help="depth is written to a section of its own")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, *rest = args.worker
        if kind == "compile":
            out = compile_worker(rest[0], int(rest[1]), bool(int(rest[2])))
        elif kind == "family":
            out = family_worker(rest[0], rest[1], bool(int(rest[2])), bool(int(rest[3])))
        elif kind == "plan70b":
            out = plan70b_worker()
        elif kind == "user":
            out = user_worker(rest[0], int(rest[1]), bool(int(rest[2])), rest[3], *map(int, rest[4:]))
        elif kind == "residuals":
            out = residuals_worker(int(rest[0]))
        elif kind == "step":
            out = step_worker(bool(int(rest[0])), bool(int(rest[1])), int(rest[2]))
        else:
            out = table1_worker(rest[0])
        print(json.dumps(out), flush=True)
        return
    wanted = args.sections.split(",")
    parts = []
    if "compile" in wanted:
        parts += ["Compile time of the zoo LLaMA's train step (hidden 1024, 512 tokens, AdamW, n_model_shards 4 on "
                  "8 devices), on abstract shapes, each in a fresh process:", "", compile_section()]
    if "families" in wanted:
        parts += ["", "Each family at hidden 512, 16 layers (per stack), 512 tokens, 4 sequences per data shard, "
                      "n_model_shards 4 on 8 devices, AdamW, compiled on abstract shapes: listed against stacked "
                      "(collectives and FLOPs counted once per loop iteration):", "", families_section()]
    if "user" in wanted:
        parts += ["", "A user's own stack (tests/stacked_gpt.py: eqx.nn blocks built by eqx.filter_vmap and run by "
                      "lax.scan; width 256, 8 layers, 256 tokens, vocab 8192, 16 sequences per data shard, AdamW) "
                      "against the same weights listed, on 8 devices:", "", user_section()]
    if "residuals" in wanted:
        r = _run("residuals", [str(4 * args.rounds)])
        lines = ["| scan_residuals | s / step (median) | temporaries |", "|---|---|---|"]
        lines += [f"| {v!r} | {got['s']:.3f} | {got['temp'] / 2**20:.1f} MiB |" for v, got in r.items()]
        parts += ["", "The user's stack (width 128, 8 layers, 128 tokens, vocab 1024, 16 sequences per data shard, "
                      "n_model_shards 2) on 8 simulated CPU devices, both steps in one process, alternated step by "
                      f"step, {4 * args.rounds} steps each: products / all = "
                      f"{r['products']['s'] / r['all']['s']:.2f}x the time.", "", "\n".join(lines)]
    if "plan70b" in wanted:
        r = _run("plan70b", [])
        print(r["plan"])
        parts += ["", f"A LLaMA-70B-shaped model (80 layers, hidden 8192, 64 heads, 8 KV heads), stacked, planned on "
                      f"abstract shapes on 8 simulated CPU devices (n_model_shards 8, remat, bf16 compute): "
                      f"`redeqx.plan` took {r['wall_s']:.1f} s.", "", "```", r["plan"], "```"]
    if "step" in wanted:
        parts += ["", "Step time and temporaries on 8 simulated CPU devices (LLaMA hidden 512, 8 layers, vocab 8192, "
                      "256 tokens, 4 sequences per data shard, n_model_shards 2, AdamW), each variant in a fresh "
                      f"process, alternating, 2 x {args.rounds} steps:", "", step_section(args.rounds)]
    if "table1" in wanted:
        rows = {"XLA:CPU": _run("table1", ["cpu"], "cpu", 64), "libtpu": _run("table1", ["tpu"], "tpu")}
        lines = ["| compiler | setting | peak / chip | fits 32 GB? | params + Adam | temporaries | compile |",
                 "|---|---|---|---|---|---|---|"]
        for compiler, got in rows.items():
            for label, r in got.items():
                refused = " (refused)" if r["refused"] else ""
                lines.append(f"| {compiler} | {label} | {r['peak'] / 1e9:.2f} GB{refused} | {'yes' if r['fits'] else 'no'} "
                             f"| {r['params_adam'] / 1e9:.2f} GB | {r['temporaries'] / 1e9:.2f} GB "
                             f"| {r['compile_s']:.0f} s |")
        parts += ["", "OPT-66B on 64 devices (n_model_shards 8 x data 8, 512 tokens, one sequence per data shard), "
                      "stacked layers, planned whole:", "", *lines]
    from _common import write_section

    if parts:
        report = "\n".join(parts)
        print(report)
        if not args.no_write:
            write_section("Stacked layers (benchmarks/stacked.py)", report)
    if "depth" in wanted:
        report = "\n".join([
            "The user's stack of \"Stacked layers\" (tests/stacked_gpt.py, width 256, 256 tokens, vocab 8192, 16 "
            "sequences per data shard, AdamW, the default step) against the same weights listed, compiled by libtpu "
            "for 8 TPU v4 chips at n_model_shards K, by depth:", "", depth_section()])
        print(report)
        if not args.no_write:
            write_section("A user's stack by depth on libtpu (benchmarks/stacked.py --sections depth)", report)


if __name__ == "__main__":
    main()
