"""Calls and loops: the body of a ``jit``/``remat``/``custom_jvp``/``custom_vjp``/
``shard_map`` sees its arguments; a ``scan`` slices its ``xs`` on axis 0 (a
weight sliced there has a layer axis); a split a scan's carry keeps on one dim
every iteration goes on (a per-head state), any other split carried through a
loop is blocked (each iteration would need it whole)."""

from __future__ import annotations

from ._reader import Reader, _open, _scan_counts, _shape, _sub_jaxprs


def call(r: Reader, eqn) -> None:
    """A call with one body (jit, remat, custom_jvp/vjp, shard_map...): the body sees the arguments."""
    body = _sub_jaxprs(eqn)[0]
    jaxpr = _open(body)
    n = len(jaxpr.invars)
    args = eqn.invars[len(eqn.invars) - n:] if len(eqn.invars) >= n else eqn.invars
    # a shard_map, or a custom_vmap whose rule decides how it runs batched (the zoo's experts, which its
    # rule runs in a shard_map, each device its own experts): its author lays out what it reads
    manual = eqn.primitive.name in ("shard_map", "custom_vmap_call")
    r.manual += manual
    for inner, arg in zip(jaxpr.invars, args):  # a weight updated in the loss, passed to `jnp.where`'s jit
        r.moved_update(inner, arg)
    r.bind(eqn.outvars, *r.run(jaxpr, *r.inputs(args)))
    r.manual -= manual
    # a one-hot made in the body (`jax.nn.one_hot` is jitted) is one outside it too
    r.one_hot.update(out for out, inner in zip(eqn.outvars, jaxpr.outvars) if inner in r.one_hot)
    for out, inner in zip(eqn.outvars, jaxpr.outvars):
        r.moved_update(out, inner)


def scan(r: Reader, eqn) -> None:
    jaxpr = _open(eqn.params["jaxpr"])
    nc, ncarry = _scan_counts(eqn.params)
    views, tags, static = r.inputs(eqn.invars)
    for i in range(nc + ncarry, len(eqn.invars)):  # xs: sliced on axis 0, one layer per iteration
        for vw in (views[i], r.updated(eqn.invars[i])):  # (stacked weights, or MAML's adapted stack)
            for leaf, dims in (vw.parts if vw is not None else ()):
                if dims[0] is not None:
                    r.facts.layer_dim(leaf, dims[0], f"scan axis (L={_shape(eqn.invars[i])[0]})")
        if views[i] is not None:
            views[i] = views[i].mapped(lambda dims: dims[1:])
        r.moved_update(jaxpr.invars[i], eqn.invars[i], lambda dims: dims[1:])
        if tags[i]:
            tags[i] = _shift_tags(r, tags[i], -1, "a lax.scan loops over its output features")
    for i in range(nc, nc + ncarry):  # a weight as a carry's start is updated each trip (`_updated_carry`)
        _updated_carry(r, jaxpr.invars[i], eqn.invars[i], views[i])
        views[i] = None
    _looped(r, views[:nc])
    outer, r.trips = r.trips, r.trips * eqn.params["length"]
    try:
        out_views, out_tags, out_static = _carry_fixed_point(r, jaxpr, views, tags, static, nc, ncarry)
    finally:
        r.trips = outer
    for i in range(ncarry):
        out_views[i] = None
        r.moved_update(eqn.outvars[i], jaxpr.outvars[i])
    for i in range(ncarry, len(out_tags)):  # ys: stacked on a new axis 0
        out_tags[i] = {s: d + 1 for s, d in out_tags[i].items()}
        out_views[i] = None
    r.bind(eqn.outvars, out_views, out_tags, out_static)


def _updated_carry(r: Reader, inner, arg, view) -> None:
    """A scan's carry that starts as a whole matrix of weights (`Reader.whole_matrices`; a
    test-time-training layer's inner weights, `W0` broadcast over the batch, a learned initial
    state) or as an update of one, and that the body updates by activations: that weight
    (`Reader.perturbed`). Read as an activation, its first trip added a split update to it whole and
    kept the layers that make the update whole."""
    if view is not None and r.whole_matrices(view):
        r.perturbed[inner] = view
    else:
        r.moved_update(inner, arg)


def _carry_fixed_point(r: Reader, jaxpr, views, tags, static, nc: int, ncarry: int, rounds: int = 3):
    """Runs a scan's body until the splits its carry holds on entry are those it leaves with.

    A carry split on one dim that every iteration keeps on that dim (a per-head state fed by
    per-head inputs: RWKV, linear attention) needs no communication inside the loop, so it goes
    on; one that moves to another dim, or that a weight contracts inside the body (a reduction
    every iteration), or that does not settle, is blocked."""
    carry = slice(nc, nc + ncarry)
    for _ in range(rounds):
        start = len(r.facts.rows)
        out = r.run(jaxpr, views, tags, static)
        entering = {s for t in tags[carry] for s in t}
        for seed, _, _, _ in r.facts.rows[start:]:
            if seed in entering:
                r.facts.block(seed, "carried through a loop whose body contracts it (a reduction every iteration)")
        merged = [_merge(r, a, b) for a, b in zip(tags[carry], out[1][:ncarry])]
        if all(_roots(r, m) == _roots(r, t) for m, t in zip(merged, tags[carry])):
            return out
        tags = tags[:nc] + merged + tags[nc + ncarry:]
    for t in tags[carry]:
        _carried(r, t)
    return out


def _looped(r: Reader, views) -> None:
    """Weights a loop's body reads whole on every trip (its consts, a while loop's carry too): a
    recurrent cell's, a shared layer's. Their products run once a trip, so a split of their own
    would add a collective to every trip (`Facts.looped`)."""
    for vw in views:
        for leaf, _ in (vw.parts if vw is not None else ()):
            r.facts.looped.add(leaf)


def _roots(r: Reader, tags: dict[int, int]) -> set[tuple[int, int]]:
    """A value's splits by group (a weight's uses in each round of a body are one group)."""
    return {(r.facts.find(s), d) for s, d in tags.items()}


def _merge(r: Reader, entering: dict[int, int], leaving: dict[int, int]) -> dict[int, int]:
    merged = dict(entering)
    for seed, d in leaving.items():
        if merged.setdefault(seed, d) != d:
            r.facts.block(seed, "carried through a loop on another dim than it entered with")
    return merged


def _shift_tags(r, tags, by, why):
    out = {}
    for s, d in tags.items():
        if d + by < 0:
            r.facts.block(s, why)
        else:
            out[s] = d + by
    return out


def _carried(r: Reader, tags) -> None:
    for seed in tags:
        r.facts.block(seed, "its output is carried through a loop")


def while_loop(r: Reader, eqn) -> None:
    for key in ("cond_jaxpr", "body_jaxpr"):
        jaxpr = _open(eqn.params[key])
        n = len(jaxpr.invars)
        nconsts = eqn.params["cond_nconsts" if key == "cond_jaxpr" else "body_nconsts"]
        consts = eqn.invars[:nconsts] if key == "cond_jaxpr" else \
            eqn.invars[eqn.params["cond_nconsts"]:eqn.params["cond_nconsts"] + nconsts]
        carry = eqn.invars[eqn.params["cond_nconsts"] + eqn.params["body_nconsts"]:]
        views, tags, static = r.inputs(list(consts) + list(carry))
        _looped(r, views)
        for i in range(len(consts), n):
            _carried(r, tags[i])
            tags[i], views[i] = {}, None
        r.run(jaxpr, views[:n], tags[:n], static[:n])


def cond(r: Reader, eqn) -> None:
    results = [r.run(_open(b), *r.inputs(eqn.invars[1:])) for b in eqn.params["branches"]]
    views, tags, static = results[0]
    for other in results[1:]:
        for i, t in enumerate(other[1]):
            tags[i] = {**tags[i], **t}
        views = [v if v == w else None for v, w in zip(views, other[0])]
    r.bind(eqn.outvars, views, tags, [False] * len(tags))
