"""Name hints for layers beyond a plain transformer: mixture-of-experts stacks
and their routers, fused Q/K/V projections (and the attention output beside
them), and which leading axes of an expert stack are layer axes."""

from __future__ import annotations

from ._names import (
    FUSED_NAMES, MOE_WORDS, QKV_LAYOUTS, ROUTER_NAMES, _fields, _head_count, _ndim, _Rule,
)

import equinox as eqx


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
    ``experts`` and it is not itself one of the experts (in a list of them) nor
    an attention module (a family's ``Qwen3MoeAttention`` names the family, and
    its projections, stacked over layers, have the rank of an expert stack)."""
    if _holds_experts(obj):
        return True
    if not _fields(obj) or name.isdigit() or any("expert" in p.lower() for p in above):
        return False
    names = (name.lower(), type(obj).__name__.lower())
    if isinstance(obj, eqx.nn.MultiheadAttention) or any(w in n for w in ("attn", "attention") for n in names):
        return False
    return any(w in n for w in MOE_WORDS for n in names)


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
