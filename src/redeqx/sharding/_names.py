"""The name tables the rules fall back on, and what a leaf's path and modules say.

`_name_rules` decides from these where the program does not (no
``loss_fn``/``batch`` given, or a weight the program never contracts).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, NamedTuple

import equinox as eqx
import jax

from .._trees import is_array_like

Q_NAMES = {"query_proj", "q_proj", "wq", "q", "query"}
QKV_NAMES = Q_NAMES | {"key_proj", "value_proj", "k_proj", "v_proj", "wk", "wv", "k", "v", "key", "value"}
ATTN_OUT_NAMES = {"output_proj", "o_proj", "out_proj", "wo", "o", "c_proj", "dense", "proj"}
UP_NAMES = {"up", "gate", "fc1", "w1", "w3", "wi", "wi_0", "wi_1", "c_fc", "up_proj", "gate_proj", "fc_in"}
DOWN_NAMES = {"down", "fc2", "w2", "wo", "c_proj", "down_proj", "fc_out"}
# one layer computing Q, K and V (or K and V) side by side: ((3 or 2) * heads * head_dim, in)
FUSED_NAMES = {"qkv", "to_qkv", "c_attn", "wqkv", "w_qkv", "qkv_proj", "query_key_value", "to_kv", "wkv", "w_kv", "kv_proj"}
# what the attention module holding a fused Q/K/V may say of its output features (see _fused_rule)
QKV_LAYOUTS = ("interleaved", "stacked")
EMBED_WORDS = ("embed", "wte", "tok_embeddings", "word_embeddings", "embedding")
POSITION_WORDS = ("pos", "position", "positions", "positional")
# small projections between an embedding and the first block (OPT-350m): splitting them
# would gather activations on both sides for half a million parameters
REPLICATED_NAMES = {"project_in", "project_out"}
HEAD_NAMES = {"lm_head", "head", "unembed", "output", "out_head", "classifier_head"}
WEIGHT_NAMES = {"weight", "kernel", "w"}
BIAS_NAMES = {"bias", "b"}
ADAPTER_NAMES = {"lora_a", "lora_b"}
# mixture of experts: a layer holding experts (by these words in its class or attribute
# name, or a field named like "experts"/"num_experts") and its router
MOE_WORDS = ("moe", "experts")
ROUTER_NAMES = {"router", "gate", "gating", "wg", "w_gate", "routing"}
# a recurrent cell's input/hidden weights, gates stacked on dim 0 (weight_ih, w_hh, ...)
RECURRENT_TOKENS = {"ih", "hh"}


def _child(obj, key):
    if isinstance(key, jax.tree_util.GetAttrKey):
        return getattr(obj, key.name)
    if isinstance(key, jax.tree_util.SequenceKey):
        return obj[key.idx]
    if isinstance(key, jax.tree_util.DictKey):
        return obj[key.key]
    return None


def _ancestors(model, path) -> list:
    """The objects from the root down to (not including) the leaf at ``path``."""
    chain, obj = [model], model
    for key in path[:-1]:
        obj = _child(obj, key) if obj is not None else None
        chain.append(obj)
    return chain


def _tokens(name: str) -> list[str]:
    return [t for t in re.split(r"[_\W\d]+", name.lower()) if t]


_HEAD_ATTRS = ("num_heads", "n_heads", "n_head", "num_attention_heads", "heads")
_KV_HEAD_ATTRS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "n_kv_head")


def _int_attr(obj, names) -> int | None:
    for name in names:
        for holder in (obj, getattr(obj, "config", None)):
            v = getattr(holder, name, None) if holder is not None else None
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def _head_count(chain: list, kv: bool) -> int | None:
    """Attention heads of the nearest ancestor that says how many it has
    (``num_heads``, ``n_heads``, ... on the module or its ``config``); for K/V
    projections the key/value head count when it differs (grouped queries)."""
    for obj in reversed(chain):
        if obj is None:
            continue
        q = _int_attr(obj, _HEAD_ATTRS)
        if q is not None:
            return (_int_attr(obj, _KV_HEAD_ATTRS) or q) if kv else q
    return None


class _Rule(NamedTuple):
    """What the rules say of one weight: the dim ``model`` splits (``None``: the
    next in its parent's alternation, ``-1``: replicated) and why."""

    dim: int | None
    reason: str
    counts: bool = False  # a layer: it takes part in its parent's alternation
    whole: tuple[int, str] | None = None  # (count, "heads"): the split keeps these whole
    alternation: tuple[int, int] = (0, 1)  # the dims the alternation picks from
    refuse: str | None = None  # replicated, said in the warning: why



def _fields(obj) -> dict[str, Any]:
    if not isinstance(obj, eqx.Module):
        return {}
    return {f.name: getattr(obj, f.name, None) for f in dataclasses.fields(obj)}


def _ndim(x) -> int | None:
    """A field's array rank, or its layer's weight rank (a router is an array or a Linear)."""
    x = getattr(x, "weight", x)
    return x.ndim if is_array_like(x) else None
