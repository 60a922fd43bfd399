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

import collections
import dataclasses
import difflib
import math
import re
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from ._mesh import DATA, MODEL, check_mesh
from ._trees import human_bytes, path_parts, path_str, per_device_shape
from ._typing import typechecked, warn_user

Q_NAMES = {"query_proj", "q_proj", "wq", "q", "query", "qkv", "c_attn", "qkv_proj"}  # fused QKV counts query heads
QKV_NAMES = Q_NAMES | {"key_proj", "value_proj", "k_proj", "v_proj", "wk", "wv", "k", "v", "key", "value"}
ATTN_OUT_NAMES = {"output_proj", "o_proj", "out_proj", "wo", "o", "c_proj", "dense", "proj"}
UP_NAMES = {"up", "gate", "fc1", "w1", "w3", "wi", "wi_0", "wi_1", "c_fc", "up_proj", "gate_proj", "fc_in"}
DOWN_NAMES = {"down", "fc2", "w2", "wo", "c_proj", "down_proj", "fc_out"}
EMBED_WORDS = ("embed", "wte", "tok_embeddings", "word_embeddings", "embedding")
POSITION_WORDS = ("pos", "position", "positions", "positional")
# small projections between an embedding and the first block (OPT-350m): splitting them
# would gather activations on both sides for half a million parameters
REPLICATED_NAMES = {"project_in", "project_out"}
HEAD_NAMES = {"lm_head", "head", "unembed", "output", "out_head", "classifier_head"}
WEIGHT_NAMES = {"weight", "kernel", "w"}
BIAS_NAMES = {"bias", "b"}
ADAPTER_NAMES = {"lora_a", "lora_b"}

# fsdp: leaves smaller than this many elements stay as the model-axis rule put them.
FSDP_MIN_SIZE = 2**14


@dataclasses.dataclass(frozen=True)
class LeafPlan:
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


_HEAD_ATTRS = ("num_heads", "n_heads", "n_head", "num_attention_heads")
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


def _classify_weight(parts: list[str], chain: list, leaf, vocab_sizes: set[int]) -> tuple[int | None, str, str]:
    """``(dim, reason, kind)``: which dim the model axis splits (``None``:
    unknown, alternate; ``-1``: replicate), why, and the kind of leaf
    (``"attention_q"``, ``"attention_kv"``, ``"attention_out"`` for head checks,
    ``"layer"``, ``"bare"`` for a parameter array that is not a layer's)."""
    is_layer = parts[-1] in WEIGHT_NAMES and len(parts) >= 2
    if is_layer:
        name, module = parts[-2], chain[-1]
    else:
        name, module = parts[-1], None
    lname = name.lower()
    toks = _tokens(lname)
    kind = "layer" if is_layer else "bare"
    in_attention = any(isinstance(o, eqx.nn.MultiheadAttention) for o in chain) or any(
        "attn" in p.lower() or "attention" in p.lower() for p in parts[:-1]
    )
    if "relative" in toks and "bias" in toks and leaf.ndim == 2:
        # T5's relative_attention_bias (buckets, heads), Swin's relative_position_bias_table
        # (positions, heads): a lookup table per head, split like the heads it feeds.
        return 1, "relative position bias: dim 1 (heads)", "bare"
    # an embedding: by type (eqx.nn.Embedding or any module class named *Embedding,
    # such as T5's 'shared' table) or by name
    is_embedding = (isinstance(module, eqx.nn.Embedding) or type(module).__name__.endswith("Embedding")
                    or any(w in lname for w in EMBED_WORDS))
    if lname == "wpe" or (is_embedding and any(t in POSITION_WORDS for t in toks)) or (
            not is_layer and any(t in POSITION_WORDS for t in toks)):
        return -1, "position embedding: replicated", "bare"
    if is_embedding:
        return 0, "embedding: dim 0 (vocab)", "bare"
    if lname in REPLICATED_NAMES:
        return -1, "embedding projection: replicated", "bare"
    if lname in HEAD_NAMES or "head" in toks:
        if leaf.shape[0] in vocab_sizes or (not vocab_sizes and lname in ("lm_head", "unembed")):
            return 0, "LM head: dim 0 (vocab)", kind
        if not is_layer:
            return -1, "head parameter (not a layer): replicated", "bare"
        return None, "classifier head", "layer"  # an ordinary last layer: it alternates
    if in_attention:
        if lname in QKV_NAMES:
            return 0, "attention Q/K/V: dim 0", ("attention_q" if lname in Q_NAMES else "attention_kv")
        if lname in ATTN_OUT_NAMES:
            return 1, "attention output: dim 1", "attention_out"
    if lname in UP_NAMES:
        return 0, f"'{name}': dim 0 (column parallel)", kind
    if lname in DOWN_NAMES:
        return 1, f"'{name}': dim 1 (row parallel)", kind
    if "in" in toks:
        return 0, f"'{name}': dim 0 (column parallel)", kind
    if "out" in toks:
        return 1, f"'{name}': dim 1 (row parallel)", kind
    if not is_layer:
        # a class token, a learned table, a scale: not a layer, so it takes no part in the alternation
        return -1, "parameter array (not a layer): replicated", "bare"
    return None, "", kind


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


def _array_like(x) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)  # abstract models too


def leaf_plans(model, mesh: Mesh, overrides: Sequence[tuple[str, P]] = (), fsdp: bool = False, name: str | None = None):
    """Returns ``(treedef, [LeafPlan | None per leaf], fallbacks)`` for ``model``;
    ``fallbacks`` are ``(path text, loud)`` for leaves replicated because
    ``n_model_shards`` does not divide their split dim."""
    mesh = check_mesh(mesh)
    prefix = f"{name}." if name else ""
    compiled = _compile_overrides(overrides, mesh)
    n_model = mesh.shape[MODEL]
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(model)
    plans: list[LeafPlan | None] = [None] * len(leaves_with_path)
    counters: dict[str, int] = {}
    weight_dims: dict[str, int] = {}  # layer path -> dim split by 'model' (for its bias and adapters)
    fallbacks: list[tuple[str, bool]] = []
    used = [False] * len(compiled)

    def finish(i, path, leaf, spec, reason, final=False):
        if fsdp and not final:
            spec, did = _fsdp(spec, leaf, mesh)
            if did:
                reason += " + fsdp over data"
        plans[i] = LeafPlan(path, tuple(leaf.shape), leaf.dtype, spec, reason)

    def override(path, leaf):
        for j, (rx, spec, raw) in enumerate(compiled):
            if rx.search(path):
                used[j] = True
                _check_spec(spec, leaf, prefix + path, mesh, f"override {raw!r}")
                return spec, f"override '{raw}'"
        return None

    arrays = [(i, kp, leaf) for i, (kp, leaf) in enumerate(leaves_with_path) if _array_like(leaf)]
    vocab_sizes = set()
    for i, kp, leaf in arrays:  # the vocabularies, to tell an LM head from a classifier head
        parts = path_parts(kp)
        chain = _ancestors(model, kp)
        if leaf.ndim == 2 and _classify_weight(parts, chain, leaf, set())[1].startswith("embedding"):
            vocab_sizes.add(leaf.shape[0])

    def fall_back(i, path, leaf, dim, size, reason, why):
        loud = leaf.shape[dim] >= n_model  # a dim of 1 (a value head's output) has nothing to split: quiet
        fallbacks.append((f"{prefix}{path} {tuple(leaf.shape)}: {why}", loud))
        finish(i, path, leaf, P(), f"{reason}: replicated, {why}")

    # Pass 1: weights (ndim >= 2, not biases or adapters). An override replaces the
    # rule's choice for its leaf only: the alternation around it goes on as if it
    # were not there.
    later = []
    for i, kp, leaf in arrays:
        parts = path_parts(kp)
        path = ".".join(parts)
        ov = override(path, leaf)
        if (leaf.ndim < 2 or parts[-1] in BIAS_NAMES or parts[-1] in ADAPTER_NAMES
                or not jax.numpy.issubdtype(leaf.dtype, jax.numpy.inexact)):
            if ov is not None:
                finish(i, path, leaf, ov[0], ov[1], final=True)
            else:
                later.append((i, kp, parts, path, leaf))
            continue
        chain = _ancestors(model, kp)
        dim, reason, kind = _classify_weight(parts, chain, leaf, vocab_sizes)
        layer_parts = parts[:-1] if parts[-1] in WEIGHT_NAMES else parts
        group = ".".join(layer_parts[:-1])
        if dim is None:
            dim = counters.get(group, 0) % 2
            counters[group] = counters.get(group, 0) + 1
            reason = f"{reason + ': ' if reason else ''}alternating under '{group or '<root>'}': dim {dim}"
        elif dim in (0, 1) and kind != "bare":
            counters[group] = dim + 1  # a named layer also advances its parent's alternation
        if ov is not None:
            ov_spec = ov[0]
            if len(ov_spec) > 0 and ov_spec[0] is not None and MODEL in _axes_of(ov_spec[0]):
                weight_dims[".".join(layer_parts)] = 0  # its bias and adapters follow the override
            finish(i, path, leaf, ov_spec, f"{ov[1]} (rules: {reason})", final=True)
            continue
        if dim == -1:
            finish(i, path, leaf, P(), reason)
            continue
        if kind.startswith("attention"):
            heads = _head_count(chain, kv=kind == "attention_kv")
            if heads is not None and heads % n_model:
                fall_back(i, path, leaf, dim, heads, reason.split(":")[0],
                          f"{heads} heads not divisible by n_model_shards={n_model} (heads are never split)")
                continue
        if leaf.shape[dim] % n_model:
            fall_back(i, path, leaf, dim, leaf.shape[dim], reason,
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
    return treedef, plans, fallbacks


def _axes_of(entry) -> tuple:
    return entry if isinstance(entry, tuple) else (entry,)


# the plans of the latest `sharding_rules` results, so `explain` can give each leaf's reason
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
    warning (pointing at your line) and in `explain`.

    **Example:**

    ```python
    mesh = redeqx.make_mesh(n_model_shards=2)
    model = eqx.nn.MLP(784, 10, 256, depth=2, key=jax.random.key(0))
    specs = redeqx.sharding_rules(model, mesh)
    print(redeqx.explain(model, specs, mesh))
    ```
    """
    treedef, plans, fallbacks = leaf_plans(model, mesh, overrides, fsdp, name)
    loud = [text for text, is_loud in fallbacks if is_loud]
    if loud:
        who = f"(name={name!r})" if name else ""
        warn_user(
            f"redeqx.sharding_rules{who}: {len(loud)} leaf/leaves replicated because n_model_shards="
            f"{mesh.shape[MODEL]} does not split them evenly: " + "; ".join(loud)
            + ". Pick n_model_shards that divides these dims, or pass overrides=[(regex, spec)]."
        )
    specs = jax.tree_util.tree_unflatten(treedef, [p.spec if p is not None else None for p in plans])
    _RECENT[id(specs)] = (specs, plans)
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
    candidates += [leaf_plans(model, mesh)[1], leaf_plans(model, mesh, fsdp=True)[1]]
    by_path = [{p.path: p for p in plans if p is not None} for plans in candidates]
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
        if not _array_like(leaf):
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
