"""Each leaf's spec: an override, else the program's role, else the name rules.

`leaf_specs` walks the model's array leaves once. Stacked layers (leading
layer axes, from annotations or from the ``scan`` that slices them) are never
split; the name rules decide one layer and the spec gets ``None`` on those
axes, the program's roles are in the whole leaf's dims already. Biases and
adapters the program does not place follow their layer's weight.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from ..mesh import CONTEXT, DATA, MODEL, check_mesh
from ..mesh import named_shardings as named_shardings, sharding_of as sharding_of  # old importers (issue 42)
from ._stacks import layer_axes
from .._trees import is_array_like, path_parts, path_str
from ._name_rules import UNPLACED, classify
from ._names import ADAPTER_NAMES, BIAS_NAMES, WEIGHT_NAMES, _ancestors, _tokens
from ._names_special import _peeled

# fsdp: leaves smaller than this many elements stay as the model-axis rule put them.
FSDP_MIN_SIZE = 2**14


@dataclasses.dataclass(frozen=True)
class LeafSpec:
    """What the rules decided for one array: its spec and why (for `explain`: ``short`` in its
    default table, ``reason`` in full)."""

    path: str
    shape: tuple[int, ...]
    dtype: Any
    spec: P
    reason: str
    short: str


# `explain`'s default table keeps each reason to a few words: the counts that do not divide
# said plainly, anything else cut at a word (the full reason is `explain(..., reasons="full")`).
SHORT_LIMIT = 90
_NOT_DIVISIBLE = (
    (re.compile(r"dim (\d+) \((\d+)\) not divisible by n_model_shards=(\d+)"), r"dim \1 (\2) does not split \3 ways"),
    (re.compile(r"(\d+) ([a-z ]+?) not divisible by n_model_shards=(\d+)"), r"\1 \2 do not split \3 ways"),
)


def plain_why(why: str) -> str:
    """Why a leaf stays whole, the count that does not divide said plainly (without the path)."""
    for rx, plain in _NOT_DIVISIBLE:
        if m := rx.search(why):
            return m.expand(plain)
    return why


def brief(reason: str) -> str:
    """``reason`` in at most `SHORT_LIMIT` characters, cut at a word."""
    if len(reason) <= SHORT_LIMIT:
        return reason
    return reason[:SHORT_LIMIT - 1].rsplit(" ", 1)[0].rstrip(",;:") + "…"


def split_spec(ndim: int, dim: int, axis: str = MODEL) -> P:
    entries: list[Any] = [None] * ndim
    entries[dim] = axis
    return P(*entries)


def check_spec(spec: P, leaf, path: str, mesh: Mesh, where: str) -> None:
    if len(spec) > leaf.ndim:
        raise ValueError(
            f"{where}: spec {spec} for '{path}' has {len(spec)} entries but the leaf has shape {leaf.shape}; "
            f"give at most {leaf.ndim} entries."
        )
    for d, entry in enumerate(spec):
        size = 1
        for a in axes_of(entry) if entry is not None else ():
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


def axes_of(entry) -> tuple:
    return entry if isinstance(entry, tuple) else (entry,)


def fsdp_spec(spec: P, shape, mesh: Mesh, keep: set[int] = frozenset()) -> tuple[P, bool]:
    """``spec`` with the largest free dim (not in ``keep``: layer axes) also split over ``data``
    (and ``context``, whose devices hold the same weights: every device of a model shard holds a piece)."""
    group = (DATA, CONTEXT) if dict(mesh.shape).get(CONTEXT, 1) > 1 else DATA
    n_data = mesh.shape[DATA] * dict(mesh.shape).get(CONTEXT, 1)
    size = 1
    for s in shape:
        size *= s
    if n_data == 1 or size < FSDP_MIN_SIZE:
        return spec, False
    entries = list(spec) + [None] * (len(shape) - len(spec))
    free = [d for d in range(len(shape)) if entries[d] is None and d not in keep and shape[d] % n_data == 0]
    if not free:
        return spec, False
    entries[max(free, key=lambda i: shape[i])] = group
    return P(*entries), True


class Overrides:
    """``[(regex, spec), ...]``: the first regex found in a leaf's path sets its spec, finally."""

    def __init__(self, overrides, mesh: Mesh, prefix: str):
        self.mesh, self.prefix, self.items = mesh, prefix, []
        for i, item in enumerate(overrides):
            if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)
                    and isinstance(item[1], P)):
                raise TypeError(
                    f"overrides[{i}] = {item!r}: each override is a (regex, PartitionSpec) pair, "
                    "e.g. (r'blocks\\.\\d+\\.attn\\.wo', P(None, 'model'))."
                )
            try:
                self.items.append((re.compile(item[0]), item[1], item[0]))
            except re.error as e:
                raise ValueError(f"overrides[{i}]: {item[0]!r} is not a valid regular expression ({e}).") from None
        self.used = [False] * len(self.items)
        self.shadowed: dict[int, tuple[str, str]] = {}

    def find(self, path: str, leaf) -> tuple[P, str] | None:
        hit = None
        for j, (rx, spec, raw) in enumerate(self.items):
            if rx.search(path):
                if hit is None:
                    self.used[j] = True
                    check_spec(spec, leaf, self.prefix + path, self.mesh, f"override {raw!r}")
                    hit = (spec, f"override '{raw}'")
                else:
                    self.shadowed.setdefault(j, (path, hit[1]))
        return hit

    def check_all_used(self, paths: list[str], name: str | None) -> None:
        for j, (_, _, raw) in enumerate(self.items):
            if self.used[j]:
                continue
            if j in self.shadowed:
                path, earlier = self.shadowed[j]
                raise ValueError(
                    f"override '{raw}' matches '{path}' (and maybe more), but the earlier {earlier} matches "
                    "those paths first, so it never applies. Put the more specific override first, or anchor "
                    "the earlier regex (e.g. with '$')."
                )
            near = difflib.get_close_matches(raw.replace("\\", ""), paths, n=5, cutoff=0.3) or paths[:5]
            raise ValueError(
                f"override '{raw}' matches no array path of the {name or 'model'}; paths look like: "
                + ", ".join(near) + ". Overrides are regexes searched in these paths (see redeqx.explain)."
            )


def is_weight(parts: list[str], leaf) -> bool:
    """A leaf the name rules decide first (ndim >= 2 and floating, not a bias or adapter)."""
    return (leaf.ndim >= 2 and parts[-1] not in BIAS_NAMES and parts[-1] not in ADAPTER_NAMES
            and jnp.issubdtype(leaf.dtype, jnp.inexact))


def stacked_leaves(model, facts) -> list[tuple[int, Any, Any, int]]:
    """``(flat index, key path, one layer of the leaf, layer axes)`` for each array leaf."""
    flat = jax.tree_util.tree_flatten_with_path(model)[0]
    arrays = [(i, kp, x) for i, (kp, x) in enumerate(flat) if is_array_like(x)]
    axes = {path_str(kp): n for (_, kp, _), n in zip(arrays, layer_axes(model))}
    out = []
    for k, (i, kp, leaf) in enumerate(arrays):
        n = _peeled(path_parts(kp), _ancestors(model, kp), leaf, axes[path_str(kp)], axes)
        if facts is not None and n == 0:  # a stack without annotations: the scan says
            found = facts.layer_dims.get(k, {})
            while n in found and n < leaf.ndim:
                n += 1
        one = jax.ShapeDtypeStruct(leaf.shape[n:], leaf.dtype) if n else leaf
        out.append((i, kp, one, n))
    return out


def vocab_sizes(model, leaves, n_model: int) -> set[int]:
    """The vocabularies (embedding tables' dim 0), to tell an LM head from a classifier head."""
    found = set()
    for _, kp, leaf, _ in leaves:
        if leaf.ndim == 2 and classify(path_parts(kp), _ancestors(model, kp), tuple(leaf.shape), set(),
                                       n_model).reason.startswith("embedding"):
            found.add(leaf.shape[0])
    return found


def small_leaf_spec(parts, leaf, dim, vocab: set[int], n_model: int) -> tuple[P, str]:
    """A bias, adapter or other small leaf, following its layer's weight (split on ``dim``)."""
    if leaf.ndim == 1 and "logits" in _tokens(parts[-1]) and leaf.shape[0] in vocab and leaf.shape[0] % n_model == 0:
        return P(MODEL), "logits bias: dim 0 (vocab)"  # BART's final_logits_bias, with the vocab-split logits
    if parts[-1] in BIAS_NAMES and dim == 0 and leaf.ndim >= 1 and leaf.shape[0] % n_model == 0:
        return split_spec(leaf.ndim, 0), "bias of a dim-0 layer: dim 0"
    if parts[-1] in BIAS_NAMES:
        return P(), "bias: replicated" + (" (its layer is not split on dim 0)" if leaf.ndim else "")
    if parts[-1] in ADAPTER_NAMES and leaf.ndim == 2:
        # LoRA: B (out, rank) splits on out with a column-parallel layer, A (rank, in) on in with a
        # row-parallel one; the rank is never split
        split = {("lora_b", 0): 0, ("lora_a", 1): 1}.get((parts[-1], dim))
        if split is not None and leaf.shape[split] % n_model == 0:
            return split_spec(2, split), f"adapter of a dim-{dim} layer: dim {split}"
        return P(), "adapter: replicated"
    return P(), "replicated"


def lifted(spec: P, n: int) -> P:
    """A one-layer spec on a leaf with ``n`` leading layer axes (never split)."""
    return P(*([None] * n), *spec) if n and len(spec) else spec


def weight_layer(parts: list[str]) -> list[str]:
    return parts[:-1] if parts[-1].lower() in WEIGHT_NAMES else parts


def unplaced_warning(leaves: list[str], who: str) -> str:
    if leaves and leaves[0].startswith("<program> "):
        return (
            f"redeqx.sharding_rules{who}: reading the program, the rules split none of the weights it contracts: "
            f"{leaves[0][len('<program> '):]}. Every device holds and computes them whole. To split the ones "
            "that cost most, pass overrides=[(regex, spec)] (redeqx.explain(..., reasons='full') says why each "
            "stays whole), or drop loss_fn= and batch= to use the name rules." + "".join(leaves[1:])
        )
    return (
        f"redeqx.sharding_rules{who}: {len(leaves)} weight(s) of rank >= 2 whose names say nothing of their "
        f"role are replicated: {', '.join(leaves[:6])}{'...' if len(leaves) > 6 else ''}. Pass loss_fn= and "
        "batch= (the same pair make_train_step and plan take) so each weight's role is read from the program, "
        "or overrides=[(regex, spec)]."
    )


def check_mesh_model(mesh: Mesh) -> tuple[Mesh, int]:
    mesh = check_mesh(mesh)
    return mesh, mesh.shape[MODEL]


__all__ = ["UNPLACED"]
