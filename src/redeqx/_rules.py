"""The two sharding rules: an Equinox model -> a tree of PartitionSpecs.

Equinox stores a linear weight as ``(out_features, in_features)``. In that
convention the rules read:

1. consecutive fully-connected layers alternate: dim 0 (column parallel), then
   dim 1 (row parallel), then dim 0 again, ...
2. attention: the Q, K and V projections split dim 0, the output projection dim 1.

Names decide first (``wq``/``q_proj``/``fc1``/``up`` -> 0, ``wo``/``fc2``/``down``
-> 1, embeddings and LM heads -> 0 on the vocabulary); linear layers with
unknown names alternate 0, 1, 0, ... under their parent, so ``eqx.nn.MLP``
alternates. The bias of a dim-0 layer is split with it; every other 1-D leaf
is replicated. A dim that ``n_model_shards`` does not divide is replicated,
said once in a warning and in `explain`.

Beyond a plain transformer: a mixture-of-experts layer splits its ``(E, ...)``
expert stacks on E when ``n_model_shards`` divides E, else all on their hidden
units alike, and replicates its router; a fused Q/K/V is split on whole heads
only under a stated ``qkv_layout = "interleaved"``, else it and its
attention's output projection stay whole; a recurrent cell's stacked gates
stay whole; a depthwise or grouped conv splits on whole groups. Each leaf's
decision is a function of its path, the modules above it and its shape
(`_classify`), plus its parent's alternation.
"""

from __future__ import annotations

import collections
import dataclasses
import difflib
import math
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from ._mesh import DATA, MODEL, check_mesh
from ._stacks import layer_axes
from ._trees import human_bytes, is_array_like, path_parts, path_str, per_device_shape
from ._typing import typechecked, warn_user

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

# fsdp: leaves smaller than this many elements stay as the model-axis rule put them.
FSDP_MIN_SIZE = 2**14


@dataclasses.dataclass(frozen=True)
class LeafSpec:
    """What the rules decided for one array: its spec and why (for `explain`)."""

    path: str
    shape: tuple[int, ...]
    dtype: Any
    spec: P
    reason: str


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


def _split_spec(ndim: int, dim: int, axis: str = MODEL) -> P:
    entries: list[Any] = [None] * ndim
    entries[dim] = axis
    return P(*entries)


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


def _holds_experts(obj) -> bool:
    """Whether module ``obj`` holds experts: a field named like ``experts`` /
    ``num_experts``, or a router (a field named router/gate/...) beside weights
    of a higher rank than the router's (stacked experts)."""
    fields = _fields(obj)
    if any("experts" in f.lower() for f in fields):
        return True
    router = next((_ndim(v) for f, v in fields.items() if f.lower() in ROUTER_NAMES), None)
    return router is not None and any((_ndim(v) or 0) > router for v in fields.values())


def _is_moe(obj, name: str, above: list[str]) -> bool:
    """Whether ``obj`` (the attribute ``name`` of its parent, ``above`` the path
    to that parent) is a mixture-of-experts layer or its block of expert
    weights: it holds experts, or its class or attribute name says ``moe`` or
    ``experts`` and it is not itself one of the experts (in a list of them)."""
    if _holds_experts(obj):
        return True
    if not _fields(obj) or name.isdigit() or any("expert" in p.lower() for p in above):
        return False
    return any(w in name.lower() or w in type(obj).__name__.lower() for w in MOE_WORDS)


def _moe_role(parts: list[str], chain: list, shape: tuple[int, ...]) -> str | None:
    """``"router"`` for a router's weight (at most 2-D, under a field named
    router/gate/... of a module holding experts), ``"stack"`` for an
    ``(E, ...)`` stack of expert weights (rank >= 3, held by a mixture-of-experts
    layer or by its block of experts; not a conv's kernel)."""
    if len(shape) <= 2:
        for j in range(len(chain) - 1, -1, -1):
            if parts[j].lower() in ROUTER_NAMES and _holds_experts(chain[j]):
                return "router"
        return None
    if isinstance(chain[-1], (eqx.nn.Conv, eqx.nn.ConvTranspose)):
        return None
    names = [""] + parts  # names[j]: the attribute chain[j] sits under
    for j in (len(chain) - 1, len(chain) - 2):
        if j >= 0 and _is_moe(chain[j], names[j], parts[:max(j - 1, 0)]):
            return "stack"
    return None


def _qkv_layout(chain: list) -> str | None:
    """The ``qkv_layout`` of the nearest module that states one, checked."""
    for obj in reversed(chain):
        layout = getattr(obj, "qkv_layout", None)
        if layout is not None:
            if layout not in QKV_LAYOUTS:
                raise ValueError(
                    f"{type(obj).__name__}.qkv_layout = {layout!r}; say 'interleaved' when the fused layer's "
                    "output features are (heads, 3, head_dim) (each head's q, k, v side by side), or 'stacked' "
                    "when they are (3, heads, head_dim) (all of Q, then K, then V)."
                )
            return layout
    return None


def _fused_rule(chain: list, n_model: int) -> _Rule:
    """The rule for a fused Q/K/V layer, ``(parts * heads * head_dim, in)``.

    Only an ``"interleaved"`` layout, ``(heads, 3, head_dim)``, puts whole heads
    of each of Q, K and V in one contiguous block of rows, so only it is split
    (dim 0, on whole heads). Under the ``(3, heads, head_dim)`` layout of timm's
    ``qkv`` or a ``chunk(3)`` a split of dim 0 gives one device all of Q and
    another all of V, and no PartitionSpec splits each third: it stays whole,
    quietly when the module says so (``"stacked"``), with a warning when
    nothing says which layout it is.
    """
    layout = _qkv_layout(chain)
    if layout == "interleaved":
        return _Rule(0, "fused Q/K/V, interleaved per head: dim 0", counts=True, whole=_whole_heads(chain, kv=True))
    if layout == "stacked":
        return _Rule(-1, "fused Q/K/V, (3, heads, head_dim): replicated, a split of dim 0 would not keep heads whole")
    return _Rule(-1, "fused Q/K/V", refuse=(
        "fused Q/K/V of unknown layout, which a split of dim 0 could cut mid-head (kept whole, with its "
        "attention's output projection); say qkv_layout = "
        "'interleaved' ((heads, 3, head_dim): split on whole heads) or 'stacked' ((3, heads, head_dim), "
        "timm's qkv or a chunk(3): replicated, quietly) on its attention module"))


def _fused_splits(chain: list, n_model: int) -> bool:
    heads = _head_count(chain, kv=True)
    return _qkv_layout(chain) == "interleaved" and (heads is None or heads % n_model == 0)


def _fused_holder(chain: list) -> int | None:
    """The index in ``chain`` of the nearest module holding a fused Q/K/V layer."""
    for j in range(len(chain) - 1, -1, -1):
        if any(f.lower() in FUSED_NAMES and (_ndim(v) or 0) >= 2 for f, v in _fields(chain[j]).items()):
            return j
    return None


def _whole_heads(chain: list, kv: bool) -> tuple[int, str] | None:
    heads = _head_count(chain, kv=kv)
    return None if heads is None else (heads, "heads")


def _classify(parts: list[str], chain: list, shape: tuple[int, ...], vocab_sizes: set[int], n_model: int) -> _Rule:
    """What the rules say of the weight at ``parts`` (``chain``: the objects from
    the root down to the one holding it). A function of the path, the modules
    above the leaf and its shape only."""
    is_layer = parts[-1] in WEIGHT_NAMES  # a layer's weight, wherever the layer sits (the root too)
    module = chain[-1]
    name = (parts[-2] if len(parts) >= 2 else "") if is_layer else parts[-1]
    lname = name.lower()
    toks = _tokens(lname)
    in_attention = any(isinstance(o, eqx.nn.MultiheadAttention) for o in chain) or any(
        "attn" in p.lower() or "attention" in p.lower() for p in parts[:-1]
    )
    if "relative" in toks and "bias" in toks and len(shape) == 2:
        # T5's relative_attention_bias (buckets, heads), Swin's relative_position_bias_table
        # (positions, heads): a lookup table per head, split like the heads it feeds.
        return _Rule(1, "relative position bias: dim 1 (heads)")
    if RECURRENT_TOKENS & set(_tokens(parts[-1])) or isinstance(module, (eqx.nn.GRUCell, eqx.nn.LSTMCell)):
        return _Rule(-1, "recurrent cell: its gates are stacked on dim 0, so a split would give a device whole "
                         "gates instead of a slice of each: replicated")
    moe = _moe_role(parts, chain, shape)
    if moe == "router":
        return _Rule(-1, "MoE router: replicated (every device routes every token)")
    if moe == "stack":
        n_experts, last = shape[0], len(shape) - 1
        if n_experts % n_model == 0:
            return _Rule(0, f"expert stack: dim 0 ({n_experts} experts, expert parallel)")
        why = f"tensor parallel: {n_experts} experts not divisible by n_model_shards={n_model}"
        role = (1 if lname in UP_NAMES or "in" in toks else last if lname in DOWN_NAMES or "out" in toks else None)
        return _Rule(role, f"expert stack, {why}" + (f": dim {role}" if role is not None else ""),
                     counts=True, alternation=(1, last))
    if lname in FUSED_NAMES:
        return _fused_rule(chain, n_model)
    j = _fused_holder(chain)
    if j is not None and (parts[j] in ATTN_OUT_NAMES or "out" in _tokens(parts[j])) and not _fused_splits(chain, n_model):
        # the heads are not split, so no head-split activations reach the output
        # projection: it stays whole too, as under a head count n_model_shards does not divide
        return _Rule(-1, "attention output, its fused Q/K/V not split: replicated")
    # an embedding: by type (eqx.nn.Embedding or any module class named *Embedding,
    # such as T5's 'shared' table) or by name
    is_embedding = (isinstance(module, eqx.nn.Embedding) or type(module).__name__.endswith("Embedding")
                    or any(w in lname for w in EMBED_WORDS))
    if lname == "wpe" or (is_embedding and any(t in POSITION_WORDS for t in toks)) or (
            not is_layer and any(t in POSITION_WORDS for t in toks)):
        return _Rule(-1, "position embedding: replicated")
    if is_embedding:
        return _Rule(0, "embedding: dim 0 (vocab)")
    if lname in REPLICATED_NAMES:
        return _Rule(-1, "embedding projection: replicated")
    if is_layer and isinstance(module, (eqx.nn.Conv, eqx.nn.ConvTranspose)) and module.groups > 1:
        # output channels come in groups, each from its own input channels: whole groups per
        # device keep every group's input where the previous column-parallel layer left it
        what = "depthwise conv: dim 0 (channels)" if shape[1] == 1 else "grouped conv: dim 0 (whole groups)"
        return _Rule(0, what, counts=True, whole=(module.groups, "groups"))
    if lname in HEAD_NAMES or "head" in toks:
        if shape[0] in vocab_sizes or (not vocab_sizes and lname in ("lm_head", "unembed")):
            return _Rule(0, "LM head: dim 0 (vocab)", counts=is_layer)
        if not is_layer:
            return _Rule(-1, "head parameter (not a layer): replicated")
        return _Rule(None, "classifier head", counts=True)  # an ordinary last layer: it alternates
    if in_attention:
        if lname in QKV_NAMES:
            return _Rule(0, "attention Q/K/V: dim 0", counts=True,
                         whole=_whole_heads(chain, kv=lname not in Q_NAMES))
        if lname in ATTN_OUT_NAMES:
            return _Rule(1, "attention output: dim 1", counts=True, whole=_whole_heads(chain, kv=False))
    if lname in UP_NAMES or "in" in toks:
        return _Rule(0, f"'{name}': dim 0 (column parallel)", counts=is_layer)
    if lname in DOWN_NAMES or "out" in toks:
        return _Rule(1, f"'{name}': dim 1 (row parallel)", counts=is_layer)
    if not is_layer:
        # a class token, a learned table, a scale: not a layer, so it takes no part in the alternation
        return _Rule(-1, "parameter array (not a layer): replicated")
    return _Rule(None, "", counts=True)


def _check_spec(spec: P, leaf, path: str, mesh: Mesh, where: str) -> None:
    if len(spec) > leaf.ndim:
        raise ValueError(
            f"{where}: spec {spec} for '{path}' has {len(spec)} entries but the leaf has shape {leaf.shape}; "
            f"give at most {leaf.ndim} entries."
        )
    for d, entry in enumerate(spec):
        if entry is None:
            continue
        axes = entry if isinstance(entry, tuple) else (entry,)
        size = 1
        for a in axes:
            if a not in mesh.shape:
                raise ValueError(
                    f"{where}: spec {spec} for '{path}' names axis {a!r}, but the mesh has axes {tuple(mesh.shape)}."
                )
            size *= mesh.shape[a]
        if leaf.shape[d] % size:
            raise ValueError(
                f"{where}: spec {spec} for '{path}' splits dim {d} of size {leaf.shape[d]} over {size} devices, "
                f"which does not divide it; pick a spec whose axes divide shape {leaf.shape}."
            )


def _fsdp(spec: P, leaf, mesh: Mesh) -> tuple[P, bool]:
    n_data = mesh.shape[DATA]
    if n_data == 1 or leaf.size < FSDP_MIN_SIZE:
        return spec, False
    entries = list(spec) + [None] * (leaf.ndim - len(spec))
    free = [d for d in range(leaf.ndim) if entries[d] is None and leaf.shape[d] % n_data == 0]
    if not free:
        return spec, False
    d = max(free, key=lambda i: leaf.shape[i])
    entries[d] = DATA
    return P(*entries), True


def _compile_overrides(overrides, mesh: Mesh) -> list:
    compiled = []
    for i, item in enumerate(overrides):
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], P)):
            raise TypeError(
                f"overrides[{i}] = {item!r}: each override is a (regex, PartitionSpec) pair, "
                "e.g. (r'blocks\\.\\d+\\.attn\\.wo', P(None, 'model'))."
            )
        try:
            compiled.append((re.compile(item[0]), item[1], item[0]))
        except re.error as e:
            raise ValueError(f"overrides[{i}]: {item[0]!r} is not a valid regular expression ({e}).") from None
    return compiled


def _router_axes(parts, chain, axes: dict[str, int]) -> int | None:
    """How many layer axes the router of the nearest module holding experts
    above the leaf carries (``axes``: each array path's count), or None when
    no such module or router is found."""
    for j in range(len(chain) - 1, -1, -1):
        if chain[j] is not None and _holds_experts(chain[j]):
            for f, v in _fields(chain[j]).items():
                if f.lower() in ROUTER_NAMES:
                    path = ".".join([*parts[:j], f] + (["weight"] if hasattr(v, "weight") else []))
                    return axes.get(path)
            return None
    return None


def _peeled(parts, chain, leaf, n: int, axes: dict[str, int]) -> int:
    """How many of a leaf's ``n`` leading stacked axes are layer axes. Experts
    built with ``eqx.filter_vmap`` look like a stack of layers too: a leading
    axis that makes the leaf an expert stack is the experts' axis, unless the
    experts' router is stacked alike (then a stack of whole mixture-of-experts
    blocks was built, and each block's router and layers carry the layer axis)."""
    if n and _moe_role(parts, chain, tuple(leaf.shape)) == "stack" and \
            _moe_role(parts, chain, tuple(leaf.shape[n:])) != "stack":
        return min(n, _router_axes(parts, chain, axes) or 0)
    return n


def _lifted(spec: P, n: int) -> P:
    """A one-layer spec on a leaf with ``n`` leading layer axes (never split)."""
    return P(*([None] * n), *spec) if n and len(spec) else spec


def leaf_specs(model, mesh: Mesh, overrides: Sequence[tuple[str, P]] = (), fsdp: bool = False, name: str | None = None):
    """Returns ``(treedef, [LeafSpec | None per leaf], fallbacks)`` for ``model``;
    ``fallbacks`` are ``(path and shape, why, loud)`` for leaves replicated
    because ``n_model_shards`` cannot split them as the rules would."""
    mesh = check_mesh(mesh)
    prefix = f"{name}." if name else ""
    compiled = _compile_overrides(overrides, mesh)
    n_model = mesh.shape[MODEL]
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(model)
    decided: list[LeafSpec | None] = [None] * len(leaves_with_path)
    counters: dict[str, int] = {}
    weight_dims: dict[str, int] = {}  # layer path -> dim split by 'model' (for its bias and adapters)
    fallbacks: list[tuple[str, str, bool]] = []
    used = [False] * len(compiled)

    def finish(i, path, leaf, spec, reason, final=False):
        """``leaf`` is one layer of a stacked leaf; a final spec (an override) is the whole leaf's."""
        if fsdp and not final:
            spec, did = _fsdp(spec, leaf, mesh)  # within a layer
            if did:
                reason += " + fsdp over data"
        n, layers = stacked.get(i, (0, ()))
        if n:
            axes = " x ".join(map(str, layers))
            reason = f"layer axis (L={axes}), each layer: {reason}"
            spec = spec if final else _lifted(spec, n)
        whole = leaves_with_path[i][1]
        decided[i] = LeafSpec(path, tuple(whole.shape), whole.dtype, spec, reason)

    def override(path, i):
        whole = leaves_with_path[i][1]
        for j, (rx, spec, raw) in enumerate(compiled):
            if rx.search(path):
                used[j] = True
                _check_spec(spec, whole, prefix + path, mesh, f"override {raw!r}")
                return spec, f"override '{raw}'"
        return None

    # Stacked layers: each leaf is decided as one layer of its stack (`layer`, its leading
    # layer axes peeled off), and its spec gets None on those axes (`_lifted`).
    arrays, stacked = [], {}
    with_axes = list(zip([(i, x) for i, x in enumerate(leaves_with_path) if is_array_like(x[1])], layer_axes(model)))
    axes = {path_str(kp): n for (_, (kp, _)), n in with_axes}
    for (i, (kp, leaf)), n in with_axes:
        n = _peeled(path_parts(kp), _ancestors(model, kp), leaf, n, axes)
        if n:
            stacked[i] = (n, tuple(leaf.shape[:n]))
            leaf = jax.ShapeDtypeStruct(leaf.shape[n:], leaf.dtype)  # one layer
        arrays.append((i, kp, leaf))
    vocab_sizes = set()
    for i, kp, leaf in arrays:  # the vocabularies, to tell an LM head from a classifier head
        parts = path_parts(kp)
        chain = _ancestors(model, kp)
        if leaf.ndim == 2 and _classify(parts, chain, tuple(leaf.shape), set(), n_model).reason.startswith("embedding"):
            vocab_sizes.add(leaf.shape[0])

    def fall_back(i, path, leaf, loud, reason, why):
        fallbacks.append((f"{prefix}{path} {tuple(leaf.shape)}", why, loud))
        finish(i, path, leaf, P(), f"{reason}: replicated, {why}")

    # Pass 1: weights (ndim >= 2, not biases or adapters). An override replaces the
    # rule's choice for its leaf only: the alternation around it goes on as if it
    # were not there.
    later = []
    for i, kp, leaf in arrays:
        parts = path_parts(kp)
        path = ".".join(parts)
        ov = override(path, i)
        if (leaf.ndim < 2 or parts[-1] in BIAS_NAMES or parts[-1] in ADAPTER_NAMES
                or not jax.numpy.issubdtype(leaf.dtype, jax.numpy.inexact)):
            if ov is not None:
                finish(i, path, leaf, ov[0], ov[1], final=True)
            else:
                later.append((i, kp, parts, path, leaf))
            continue
        chain = _ancestors(model, kp)
        rule = _classify(parts, chain, tuple(leaf.shape), vocab_sizes, n_model)
        dim, reason = rule.dim, rule.reason
        layer_parts = parts[:-1] if parts[-1] in WEIGHT_NAMES else parts
        group = ".".join(layer_parts[:-1])
        if dim is None:
            dim = rule.alternation[counters.get(group, 0) % 2]
            counters[group] = counters.get(group, 0) + 1
            reason = f"{reason + ': ' if reason else ''}alternating under '{group or '<root>'}': dim {dim}"
        elif rule.counts and dim in rule.alternation:
            counters[group] = rule.alternation.index(dim) + 1  # a named layer also advances its parent's alternation
        if ov is not None:
            ov_spec = ov[0]
            n = stacked.get(i, (0,))[0]  # the override names the whole leaf: its out dim follows the layer axes
            if len(ov_spec) > n and ov_spec[n] is not None and MODEL in _axes_of(ov_spec[n]):
                weight_dims[".".join(layer_parts)] = 0  # its bias and adapters follow the override
            finish(i, path, leaf, ov_spec, f"{ov[1]} (rules: {reason})", final=True)
            continue
        if rule.refuse is not None:
            fall_back(i, path, leaf, n_model > 1, reason, rule.refuse)
            continue
        if dim == -1:
            finish(i, path, leaf, P(), reason)
            continue
        if rule.whole is not None and rule.whole[0] % n_model:
            count, what = rule.whole
            fall_back(i, path, leaf, True, reason.split(":")[0],
                      f"{count} {what} not divisible by n_model_shards={n_model} ({what} are never split)")
            continue
        if leaf.shape[dim] % n_model:
            # a dim of 1 (a value head's output) has nothing to split: quiet
            fall_back(i, path, leaf, leaf.shape[dim] >= n_model, reason,
                      f"dim {dim} ({leaf.shape[dim]}) not divisible by n_model_shards={n_model}")
            continue
        weight_dims[".".join(layer_parts)] = dim
        finish(i, path, leaf, _split_spec(leaf.ndim, dim), reason)

    # Pass 2: biases, adapters and other small leaves, which follow their layer.
    for i, kp, parts, path, leaf in later:
        layer = ".".join(parts[:-1])
        dim = weight_dims.get(layer)
        if (leaf.ndim == 1 and "logits" in _tokens(parts[-1]) and leaf.shape[0] in vocab_sizes
                and leaf.shape[0] % n_model == 0):  # BART's final_logits_bias: with the vocab-split logits
            finish(i, path, leaf, P(MODEL), "logits bias: dim 0 (vocab)")
        elif parts[-1] in BIAS_NAMES and dim == 0 and leaf.ndim >= 1 and leaf.shape[0] % n_model == 0:
            finish(i, path, leaf, _split_spec(leaf.ndim, 0), "bias of a dim-0 layer: dim 0")
        elif parts[-1] in BIAS_NAMES:
            finish(i, path, leaf, P(), "bias: replicated" + (" (its layer is not split on dim 0)" if leaf.ndim else ""))
        elif parts[-1] in ADAPTER_NAMES and leaf.ndim == 2:
            # LoRA: x -> x A^T B^T with A (rank, in), B (out, rank). B splits on out with a
            # column-parallel layer, A on in with a row-parallel one; the rank is never split.
            split = {("lora_b", 0): 0, ("lora_a", 1): 1}.get((parts[-1], dim))
            if split is not None and leaf.shape[split] % n_model == 0:
                finish(i, path, leaf, _split_spec(2, split), f"adapter of a dim-{dim} layer: dim {split}")
            else:
                finish(i, path, leaf, P(), "adapter: replicated")
        else:
            finish(i, path, leaf, P(), "replicated")

    unused = [raw for (rx, spec, raw), u in zip(compiled, used) if not u]
    if unused:
        paths = [".".join(path_parts(kp)) for _, kp, _ in arrays]
        near = difflib.get_close_matches(unused[0].replace("\\", ""), paths, n=5, cutoff=0.3) or paths[:5]
        raise ValueError(
            f"override '{unused[0]}' matches no array path of the {name or 'model'}; paths look like: "
            + ", ".join(near) + ". Overrides are regexes searched in these paths (see redeqx.explain)."
        )
    return treedef, decided, fallbacks


def _axes_of(entry) -> tuple:
    return entry if isinstance(entry, tuple) else (entry,)


# what the latest `sharding_rules` calls decided, so `explain` can give each leaf's reason
_RECENT: collections.OrderedDict = collections.OrderedDict()


@typechecked
def sharding_rules(model, mesh: Mesh, *, overrides: Sequence = (), fsdp: bool = False, name: str | None = None):
    """PartitionSpecs for every array in ``model``, from the two rules.

    Returns a tree with ``model``'s structure: a ``PartitionSpec`` at each array
    leaf and ``None`` elsewhere. ``model`` may be abstract (``jax.ShapeDtypeStruct``
    leaves from ``eqx.filter_eval_shape``), so a model too large for one device
    gets its plan before it exists.

    - ``overrides`` is a list of ``(regex, spec)``; the first regex found in a
      leaf's path (e.g. ``"blocks.0.attn.wq.weight"``, see `explain`) sets its
      spec, finally (``fsdp`` does not re-split it). A regex that matches no
      path is an error listing similar paths.
    - ``fsdp=True`` also splits each large leaf's largest free dim over
      ``data`` (ZeRO-3 style), so parameter and optimizer memory falls with
      every device.
    - ``name`` (e.g. ``"critic"``) prefixes the paths in warnings and errors,
      for states with several models.

    Attention projections are split on whole heads only; leaves whose split
    dim ``n_model_shards`` does not divide are replicated, said in one
    warning (pointing at your line) and in `explain`. Mixture-of-experts
    stacks, fused Q/K/V (``qkv_layout = "interleaved"`` or ``"stacked"`` on
    the attention module says its layout), recurrent cells and grouped convs
    follow the README's "The two rules".

    **Example:**

    ```python
    mesh = redeqx.make_mesh(n_model_shards=2)
    model = eqx.nn.MLP(784, 10, 256, depth=2, key=jax.random.key(0))
    specs = redeqx.sharding_rules(model, mesh)
    print(redeqx.explain(model, specs, mesh))
    ```
    """
    treedef, decided, fallbacks = leaf_specs(model, mesh, overrides, fsdp, name)
    loud = [(leaf, why) for leaf, why, is_loud in fallbacks if is_loud]
    if loud:
        by_why: dict[str, list[str]] = {}  # one reason said once for every leaf it holds for
        for leaf, why in loud:
            by_why.setdefault(why, []).append(leaf)
        who = f"(name={name!r})" if name else ""
        warn_user(
            f"redeqx.sharding_rules{who}: {len(loud)} leaf/leaves replicated, as n_model_shards="
            f"{mesh.shape[MODEL]} cannot split them as the rules would: "
            + "; ".join(", ".join(leaves) + ": " + why for why, leaves in by_why.items())
            + ". Where a dim or count does not divide, pick n_model_shards that divides it; or pass "
            "overrides=[(regex, spec)]."
        )
    specs = jax.tree_util.tree_unflatten(treedef, [p.spec if p is not None else None for p in decided])
    _RECENT[id(specs)] = (specs, decided)
    while len(_RECENT) > 32:
        _RECENT.popitem(last=False)
    return specs


@typechecked
def explain(model, specs, mesh: Mesh) -> str:
    """A table of where each array of ``model`` lives under ``specs``.

    One row per array: path, shape, dtype, spec, bytes per device, and why
    (the rule, the override or ``fsdp`` that placed it; ``given`` where
    ``specs`` differ from anything the rules would say, e.g. edited by hand).
    Totals at the bottom, with the mesh and what it means for the batch.

    **Example:**

    ```python
    print(redeqx.explain(model, redeqx.sharding_rules(model, mesh), mesh))
    ```
    """
    mesh = check_mesh(mesh)
    recent = _RECENT.get(id(specs))
    candidates = [recent[1]] if recent is not None and recent[0] is specs else []
    candidates += [leaf_specs(model, mesh)[1], leaf_specs(model, mesh, fsdp=True)[1]]
    by_path = [{p.path: p for p in decided if p is not None} for decided in candidates]
    m_leaves = jax.tree_util.tree_flatten_with_path(model, is_leaf=lambda x: x is None)[0]
    s_leaves = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P) or x is None)
    if len(m_leaves) != len(s_leaves):
        raise ValueError(
            f"specs has {len(s_leaves)} leaves but model has {len(m_leaves)}; "
            "pass the specs made by redeqx.sharding_rules(model, mesh) for this model."
        )
    rows = [("path", "shape", "dtype", "spec", "per device", "why")]
    total = per_dev = n_arrays = 0
    for (kp, leaf), spec in zip(m_leaves, s_leaves):
        if not is_array_like(leaf):
            continue
        path = ".".join(path_parts(kp))
        spec = P() if spec is None else spec
        found = [d[path] for d in by_path if path in d]
        why = next((p.reason for p in found if p.spec == spec), None)
        if why is None:
            why = f"given (rules: {found[0].spec}, {found[0].reason})" if found else "given"
        itemsize = np.dtype(leaf.dtype).itemsize
        dev = math.prod(per_device_shape(leaf.shape, spec, mesh)) * itemsize
        total += math.prod(leaf.shape) * itemsize
        per_dev += dev
        n_arrays += 1
        rows.append((path, str(tuple(leaf.shape)), str(np.dtype(leaf.dtype)), str(spec), human_bytes(dev), why))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("")
    n_data = mesh.shape[DATA]
    lines.append(
        f"total {human_bytes(total)} in {n_arrays} arrays; per device {human_bytes(per_dev)} "
        f"(mesh data={n_data}, model={mesh.shape[MODEL]}); a step's global batch is "
        f"per_device_batch_size x {n_data} (data) rows"
    )
    return "\n".join(lines)
