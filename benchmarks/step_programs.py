"""The compiled programs of every train/eval/predict step option, as figures
to compare before and after a change to how steps are built.

    python -m benchmarks.step_programs --out before.json      # on the old code
    python -m benchmarks.step_programs --out after.json       # on the new code
    python -m benchmarks.step_programs --compare before.json after.json

For each option (accumulate, compute_dtype, trainable, shard_mean_loss,
remat, a model with BatchNorm state, eval and predict) the step of a small
user GPT (tests/user_gpt.py) or MLP is compiled on abstract shapes for 8
simulated CPU devices, and the compiled program's own figures are kept: the
temporaries, argument and output bytes, FLOPs, the collectives (kind, count,
bytes) and a fingerprint of the optimized HLO with names and source
locations removed. It writes no section of RESULTS.md: it is a check for a
change that should leave the programs as they are.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

from benchmarks._common import compiled_figures, cpu_devices, parser

cpu_devices(8)

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402
from user_gpt import GPT, loss_fn as gpt_loss  # noqa: E402

import redeqx  # noqa: E402


class BN(eqx.Module):
    fc1: eqx.nn.Linear
    bn: eqx.nn.BatchNorm
    fc2: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.fc1 = eqx.nn.Linear(8, 32, key=k1)
        self.bn = eqx.nn.BatchNorm(32, axis_name="batch")
        self.fc2 = eqx.nn.Linear(32, 4, key=k2)

    def __call__(self, x, state):
        h, state = self.bn(self.fc1(x), state)
        return self.fc2(jax.nn.relu(h)), state


def bn_loss(model, batch, key, model_state):
    logits, model_state = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
        batch["x"], model_state)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), model_state


def gpt_pred(model, batch, key):
    return jax.vmap(model)(batch["tokens"][:, :-1]).argmax(-1)


def _fingerprint(text: str) -> str:
    """The program, without what names where it came from: metadata, the
    source-location tables, instruction names."""
    text = re.sub(r", metadata=\{[^}]*\}", "", text)
    text = re.sub(r"^(FileNames|FunctionNames|FileLocations|StackFrames)\n|^\d+ .*\n", "", text, flags=re.M)
    text = re.sub(r", stack_frame_id=\d+", "", text)
    text = re.sub(r"%[\w.\-]+", "%x", text)
    text = re.sub(r"^HloModule \S+", "HloModule", text, flags=re.M)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _figures(compiled) -> dict:
    from redeqx import collective_summary

    f, text = compiled_figures(compiled), compiled.as_text()
    return {"temp": f["temporaries"], "args": f["arguments"], "out": f["outputs"], "flops": f["flops"],
            "collectives": collective_summary(text), "hlo": _fingerprint(text)}


def _gpt_state(mesh, optimizer, trainable=None):
    model = eqx.filter_eval_shape(lambda k: GPT(vocab=512, seq=64, width=64, layers=2, heads=4, key=k),
                                  jax.random.key(0))
    specs = redeqx.sharding_rules(model, mesh)
    state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1), trainable=trainable)
    batch = {"tokens": jax.ShapeDtypeStruct((8 * mesh.shape["data"], 65), jnp.int32,
                                            sharding=NamedSharding(mesh, P("data")))}
    return model, specs, state, batch


def train_cases():
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    for k in (1, 2, 4):
        for name, kw in (("plain", {}), ("accumulate=2", {"accumulate": 2}),
                         ("bf16", {"compute_dtype": jnp.bfloat16}), ("shard_mean", {"shard_mean_loss": True}),
                         ("remat", {"remat": True}), ("frozen embedding", {"frozen": True})):
            if name in ("bf16", "frozen embedding", "remat") and k == 4:
                continue
            yield f"train K={k} {name}", k, optimizer, kw


def run() -> dict:
    out = {}
    for name, k, optimizer, kw in train_cases():
        mesh = redeqx.make_mesh(k)
        trainable = None
        if kw.pop("frozen", False):
            model = eqx.filter_eval_shape(lambda k: GPT(vocab=512, seq=64, width=64, layers=2, heads=4, key=k),
                                          jax.random.key(0))
            trainable = eqx.tree_at(lambda m: m.wte.weight, jax.tree.map(lambda _: True, model), False)
        model, specs, state, batch = _gpt_state(mesh, optimizer, trainable)
        loss = redeqx.remat(gpt_loss) if kw.pop("remat", False) else gpt_loss
        step = redeqx.make_train_step(loss, optimizer, mesh, specs, trainable=trainable, **kw)
        out[name] = _figures(step.lower(state, batch).compile())
        print(name, out[name], flush=True)
    for k in (1, 2):
        mesh = redeqx.make_mesh(k)
        model, specs, state, batch = _gpt_state(mesh, optax.adamw(1e-3))
        eval_step = redeqx.make_eval_step(gpt_loss, mesh, specs)
        out[f"eval K={k}"] = _figures(eval_step.lower(state.model, batch, jax.random.key(0)).compile())
        predict_step = redeqx.make_predict_step(gpt_pred, mesh, specs)
        out[f"predict K={k}"] = _figures(predict_step.lower(state.model, batch, jax.random.key(0)).compile())
    mesh = redeqx.make_mesh(2)
    model, bn_state = eqx.nn.make_with_state(BN)(jax.random.key(0))
    specs = redeqx.sharding_rules(model, mesh)
    state = redeqx.init_state(model, optax.adam(1e-3), mesh, specs, key=jax.random.key(1), model_state=bn_state)
    batch = {"x": jnp.zeros((16, 8)), "y": jnp.zeros((16,), jnp.int32)}
    for a in (1, 2):
        step = redeqx.make_train_step(bn_loss, optax.adam(1e-3), mesh, specs, accumulate=a)
        out[f"train BatchNorm accumulate={a}"] = _figures(step.lower(state, batch).compile())
    return out


def compare(before: dict, after: dict) -> int:
    bad = 0
    for name in before:
        b, a = before[name], after.get(name)
        if a is None:
            print(f"{name}: missing after")
            bad += 1
            continue
        same = {k: a[k] == b[k] for k in b}
        verdict = "identical program" if all(same.values()) else (
            "same figures, other HLO" if all(v for k, v in same.items() if k != "hlo") else "DIFFERS")
        bad += verdict == "DIFFERS"
        detail = "" if verdict != "DIFFERS" else " " + "; ".join(
            f"{k}: {b[k]} -> {a[k]}" for k in b if a[k] != b[k] and k != "hlo")
        print(f"{name}: {verdict}{detail}")
    return bad


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--out")
    p.add_argument("--compare", nargs=2)
    args = p.parse_args()
    if args.compare:
        sys.exit(1 if compare(*(json.loads(Path(f).read_text()) for f in args.compare)) else 0)
    figures = run()
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
