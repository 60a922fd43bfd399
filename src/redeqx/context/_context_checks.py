"""What a step over sequences split over ``context`` must not do, read from
its program when it is first traced (`check_split_program`).

A split sequence is held in the dual-chunk order (`redeqx.context_order`),
so anything that reads a token's *place* as its position computes something
else than one device does, without an error: positions or a causal mask
built from ``jnp.arange`` / ``jnp.tril`` (an ``iota`` over the sequence), a
shift or pick at a fixed place (``logits[:, :-1]``, ``x[:, -1]``: a
``slice`` of the sequence), attention written by hand instead of
`redeqx.attention` (no ``shard_map`` over ``context`` in the program). Each
is a warning naming what to use; a model whose layers are all per-token
needs none of this and can ignore the first.
"""

from __future__ import annotations


from ..mesh import CONTEXT
from .._rewrite import inner_jaxprs
from .._typing import warn_user


def _splits_context(eqn) -> bool:
    """A ``shard_map`` that makes ``context`` manual: `redeqx.attention` (or the user's own split code)."""
    manual = eqn.params.get("newly_manual_axes", eqn.params.get("axis_names", ()))
    return eqn.primitive.name == "shard_map" and CONTEXT in tuple(manual)


def _read(jaxpr, lengths: set[int], found: dict) -> None:
    readers: dict[int, set[str]] = {}  # id(var) -> the primitives that read it
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            readers.setdefault(id(v), set()).add(eqn.primitive.name)
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if _splits_context(eqn):
            found["attention"] = True
            continue  # inside: each shard's own tokens, the split's own code
        if name == "iota":
            shape, dim = eqn.params["shape"], eqn.params["dimension"]
            if shape[dim] in lengths and readers.get(id(eqn.outvars[0])) != {"sort"}:  # argsort's indices: no position
                found["arange"].append(tuple(shape))
        elif name == "slice":
            shape = eqn.invars[0].aval.shape
            strides = eqn.params["strides"] or (1,) * len(shape)
            cut = zip(shape, eqn.params["start_indices"], eqn.params["limit_indices"], strides)
            if any(n in lengths and (a, b, s) != (0, n, 1) for n, a, b, s in cut):
                found["cut"].append((tuple(shape), tuple(eqn.outvars[0].aval.shape)))
        for sub in inner_jaxprs(eqn):
            _read(sub, lengths, found)


def check_split_program(jaxpr, lengths: tuple[int, ...], n_shards: int) -> None:
    """Warn about what the step's program ``jaxpr`` does with sequences of
    ``lengths`` tokens split over ``n_shards`` context shards that one device
    would do otherwise (the module's docstring)."""
    found = {"attention": False, "arange": [], "cut": []}
    _read(jaxpr, set(lengths), found)
    split = (f"its batch holds sequences of {' or '.join(map(str, lengths))} tokens split over {n_shards} context "
             "shards, in the dual-chunk order (redeqx.context_order), not one after another")
    if not found["attention"]:
        warn_user(
            f"redeqx: the step never calls redeqx.attention, but {split}. Attention written by hand (a causal mask "
            "of its own, jax.nn.dot_product_attention), a convolution or a recurrence along the sequence sees the "
            "tokens in that order and computes something else than one device does. Compute attention with "
            "redeqx.attention(q, k, v, causal=True) and positions with redeqx.sequence_positions(T) (a model whose "
            "layers are all per-token needs neither), or train on a mesh without n_context_shards."
        )
    if found["arange"]:
        warn_user(
            f"redeqx: the step counts places along a split sequence (an iota of shape {found['arange'][0]}: "
            f"jnp.arange(T) for positions, or jnp.tril of a (T, T) causal mask), but {split}, so a place is not "
            "the token's position. Use redeqx.sequence_positions(T) for positions (RoPE, a position table) and "
            "redeqx.attention(q, k, v, causal=True) for the causal mask."
        )
    if found["cut"]:
        shape, out = found["cut"][0]
        warn_user(
            f"redeqx: the step cuts a split sequence at a fixed place ({shape} -> {out}: logits[:, :-1] against "
            f"labels[:, 1:] to shift them, or x[:, -1] for the last token), but {split}, so neighbouring places are "
            "not neighbouring tokens and the pairs differ from one device's. Shift labels in collate_fn "
            "(input_ids = ids[:, :-1], labels = ids[:, 1:], both in seq_keys); pick a token by its position "
            "(redeqx.sequence_positions(T) == p)."
        )
