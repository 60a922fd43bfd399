"""LoRA: low-rank adapters on chosen linear layers of any Equinox model.

`lora` swaps each linear layer whose path matches a regex for a `LoRALinear`
that keeps the layer's own ``weight`` and ``bias`` (same paths, so the
sharding rules and checkpoint names do not move) and adds ``lora_a``
``(rank, in)`` and ``lora_b`` ``(out, rank)``; `lora_trainable` is the
``trainable=`` mask that trains only the adapters; `merge_lora` folds them back
into plain layers for `save_pretrained`.

The sharding rules split ``lora_b`` with a column-parallel layer (on ``out``)
and ``lora_a`` with a row-parallel one (on ``in``), so the adapter's extra
matmuls need no communication beyond the layer's own.
"""

from __future__ import annotations

import difflib
import re

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray, PyTree

from ..sharding import declared_ndim
from .._trees import path_parts
from .._typing import positive_int, typechecked
from ._moe import Experts, LoRAExperts, lora_experts


class LoRALinear(eqx.Module):
    """``y = x W^T + b + scale * (x A^T) B^T``, with ``W`` frozen by
    `lora_trainable`, ``A`` ``(rank, in)`` random and ``B`` ``(out, rank)``
    zero, so the layer starts as the one it replaced."""

    weight: Float[Array, "out in"]
    bias: Float[Array, " out"] | None
    lora_a: Float[Array, "rank in"]
    lora_b: Float[Array, "out rank"]
    scale: float = eqx.field(static=True)
    base: eqx.Module = eqx.field(static=True)  # the replaced layer with abstract arrays, for merge_lora

    def __call__(self, x: Float[Array, "*batch in"]) -> Float[Array, "*batch out"]:
        y = x @ self.weight.T.astype(x.dtype)
        if self.bias is not None:
            y = y + self.bias.astype(x.dtype).reshape((1,) * (y.ndim - 1) + self.bias.shape)
        low = (x @ self.lora_a.T.astype(x.dtype)) @ self.lora_b.T.astype(x.dtype)
        return y + jnp.asarray(self.scale, x.dtype) * low


def _is_linear(x) -> bool:
    """A linear layer: a module with a bias and a 2-D weight in one layer
    (a stacked layer's weight has its layer axes in front)."""
    weight = getattr(x, "weight", None)
    if not (isinstance(x, eqx.Module) and not isinstance(x, LoRALinear) and hasattr(x, "bias")
            and isinstance(weight, (jax.Array, jax.ShapeDtypeStruct))):
        return False
    ndim = declared_ndim(x, "weight")
    return (weight.ndim == 2) if ndim is None else (ndim == 2 and weight.ndim >= 2)


def _abstract(module):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype) if eqx.is_array(a) else a, module)


@typechecked
def lora(model: PyTree, pattern: str, *, rank: int, alpha: float, key: PRNGKeyArray) -> PyTree:
    """``model`` with a `LoRALinear` in place of every linear layer whose path
    (e.g. ``model.layers.0.self_attn.q_proj``) matches the regex ``pattern``,
    and a `redeqx.models.LoRAExperts` (a pair of adapters per expert and
    stack) in place of every mixture-of-experts block's experts whose path
    matches (``model.layers.0.mlp.experts``).

    ``rank`` is the adapters' inner size and ``alpha / rank`` their scale (as in
    the LoRA paper and PEFT). Train with ``trainable=lora_trainable(model)``;
    an adapted layer computes exactly what it did until its ``lora_b`` moves
    from zero.

    **Example:**

    ```python
    model = models.lora(model, r"self_attn\\.(q_proj|v_proj)$", rank=8, alpha=16, key=jax.random.key(0))
    trainable = models.lora_trainable(model)
    specs = redeqx.sharding_rules(model, mesh)
    state = redeqx.init_state(model, optimizer, mesh, specs, key=key, trainable=trainable)
    train_step = redeqx.make_train_step(loss_fn, optimizer, mesh, specs, trainable=trainable)
    ```
    """
    rank = positive_int(rank, "rank")
    try:
        rx = re.compile(pattern)
    except re.error as e:
        raise ValueError(f"pattern {pattern!r} is not a valid regular expression ({e}).") from None
    leaves = jax.tree_util.tree_flatten_with_path(model, is_leaf=_adaptable)[0]
    layers = [".".join(path_parts(kp)) for kp, x in leaves if _adaptable(x)]
    hits = [p for p in layers if rx.search(p)]
    if not hits:
        near = difflib.get_close_matches(pattern, layers, n=5, cutoff=0.2) or layers[:5]
        raise ValueError(f"pattern {pattern!r} matches no linear layer; layer paths look like: {', '.join(near)}.")
    keys = dict(zip(hits, jax.random.split(key, len(hits))))

    def adapt(kp, x):
        path = ".".join(path_parts(kp))
        if not (_adaptable(x) and path in keys):
            return x
        if isinstance(x, Experts):
            return lora_experts(x, rank=rank, alpha=alpha, key=keys[path])
        *layers, out_features, in_features = x.weight.shape  # stacked layers: a pair of adapters per layer
        bound = 1.0 / in_features**0.5  # PEFT's default: Kaiming-uniform A, zero B
        a = jax.random.uniform(keys[path], (*layers, rank, in_features), jnp.float32, -bound, bound)
        b = jnp.zeros((*layers, out_features, rank), x.weight.dtype)
        return LoRALinear(weight=x.weight, bias=x.bias, lora_a=a.astype(x.weight.dtype), lora_b=b,
                          scale=float(alpha) / rank, base=_abstract(x))

    return jax.tree_util.tree_map_with_path(adapt, model, is_leaf=_adaptable)


def _adaptable(x) -> bool:
    """A linear layer, or the experts of a mixture-of-experts block."""
    return _is_linear(x) or isinstance(x, Experts)


def lora_trainable(model: PyTree) -> PyTree:
    """The ``trainable=`` filter spec that trains the adapters only: ``True``
    at every ``lora_a``/``lora_b``, ``False`` elsewhere.

    **Example:**

    ```python
    trainable = models.lora_trainable(model)
    n = sum(x.size for x in jax.tree.leaves(eqx.filter(model, trainable)))   # trainable parameters
    ```
    """
    return jax.tree_util.tree_map_with_path(
        lambda kp, x: eqx.is_array(x) and path_parts(kp)[-1] in ("lora_a", "lora_b"), model
    )


def merge_lora(model: PyTree) -> PyTree:
    """``model`` with every `LoRALinear` folded back into the layer it
    replaced: ``W + scale * B A``. The result has the original structure and
    names, so `save_pretrained` writes a checkpoint Transformers loads.

    **Example:**

    ```python
    models.save_pretrained(models.merge_lora(state.model), "out/finetuned")
    ```
    """

    def merge(x):
        if isinstance(x, LoRAExperts):
            return x.merged()
        if not isinstance(x, LoRALinear):
            return x
        delta = x.scale * (x.lora_b.astype(jnp.float32) @ x.lora_a.astype(jnp.float32))  # per layer when stacked
        weight = (x.weight.astype(jnp.float32) + delta).astype(x.weight.dtype)
        if x.base.bias is None:
            return eqx.tree_at(lambda m: m.weight, x.base, weight)
        return eqx.tree_at(lambda m: (m.weight, m.bias), x.base, (weight, x.bias))

    return jax.tree.map(merge, model, is_leaf=lambda x: isinstance(x, (LoRALinear, LoRAExperts)))
