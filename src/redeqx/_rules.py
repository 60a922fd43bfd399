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
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from ._mesh import DATA, MODEL
from ._typing import typechecked

QKV_NAMES = {"query_proj", "key_proj", "value_proj", "q_proj", "k_proj", "v_proj",
             "wq", "wk", "wv", "q", "k", "v", "qkv", "c_attn", "query", "key", "value", "qkv_proj"}
ATTN_OUT_NAMES = {"output_proj", "o_proj", "out_proj", "wo", "o", "c_proj", "dense", "proj"}
UP_NAMES = {"up", "gate", "fc1", "w1", "w3", "wi", "wi_0", "wi_1", "c_fc", "up_proj", "gate_proj", "fc_in"}
DOWN_NAMES = {"down", "fc2", "w2", "wo", "c_proj", "down_proj", "fc_out"}
EMBED_WORDS = ("embed", "wte", "tok_embeddings", "word_embeddings", "embedding")
POSITION_WORDS = ("pos", "position", "positional")
HEAD_NAMES = {"lm_head", "head", "unembed", "output", "out_head", "classifier_head"}
WEIGHT_NAMES = {"weight", "kernel", "w"}

# fsdp: leaves smaller than this many elements stay as the model-axis rule put them.
FSDP_MIN_SIZE = 2**14


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    path: str
    shape: tuple[int, ...]
    dtype: Any
    spec: P
    reason: str


def path_parts(path) -> list[str]:
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(k.name)
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            parts.append(str(k.key))
        else:
            parts.append(str(k))
    return parts


def path_str(path) -> str:
    return ".".join(path_parts(path))


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


def _classify_weight(parts: list[str], chain: list, leaf) -> tuple[int | None, str]:
    """Which dim the model axis splits by name/type, or None for 'unknown'."""
    if parts[-1] in WEIGHT_NAMES and len(parts) >= 2:
        name, module = parts[-2], chain[-1]
    else:
        name, module = parts[-1], None
    lname = name.lower()
    toks = _tokens(lname)
    in_attention = any(isinstance(o, eqx.nn.MultiheadAttention) for o in chain) or any(
        "attn" in p.lower() or "attention" in p.lower() for p in parts[:-1]
    )
    if "relative" in toks and "bias" in toks and leaf.ndim == 2:
        # T5's relative_attention_bias (buckets, heads), Swin's relative_position_bias_table
        # (positions, heads): a lookup table per head, split like the heads it feeds.
        return 1, "relative position bias: dim 1 (heads)"
    # an embedding: by type (eqx.nn.Embedding or any module class named *Embedding,
    # such as T5's 'shared' table) or by name
    is_embedding = (isinstance(module, eqx.nn.Embedding) or type(module).__name__.endswith("Embedding")
                    or any(w in lname for w in EMBED_WORDS))
    if lname == "wpe" or (is_embedding and any(t in POSITION_WORDS for t in toks)):
        return -1, "position embedding: replicated"
    if is_embedding:
        return 0, "embedding: dim 0 (vocab)"
    if lname in HEAD_NAMES or "head" in toks:
        return 0, "LM head: dim 0 (vocab)"
    if in_attention:
        if lname in QKV_NAMES:
            return 0, "attention Q/K/V: dim 0"
        if lname in ATTN_OUT_NAMES:
            return 1, "attention output: dim 1"
    if lname in UP_NAMES:
        return 0, f"'{name}': dim 0 (column parallel)"
    if lname in DOWN_NAMES:
        return 1, f"'{name}': dim 1 (row parallel)"
    if "in" in toks:
        return 0, f"'{name}': dim 0 (column parallel)"
    if "out" in toks:
        return 1, f"'{name}': dim 1 (row parallel)"
    return None, ""


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


def plan(model, mesh: Mesh, overrides: Sequence[tuple[str, P]] = (), fsdp: bool = False):
    """Returns ``(treedef, [LeafPlan | None per leaf], fallbacks)`` for ``model``."""
    if MODEL not in mesh.shape or DATA not in mesh.shape:
        raise ValueError(f"mesh must have axes ('data', 'model'), got {tuple(mesh.shape)}; build it with redeqx.make_mesh.")
    compiled = []
    for i, item in enumerate(overrides):
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[1], P)):
            raise TypeError(
                f"overrides[{i}] = {item!r}: each override is a (regex, PartitionSpec) pair, "
                "e.g. (r'blocks\\.\\d+\\.attn\\.wo', P(None, 'model'))."
            )
        compiled.append((re.compile(item[0]), item[1], item[0]))
    n_model = mesh.shape[MODEL]
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(model)
    plans: list[LeafPlan | None] = [None] * len(leaves_with_path)
    counters: dict[str, int] = {}
    weight_dims: dict[str, int] = {}  # layer path -> dim split by 'model' (for its bias)
    fallbacks: list[str] = []

    def finish(i, path, leaf, spec, reason):
        if fsdp:
            spec, did = _fsdp(spec, leaf, mesh)
            if did:
                reason += " + fsdp over data"
        plans[i] = LeafPlan(path, tuple(leaf.shape), leaf.dtype, spec, reason)

    def override(path, leaf):
        for rx, spec, raw in compiled:
            if rx.search(path):
                _check_spec(spec, leaf, path, mesh, f"override {raw!r}")
                return spec, f"override {raw!r}"
        return None

    # Pass 1: weights (ndim >= 2).
    biases = []
    for i, (kp, leaf) in enumerate(leaves_with_path):
        if not (eqx.is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct)):  # abstract models too
            continue
        parts = path_parts(kp)
        path = ".".join(parts)
        ov = override(path, leaf)
        if ov is not None:
            finish(i, path, leaf, *ov)
            continue
        if leaf.ndim < 2 or not jax.numpy.issubdtype(leaf.dtype, jax.numpy.inexact):
            biases.append((i, kp, parts, path, leaf))
            continue
        chain = _ancestors(model, kp)
        dim, reason = _classify_weight(parts, chain, leaf)
        layer_parts = parts[:-1] if parts[-1] in WEIGHT_NAMES else parts
        if dim is None:
            group = ".".join(layer_parts[:-1])
            dim = counters.get(group, 0) % 2
            counters[group] = counters.get(group, 0) + 1
            reason = f"alternating under '{group or '<root>'}': dim {dim}"
        else:
            group = ".".join(layer_parts[:-1])
            if dim in (0, 1):
                # a named layer also advances its parent's alternation
                counters[group] = dim + 1
        if dim == -1:
            finish(i, path, leaf, P(), reason)
            continue
        if leaf.shape[dim] % n_model:
            fallbacks.append(f"{path} {tuple(leaf.shape)} dim {dim}")
            finish(i, path, leaf, P(), f"replicated: dim {dim} ({leaf.shape[dim]}) not divisible by {n_model}")
            continue
        weight_dims[".".join(layer_parts)] = dim
        finish(i, path, leaf, _split_spec(leaf.ndim, dim), reason)

    # Pass 2: biases and other small leaves.
    for i, kp, parts, path, leaf in biases:
        layer = ".".join(parts[:-1])
        if parts[-1] == "bias" and weight_dims.get(layer) == 0 and leaf.ndim >= 1 and leaf.shape[0] % n_model == 0:
            finish(i, path, leaf, _split_spec(leaf.ndim, 0), "bias of a dim-0 layer: dim 0")
        else:
            finish(i, path, leaf, P(), "replicated")
    return treedef, plans, fallbacks


@typechecked
def sharding_rules(model, mesh: Mesh, *, overrides: Sequence = (), fsdp: bool = False):
    """PartitionSpecs for every array in ``model``, from the two rules.

    Returns a tree with ``model``'s structure: a ``PartitionSpec`` at each array
    leaf and ``None`` elsewhere. ``overrides`` is a list of ``(regex, spec)``;
    the first regex that matches a leaf's path (e.g. ``"blocks.0.attn.wq.weight"``,
    see `explain`) sets its spec. ``fsdp=True`` also splits each large leaf's
    largest free dim over ``data`` (ZeRO-3 style), so parameter and optimizer
    memory falls with every device.

    **Example:**

    ```python
    mesh = redeqx.make_mesh(n_model_shards=2)
    model = eqx.nn.MLP(784, 10, 256, depth=2, key=jax.random.key(0))
    specs = redeqx.sharding_rules(model, mesh)
    print(redeqx.explain(model, specs, mesh))
    ```
    """
    treedef, plans, fallbacks = plan(model, mesh, overrides, fsdp)
    if fallbacks:
        warnings.warn(
            f"redeqx.sharding_rules: {len(fallbacks)} leaf/leaves replicated because n_model_shards="
            f"{mesh.shape[MODEL]} does not divide the split dim: " + "; ".join(fallbacks)
            + ". Pick n_model_shards that divides these dims, or pass overrides=[(regex, spec)].",
            stacklevel=2,
        )
    return jax.tree_util.tree_unflatten(treedef, [p.spec if p is not None else None for p in plans])


def _per_device_shape(shape, spec: P, mesh: Mesh) -> tuple[int, ...]:
    out = list(shape)
    for d, entry in enumerate(spec):
        if entry is None:
            continue
        axes = entry if isinstance(entry, tuple) else (entry,)
        out[d] = out[d] // math.prod(mesh.shape[a] for a in axes)
    return tuple(out)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


@typechecked
def explain(model, specs, mesh: Mesh) -> str:
    """A table of where each array of ``model`` lives under ``specs``.

    One row per array: path, shape, dtype, spec, bytes per device, and why the
    rules chose that spec (or ``given`` where ``specs`` differ from the rules,
    e.g. after editing them by hand). Totals at the bottom.

    **Example:**

    ```python
    print(redeqx.explain(model, redeqx.sharding_rules(model, mesh), mesh))
    ```
    """
    _, plans, _ = plan(model, mesh)
    given = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P) or x is None)
    rows = [("path", "shape", "dtype", "spec", "per device", "why")]
    total = per_dev = 0
    arrays = [p for p in plans if p is not None]
    given_specs = [s for s in given if s is not None]
    if len(given_specs) != len(arrays):
        raise ValueError(
            f"specs has {len(given_specs)} PartitionSpecs but model has {len(arrays)} arrays; "
            "pass the specs made by redeqx.sharding_rules(model, mesh) for this model."
        )
    for p, spec in zip(arrays, given_specs):
        itemsize = np.dtype(p.dtype).itemsize
        nbytes = math.prod(p.shape) * itemsize
        dev = math.prod(_per_device_shape(p.shape, spec, mesh)) * itemsize
        total += nbytes
        per_dev += dev
        why = p.reason if spec == p.spec else "given"
        rows.append((p.path, str(p.shape), str(np.dtype(p.dtype)), str(spec), _human(dev), why))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("")
    lines.append(
        f"total {_human(total)} in {len(arrays)} arrays; per device {_human(per_dev)} "
        f"(mesh data={mesh.shape[DATA]}, model={mesh.shape[MODEL]})"
    )
    return "\n".join(lines)
