"""The name rules as an ordered table: the first entry that speaks for a leaf decides it.

Each entry is a small function of a `Leaf` (its path, the modules above it,
its shape) returning a `_Rule` or None. A new convention is one more entry.
"""

from __future__ import annotations

from typing import NamedTuple

import equinox as eqx

from ._names import (
    ATTN_OUT_NAMES, DOWN_NAMES, EMBED_WORDS, FUSED_NAMES, HEAD_NAMES, POSITION_WORDS, Q_NAMES, QKV_NAMES,
    RECURRENT_TOKENS, REPLICATED_NAMES, UP_NAMES, WEIGHT_NAMES, _Rule, _tokens,
)
from ._names_special import _fused_holder, _fused_rule, _fused_splits, _moe_role, _whole_heads


class Leaf(NamedTuple):
    parts: list[str]
    chain: list  # the objects from the root down to the one holding the leaf
    shape: tuple[int, ...]
    vocab_sizes: set[int]
    n_model: int
    is_layer: bool  # a layer's weight (named weight/kernel/w), wherever the layer sits
    name: str  # the layer's name for a weight, else the leaf's own
    toks: list[str]

    @property
    def lname(self) -> str:
        return self.name.lower()

    @property
    def module(self):
        return self.chain[-1]

    @property
    def is_embedding(self) -> bool:
        """By type (eqx.nn.Embedding, any class named *Embedding such as T5's shared table) or by name."""
        return (isinstance(self.module, eqx.nn.Embedding) or type(self.module).__name__.endswith("Embedding")
                or any(w in self.lname for w in EMBED_WORDS))


def relative_bias(x: Leaf):
    # T5's relative_attention_bias (buckets, heads), Swin's relative_position_bias_table: per head
    if "relative" in x.toks and "bias" in x.toks and len(x.shape) == 2:
        return _Rule(1, "relative position bias: dim 1 (heads)")


def recurrent(x: Leaf):
    if RECURRENT_TOKENS & set(_tokens(x.parts[-1])) or isinstance(x.module, (eqx.nn.GRUCell, eqx.nn.LSTMCell)):
        return _Rule(-1, "recurrent cell: its gates are stacked on dim 0, so a split would give a device whole "
                         "gates instead of a slice of each: replicated")


def experts(x: Leaf):
    moe = _moe_role(x.parts, x.chain, x.shape)
    if moe == "router":
        return _Rule(-1, "MoE router: replicated (every device routes every token)")
    if moe == "stack":
        n_experts, last = x.shape[0], len(x.shape) - 1
        if n_experts % x.n_model == 0:
            return _Rule(0, f"expert stack: dim 0, experts {n_experts} -> {n_experts // x.n_model} per device "
                            "(expert parallel)")
        why = f"tensor parallel: {n_experts} experts not divisible by n_model_shards={x.n_model}"
        role = (1 if x.lname in UP_NAMES or "in" in x.toks else
                last if x.lname in DOWN_NAMES or "out" in x.toks else None)
        return _Rule(role, f"expert stack, {why}" + (f": dim {role}" if role is not None else ""),
                     counts=True, alternation=(1, last))


def fused_qkv(x: Leaf):
    if x.lname in FUSED_NAMES:
        return _fused_rule(x.chain, x.n_model)
    j = _fused_holder(x.chain)
    if j is not None and (x.parts[j] in ATTN_OUT_NAMES or "out" in _tokens(x.parts[j])) \
            and not _fused_splits(x.chain, x.n_model):
        # no head-split activations reach the output projection: it stays whole too
        return _Rule(-1, "attention output, its fused Q/K/V not split: replicated")


def embeddings(x: Leaf):
    if x.lname == "wpe" or (x.is_embedding and any(t in POSITION_WORDS for t in x.toks)) or (
            not x.is_layer and any(t in POSITION_WORDS for t in x.toks)):
        return _Rule(-1, "position embedding: replicated")
    if x.is_embedding:
        return _Rule(0, "embedding: dim 0 (vocab)")
    if x.lname in REPLICATED_NAMES:
        return _Rule(-1, "embedding projection: replicated")


def grouped_conv(x: Leaf):
    # whole groups per device keep every group's input where the previous layer left it
    if x.is_layer and isinstance(x.module, (eqx.nn.Conv, eqx.nn.ConvTranspose)) and x.module.groups > 1:
        what = "depthwise conv: dim 0 (channels)" if x.shape[1] == 1 else "grouped conv: dim 0 (whole groups)"
        return _Rule(0, what, counts=True, whole=(x.module.groups, "groups"))


def heads(x: Leaf):
    if x.lname in HEAD_NAMES or "head" in x.toks:
        if x.shape[0] in x.vocab_sizes or (not x.vocab_sizes and x.lname in ("lm_head", "unembed")):
            return _Rule(0, "LM head: dim 0 (vocab)", counts=x.is_layer)
        if not x.is_layer:
            return _Rule(-1, "head parameter (not a layer): replicated")
        return _Rule(None, "classifier head", counts=True)  # an ordinary last layer: it alternates


def attention(x: Leaf):
    in_attention = any(isinstance(o, eqx.nn.MultiheadAttention) for o in x.chain) or any(
        "attn" in p.lower() or "attention" in p.lower() for p in x.parts[:-1])
    if in_attention and x.lname in QKV_NAMES:
        return _Rule(0, "attention Q/K/V: dim 0", counts=True, whole=_whole_heads(x.chain, kv=x.lname not in Q_NAMES))
    if in_attention and x.lname in ATTN_OUT_NAMES:
        return _Rule(1, "attention output: dim 1", counts=True, whole=_whole_heads(x.chain, kv=False))


def up_down(x: Leaf):
    if x.lname in UP_NAMES or "in" in x.toks:
        return _Rule(0, f"'{x.name}': dim 0 (column parallel)", counts=x.is_layer)
    if x.lname in DOWN_NAMES or "out" in x.toks:
        return _Rule(1, f"'{x.name}': dim 1 (row parallel)", counts=x.is_layer)


def otherwise(x: Leaf):
    if not x.is_layer:  # a class token, a learned table, a scale: no part in the alternation
        return _Rule(-1, UNPLACED)
    return _Rule(None, "", counts=True)


UNPLACED = "parameter array (not a layer): replicated"
NAME_RULES = (relative_bias, recurrent, experts, fused_qkv, embeddings, grouped_conv, heads, attention, up_down,
              otherwise)


def classify(parts: list[str], chain: list, shape: tuple[int, ...], vocab_sizes: set[int], n_model: int) -> _Rule:
    """What the name rules say of the weight at ``parts``: the first of `NAME_RULES` that speaks."""
    is_layer = parts[-1].lower() in WEIGHT_NAMES
    name = (parts[-2] if len(parts) >= 2 else "") if is_layer else parts[-1]
    leaf = Leaf(parts, chain, shape, vocab_sizes, n_model, is_layer, name, _tokens(name.lower()))
    for rule in NAME_RULES:
        found = rule(leaf)
        if found is not None:
            return found
    raise AssertionError("otherwise() always decides")
