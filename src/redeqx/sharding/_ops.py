"""How each primitive moves weights' views and activations' splits (shape ops,
elementwise ops, reductions, gathers). A split goes on where the op keeps it
local, and is blocked, with the reason, where the op needs the whole dim."""

from __future__ import annotations

import dataclasses
import math

from ._facts import reshape_target
from ._reader import nbytes, Reader, View, _shape

ELEMENTWISE = frozenset(
    "add sub mul div rem pow max min neg exp exp2 log log1p expm1 tanh logistic sin cos tan sqrt rsqrt cbrt "
    "abs sign floor ceil round integer_pow square erf erfc erf_inv atan2 convert_element_type select_n clamp "
    "stop_gradient copy copy_p reduce_precision is_finite eq ne lt le gt ge and or not xor nextafter real imag "
    "conj sharding_constraint mesh_cast reshard add_any pvary asin acos atan sinh cosh asinh acosh atanh lgamma "
    "digamma bessel_i0e bessel_i1e".split()
)
REDUCTIONS = frozenset("reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or argmax argmin".split())
ORDERED = frozenset("cumsum cumprod cummax cummin cumlogsumexp sort top_k".split())  # need the whole dim
SUMS = frozenset("add sub add_any".split())
SCALING = frozenset("mul div neg convert_element_type copy copy_p reduce_precision sharding_constraint "
                    "mesh_cast reshard pvary".split())


# What a slice or `jnp.split` of a product's output features is said to do: `_decide.replicated_blocks`
# finds a fused Q/K/V cut into q, k and v by it.
CUTS_FEATURES = "cuts its output features"


def elementwise(r: Reader, eqn) -> None:
    out = eqn.outvars[0]
    nd = len(_shape(out))
    views = [(v, r.view(v)) for v in eqn.invars]
    updates = {v: u for v in eqn.invars if (u := r.updated(v)) is not None}  # (that weight where a split meets it)
    acts = [v for v, vw in views if vw is None and not r.is_static(v) and len(_shape(v)) == nd and nd
            and v not in updates]
    weights = [vw for _, vw in views if vw is not None and len(_shape(_var(eqn, vw, views))) == nd]
    derived = any(r.is_derived(v) for v in eqn.invars)
    # (scalars only: learned queries added to zeros of their shape are rows of their own, `_contract`)
    only_constants = all(r.is_static(v) and not _shape(v) for v, vw in views if vw is None)
    if weights and all(r.is_derived(v) for v in acts) and (
            eqn.primitive.name in SCALING or len(weights) > 1 or only_constants or derived):
        # still the weights: W * s, W + delta, g * v / |v| (weight normalisation), (W - mean W) / std W,
        # any function of them alone (softplus(rho): a Bayesian layer's scale, a positive weight)
        r.views[out] = View(tuple(p for w in weights for p in _broadcast(w, _shape(_var(eqn, w, views)), _shape(out))),
                            derived or any(w.normalized for w in weights))
        return
    tags: dict[int, int] = {}
    where = f"{eqn.primitive.name}"
    for v in eqn.invars:
        for seed, dim in r.tag(v).items():
            if tags.get(seed, dim) != dim:
                r.facts.block(seed, f"{where} would need its output split on two dims at once")
            tags[seed] = dim
    for seed, dim in tags.items():  # a weight applied elementwise to a split activation follows the split
        for w in weights + [u for v, u in updates.items() if len(_shape(v)) == nd]:
            for leaf, dims in w.parts:
                if dims[dim] is not None:
                    r.facts.follow(seed, leaf, dims[dim], f"{eqn.primitive.name} with the split activation")
    if eqn.primitive.name in SUMS:  # x + h: the stream h joins needs it whole (its gradient too)
        split = [r.tag(v) for v in eqn.invars if r.tag(v)]
        if len(split) > 1 and any(a.keys() != b.keys() for a, b in zip(split, split[1:])):
            r.facts.summed.update(tags)  # several layers' split outputs added: a residual stream split
        for seed, dim in tags.items():  # (its own split is no other activation: x - mean(x) in a norm of it)
            if any(r.tag(v).get(seed) != dim and not _split_at(r, v, dim) and _shape(v)[dim] > 1 for v in acts):
                r.facts.reduce(seed, f"{'added to' if eqn.primitive.name != 'sub' else 'subtracted from or by'} an "
                               "activation that is not split (a residual stream, a target)", alone=False)
    r.set_tags(out, tags, where)
    _perturbed(r, eqn, out)
    within = {s: d for v in eqn.invars if len(_shape(v)) == nd for s, d in r.inner(v).items()}
    if within:
        r.within[out] = within


def _perturbed(r: Reader, eqn, out) -> None:
    """Matrices (every dim of weights of 2+ dims, maybe broadcast over leading dims) added to,
    subtracted from, multiplied or masked by activations of the output's shape, then maybe scaled or
    cast: weights updated or sampled inside the loss (MAML's ``W - lr * dW``, a Bayesian layer's
    ``mu + softplus(rho) * eps``, DropConnect's ``where(mask, W, 0)``). A product that meets them with
    an activation reads them as those weights (`Reader.perturbed`, `_contract.contract`); read as
    activations, it summed the split hidden units against them and kept every weight whole. ``x +
    pos`` is one too, but a weight contracts that sum, which stays the activation it is."""
    r.perturbed.pop(out, None)  # (a body read before)
    if eqn.primitive.name not in SUMS | SCALING | {"select_n"}:
        return
    found = [r.view(v) or r.updated(v) for v in eqn.invars]
    weights = [w for w in found if w is not None]
    others = [v for v, w in zip(eqn.invars, found) if w is None]
    sampled = [v for v in others if not r.is_static(v)]  # (a scalar scales it, `where` fills with zeros)
    if weights and (sampled or any(r.updated(v) is not None for v in eqn.invars)) and all(
            _shape(v) in (_shape(out), ()) for v in others) and all(r.whole_matrices(w) for w in weights):
        r.perturbed[out] = View(tuple(p for w in weights for p in w.parts))


def _broadcast(vw: View, shape, out_shape) -> tuple:
    """``vw``'s parts in an elementwise op's output: a dim of size 1 that the op broadcasts (a gain
    of shape ``(out, 1)`` times a ``(out, in)`` weight) is no dim of its leaf there."""
    return tuple((leaf, tuple(None if shape[d] == 1 != out_shape[d] else x for d, x in enumerate(dims)))
                 for leaf, dims in vw.parts)


def _split_at(r: Reader, v, dim: int) -> bool:
    """Whether ``v`` is split on ``dim`` by a seed that may still split (not one a norm reduced:
    a stream that passed a norm is whole, whatever seeds once fed it)."""
    return any(d == dim and s not in r.facts.reduced and s not in r.facts.blocked for s, d in r.tag(v).items())


def _var(eqn, vw, views):
    return next(v for v, w in views if w is vw)


def transpose(r: Reader, eqn) -> None:
    perm = eqn.params["permutation"]
    (src,), out = eqn.invars, eqn.outvars[0]
    if (vw := r.view(src)) is not None:
        r.views[out] = vw.mapped(lambda dims: tuple(dims[p] for p in perm))
    r.moved_update(out, src, lambda dims: tuple(dims[p] for p in perm))  # (adapted stacked weights, vmapped)
    r.set_tags(out, {s: perm.index(d) for s, d in r.tag(src).items()}, "transpose")
    if src in r.within:
        r.within[out] = {s: frozenset(perm.index(d) for d in ds) for s, ds in r.within[src].items()}


def broadcast_in_dim(r: Reader, eqn) -> None:
    src, out = eqn.invars[0], eqn.outvars[0]
    bd, nd = eqn.params["broadcast_dimensions"], len(eqn.params["shape"])

    def place(dims):
        new = [None] * nd
        for i, d in zip(bd, dims):
            new[i] = d
        return tuple(new)

    if (vw := r.view(src)) is not None:
        r.views[out] = vw.mapped(place)
    r.set_tags(out, {s: bd[d] for s, d in r.tag(src).items()}, "broadcast")


def reshape(r: Reader, eqn) -> None:
    src, out = eqn.invars[0], eqn.outvars[0]
    old, new = _shape(src), _shape(out)
    if (vw := r.view(src)) is not None:
        def keep(dims):
            moved = [None] * len(new)
            for d, leaf_dim in enumerate(dims):
                t = reshape_target(old, new, d)
                if t is not None and t[1] == t[2] == 1 and old[d] == new[t[0]]:
                    moved[t[0]] = leaf_dim
            return tuple(moved)

        def back(leaf, dims):  # a weight flattened to (out, -1) and back (spectral normalisation of a conv)
            whole = tuple(range(len(new)))
            mine = new == tuple(r.facts.shapes[leaf]) and all(x in (None, d) for d, x in enumerate(dims))
            return whole if mine and reshape_target(new, old, 0) is not None else dims
        kept = vw.mapped(keep)
        r.views[out] = dataclasses.replace(kept, parts=tuple((leaf, back(leaf, dims)) for leaf, dims in kept.parts))
        _indexed(r, vw, old, new)
    tags = {}
    for seed, d in r.tag(src).items():
        t = reshape_target(old, new, d)
        if t is None:
            r.facts.block(seed, f"reshape {old} -> {new} regroups its output features so no device keeps a whole slice")
            continue
        tags[seed] = t[0]
        if t[2] != 1:
            r.within.setdefault(out, {})[seed] = _inner_dims(new, t[0], t[2])
        if _regroups_heads(old, new, d, t):
            # (T, Hq, D) -> (T, Hkv, G, D): whole heads regrouped (grouped-query attention), so any
            # split of Hq into whole heads stays whole heads (Shardy splits Hkv x G by sub-axes)
            r.facts.whole(seed, old[d] * t[1], 1, 1, old[d] * t[1], _reshape_text(old, new))
        elif t[1] != 1 or t[2] != 1:
            r.facts.whole(seed, old[d], t[1], t[2], new[t[0]], _reshape_text(old, new))
    r.set_tags(out, tags, "reshape")


def _inner_dims(new, t: int, inner: int) -> frozenset[int]:
    """The dims after ``t`` that hold its group's ``inner`` factor: (G, C/G) -> {C/G's dim}."""
    dims, size, k = set(), 1, t + 1
    while size < inner and k < len(new):
        size *= new[k]
        dims.add(k)
        k += 1
    return frozenset(dims)


def _regroups_heads(old, new, d, t) -> bool:
    """Dims regrouped in front of dims that pass unchanged (a head's features):
    (Hq) <-> (Hkv, G) before D. The units of the split were whole heads already."""
    group = old[d] * t[1]  # the split dim and the input dims it merges with
    k = d + 1
    size = old[d]
    while size < group and k < len(old):
        size *= old[k]
        k += 1
    rest = old[k:]
    return (t[1] != 1 or t[2] != 1) and bool(rest) and any(x > 1 for x in rest) \
        and tuple(new[len(new) - len(rest):]) == tuple(rest)


def _reshape_text(old, new) -> str:
    k = 0
    while k < min(len(old), len(new)) - 1 and old[k] == new[k]:
        k += 1
    return f"reshape to {new[k:]} after"


def _indexed(r: Reader, vw: View, old, new) -> None:
    """A size-1 dim of a weight view dropped by a reshape was one index of a
    leaf dim (``W[i]`` of a stack): that leaf dim is a layer axis."""
    if len(new) < len(old):
        for leaf, dims in vw.parts:
            for d, leaf_dim in enumerate(dims):
                if old[d] == 1 and leaf_dim is not None:
                    r.facts.layer_dim(leaf, leaf_dim, "indexed one layer at a time")


def squeeze(r: Reader, eqn) -> None:
    src, out = eqn.invars[0], eqn.outvars[0]
    gone = set(d % len(_shape(src)) for d in eqn.params["dimensions"])
    if (vw := r.view(src)) is not None:
        for leaf, dims in vw.parts:
            for d in gone:
                if dims[d] is not None:
                    r.facts.layer_dim(leaf, dims[d], "indexed one layer at a time")
        r.views[out] = vw.mapped(lambda dims: tuple(x for d, x in enumerate(dims) if d not in gone))
    shift = {d: d - sum(g < d for g in gone) for d in range(len(_shape(src))) if d not in gone}
    r.set_tags(out, {s: shift[d] for s, d in r.tag(src).items() if d in shift}, "squeeze")


def slicing(r: Reader, eqn) -> None:
    """slice, dynamic_slice, pad: a dim whose size changes is no longer a whole dim."""
    src, out = eqn.invars[0], eqn.outvars[0]
    old, new = _shape(src), _shape(out)
    changed = {d for d in range(len(old)) if old[d] != new[d] or eqn.primitive.name == "pad" and _padded(eqn, d)}
    if (vw := r.view(src)) is not None:
        r.views[out] = vw.mapped(lambda dims: tuple(
            x if d not in changed or new[d] == 1 else None for d, x in enumerate(dims)))
    tags = {}
    for seed, d in r.tag(src).items():
        if d in changed:
            r.facts.block(seed, f"{eqn.primitive.name} {CUTS_FEATURES} ({old[d]} -> {new[d]})")
        else:
            tags[seed] = d
    r.set_tags(out, tags, eqn.primitive.name)


def _padded(eqn, d) -> bool:
    lo, hi, interior = eqn.params["padding_config"][d]
    return bool(lo or hi or interior)


def reduction(r: Reader, eqn) -> None:
    """A reduction over the split dim alone is a softmax's or a loss's over classes (a
    vocabulary-parallel head may end there); over it with other dims, a total (an MSE). One
    over the per-group factor of a split dim and over other dims is a GroupNorm's statistics:
    a norm over channels, which blocks a split as LayerNorm's does (heads' features reduced
    alone, a per-head norm, keep it)."""
    _reduce(r, eqn.invars[0], eqn.outvars[0], set(eqn.params.get("axes", ())), eqn.primitive.name)


def _reduce(r: Reader, src, out, axes: set[int], name: str) -> None:
    shape = _shape(src)
    tags = {}
    for seed, d in r.tag(src).items():
        inner = r.inner(src).get(seed, frozenset())
        others = {a for a in axes - inner - {d} if shape[a] > 1}
        if d in axes:
            r.facts.reduce(seed, f"is reduced over its features ({name})",
                           alone=not others and not axes & inner)
        elif axes & inner and others:
            # split into whole groups, each group's statistics are one device's own; into equal parts
            # of each group (shards a multiple of the groups), a small sum over the devices sharing one:
            # the block keeps its split either way (a stream normed so stays whole: `_roles._bad_seeds`)
            r.facts.reduce(seed, f"is reduced over groups of its features and {len(others)} other dims "
                                 f"({name}: a GroupNorm's statistics)", alone=False, whole=False)
            per_group = math.prod(shape[a] for a in inner)
            r.facts.whole(seed, shape[d] * per_group, 1, per_group, shape[d],
                          f"a GroupNorm's statistics ({name}) over the groups of", "groups", shared=True)
            tags[seed] = d - sum(a < d for a in axes)
        else:
            tags[seed] = d - sum(a < d for a in axes)
    r.set_tags(out, tags, name)


def psum(r: Reader, eqn) -> None:
    """A ``psum`` over positional axes (what ``jax.vmap`` makes of a ``pmean`` over its named axis:
    BatchNorm's statistics over the batch) sums each operand over those dims, as ``reduce_sum``
    does; one over a mesh's named axes (inside ``shard_map``) is not followed."""
    axes = eqn.params["axes"]
    if not all(isinstance(a, int) for a in axes):
        return unknown(r, eqn)
    for src, out in zip(eqn.invars, eqn.outvars):
        _reduce(r, src, out, set(axes), "psum over the vmapped axis")


def _off_axis(r: Reader, v, axis: int, why: str) -> dict[int, int]:
    """``v``'s tags but those on ``axis``, whose seeds are blocked, ``why`` saying why."""
    tags = {}
    for seed, d in r.tag(v).items():
        if d == axis:
            r.facts.block(seed, why)
        else:
            tags[seed] = d
    return tags


def ordered(r: Reader, eqn) -> None:
    src = eqn.invars[0]
    nd = len(_shape(src))
    axis = eqn.params.get("axis", eqn.params.get("dimension", nd - 1)) % max(nd, 1)
    tags = _off_axis(r, src, axis, f"{eqn.primitive.name} runs along its output features and needs all of them")
    for out in eqn.outvars:
        if len(_shape(out)) == nd:
            r.set_tags(out, dict(tags), eqn.primitive.name)


POOLS = frozenset("reduce_window_sum reduce_window_max reduce_window_min reduce_window".split())


def pool(r: Reader, eqn) -> None:
    """``lax.reduce_window`` (``eqx.nn.MaxPool2d``, ``AvgPool2d``): a split passes on the dims its
    window leaves alone (a window of 1, stride 1, no padding or dilation: a pool over pixels keeps
    the channels' split, and a VGG's convs either side of it pair), not on a dim it pools across."""
    p = eqn.params
    alone = {d for d, w in enumerate(p["window_dimensions"]) if w == 1 and p["window_strides"][d] == 1
             and tuple(p["padding"][d]) == (0, 0) and p["base_dilation"][d] == 1}
    for src, out in zip(eqn.invars, eqn.outvars):  # the generic primitive: operands, then their init values
        tags = {}
        for seed, d in r.tag(src).items():
            if d in alone:
                tags[seed] = d
            else:
                r.facts.block(seed, f"{eqn.primitive.name} pools across its output features")
        r.set_tags(out, tags, eqn.primitive.name)


def _along(r: Reader, eqn, over: set[int], why: str) -> None:
    """An op that runs along the dims ``over`` of its one operand and leaves the others alone: a
    weight is still the weight, with no split on those dims; an activation keeps its split on the
    other dims, not on one of those (blocked, ``why``)."""
    (src,), out = eqn.invars, eqn.outvars[0]
    if (vw := r.view(src)) is not None:
        r.views[out] = vw.mapped(lambda dims: tuple(None if d in over else x for d, x in enumerate(dims)))
    tags = {}
    for seed, d in r.tag(src).items():
        if d in over:
            r.facts.block(seed, why)
        else:
            tags[seed] = d
    r.set_tags(out, tags, eqn.primitive.name)


def rev(r: Reader, eqn) -> None:
    """``jnp.flip``: a kernel flipped (its spatial dims, as ``conv_transpose`` and ``jnp.convolve``
    flip them) is still the weight; a time-reversed sequence (a bidirectional layer's) keeps the
    split of its features; a split dim reversed would trade halves between devices."""
    _along(r, eqn, set(eqn.params["dimensions"]), "jnp.flip reverses its output features")
    if eqn.invars[0] in r.within:
        r.within[eqn.outvars[0]] = r.within[eqn.invars[0]]


def fft(r: Reader, eqn) -> None:
    """``jnp.fft``: this JAX's partitioner (Shardy) runs an FFT on its whole operand, gathering a
    split of any dim first, even one the transform leaves alone (a long convolution over time split
    on its channels gathered them twice a step: 1.3x / 1.9x the bytes of its layers whole at 2 / 4
    shards). So a split stops before it."""
    r.block_all(eqn, "passes through an FFT, which the partitioner runs on its whole operand")


def update_slice(r: Reader, eqn) -> None:
    """``lax.dynamic_update_slice``: the update written into the operand at dynamic offsets. A split
    passes on a dim the update spans whole (each device writes its own part), from the operand or
    the update, not on a dim the update covers in part (which device writes depends on the offset)."""
    operand, update = eqn.invars[:2]
    spans = {d for d, (a, b) in enumerate(zip(_shape(operand), _shape(update))) if a == b}
    tags: dict[int, int] = {}
    for v in (operand, update):
        for seed, d in r.tag(v).items():
            if d not in spans or tags.get(seed, d) != d:
                r.facts.block(seed, "is written into along its output features, in part")
            else:
                tags[seed] = d
    r.set_tags(eqn.outvars[0], tags, "dynamic_update_slice")


def split(r: Reader, eqn) -> None:
    """``jnp.split``: pieces of one axis (RoPE's halves); the other dims go on whole."""
    src, axis = eqn.invars[0], eqn.params["axis"]
    vw = r.view(src)
    for out in eqn.outvars:
        if vw is not None:
            r.views[out] = vw.mapped(lambda dims: tuple(None if d == axis else x for d, x in enumerate(dims)))
        r.set_tags(out, _off_axis(r, src, axis, f"jnp.split {CUTS_FEATURES} into pieces (a fused projection)"),
                   "split")


def stack(r: Reader, eqn) -> None:
    """``jnp.stack``: a new axis; the operands' splits meet on their shifted dims. Weights stacked
    (a gated MLP's gate and up projections, `redeqx.models._layers.joined_linears`) are still
    those weights on their own dims, each keeping its role; the new axis is no dim of theirs."""
    axis, out = eqn.params["axis"], eqn.outvars[0]
    views = [r.view(v) for v in eqn.invars]
    if all(vw is not None for vw in views):
        r.views[out] = View(tuple((leaf, dims[:axis] + (None,) + dims[axis:])
                                  for vw in views for leaf, dims in vw.parts))
    tags: dict[int, int] = {}
    for v in eqn.invars:
        for seed, d in r.tag(v).items():
            tags[seed] = d + (d >= axis)
    r.set_tags(out, tags, "stack")


def concatenate(r: Reader, eqn) -> None:
    axis, out = eqn.params["dimension"], eqn.outvars[0]
    tags: dict[int, int] = {}
    for v in eqn.invars:
        tags.update(_off_axis(r, v, axis, "its output features are concatenated with another value's"))
    r.set_tags(out, tags, "concatenate")


def gather(r: Reader, eqn) -> None:
    table, indices = eqn.invars[0], eqn.invars[1]
    dn = eqn.params["dimension_numbers"]
    if (vw := r.view(table)) is not None:
        for leaf, dims in vw.parts:
            for d in dn.start_index_map:
                if dims[d] is not None:
                    r.facts.lookup(leaf, dims[d], positional=r.is_static(indices))
        out = eqn.outvars[0]
        for leaf, _ in vw.parts:  # a table split on what it looks up sums its rows over 'model' (forward)
            r.facts.moves(leaf, eqn, 0, r.trips * nbytes(out), trips=r.trips)
        kept = [d for d in range(len(_shape(table))) if d not in dn.collapsed_slice_dims]
        whole = [d for d in kept if eqn.params["slice_sizes"][d] == _shape(table)[d]]
        # a weight's slices (a table's rows by constant indices, a stack's or an expert's matrices):
        # still the weight; vectors looked up by data (an embedding's rows: one whole dim, the others
        # picked, collapsed or kept as dims of 1 as a vmapped lookup keeps them) are an activation,
        # which a layer reading them directly (no norm between) contracts as it would any input
        if len(kept) == len(dn.offset_dims) and (r.is_static(indices) or len(whole) > 1):
            def rows(dims):
                new = [None] * len(_shape(out))
                for pos, d in zip(dn.offset_dims, kept):
                    new[pos] = dims[d] if d in whole else None
                return tuple(new)
            r.views[out] = vw.mapped(rows)
    tags: dict[int, int] = {}
    offset = _window_dims(_shape(table), dn.collapsed_slice_dims, dn.operand_batching_dims)
    for seed, d in r.tag(table).items():  # one entry per index along the split dim: a masked local pick
        if d in dn.collapsed_slice_dims:
            r.facts.reduce(seed, "has one of its features picked (a label's logit)")
        elif d in offset and d not in dn.start_index_map and eqn.params["slice_sizes"][d] == _shape(table)[d]:
            tags[seed] = dn.offset_dims[offset.index(d)]  # rows picked, each with its split features (a GNN's messages)
        else:
            r.facts.block(seed, "its output is gathered along a dim other than its features")
    for seed in r.tag(indices):
        r.facts.block(seed, "its output is used as gather indices")
    r.set_tags(eqn.outvars[0], tags, "gather")


def _window_dims(shape, inserted, batching) -> list[int]:
    """The dims of a gather's table or a scatter's operand that its slices span (whole or in part), in
    the order of the output's offset dims or the updates' window dims."""
    return [d for d in range(len(shape)) if d not in inserted and d not in batching]


def scatter(r: Reader, eqn) -> None:
    """``x.at[i].add(u)`` / ``.set(u)`` / ``.max(u)`` (a GNN's ``segment_sum`` or ``segment_max`` of
    messages into nodes: each feature combined on its own, whatever the combiner): a split of
    the updates' features lands on the operand's matching dim, where each row is written whole; a
    split of the dim the indices pick, or of the indices, needs them whole. A dim the indices start
    at but each update spans whole (``lax.dynamic_update_slice`` under ``vmap``) is not picked."""
    operand, indices, updates = eqn.invars[:3]
    dn = eqn.params["dimension_numbers"]
    window = _window_dims(_shape(operand), dn.inserted_window_dims, dn.operand_batching_dims)
    spans = {o: _shape(updates)[u] for o, u in zip(window, dn.update_window_dims)}
    picked = {d for d in dn.scatter_dims_to_operand_dims if spans.get(d) != _shape(operand)[d]}
    tags = dict(r.tag(operand))
    for seed, d in tags.items():
        if d not in window or d in picked:
            r.facts.block(seed, "is written into along a dim other than its features")
    for seed, u in r.tag(updates).items():
        o = window[dn.update_window_dims.index(u)] if u in dn.update_window_dims else None
        if o is None or o in picked or _shape(updates)[u] != _shape(operand)[o]:
            r.facts.block(seed, "its output is scattered along a dim other than its features")
        elif tags.get(seed, o) != o:
            r.facts.block(seed, f"{eqn.primitive.name} would need its output split on two dims at once")
        else:
            tags[seed] = o
    for seed in r.tag(indices):
        r.facts.block(seed, "its output is used as scatter indices")
    r.set_tags(eqn.outvars[0], tags, eqn.primitive.name)


def unknown(r: Reader, eqn) -> None:
    r.block_all(eqn, f"passes through {eqn.primitive.name}")

