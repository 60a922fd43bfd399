"""Contractions: where a weight meets an activation (``dot_general``, convs).

For a weight and an activation, the weight's dims contracted with the
activation are its input, its dims that reach the output are its output, and
its dims that are batch dims of the contraction (an ``(E, in, out)`` expert
stack under ``einsum("ecd,edf->ecf")``) are an expert axis. Each such use is a
seed: its output split on the weight's first output dim. A split activation
contracted by a weight finds its row-parallel partner; contracted with
another activation (a split dim summed between two activations) it is blocked;
kept as a batch or free dim (attention's heads) it goes on.
"""

from __future__ import annotations

import math

from ._facts import Use
from ._reader import View, _shape, nbytes


def _out_positions(lhs_nd: int, rhs_nd: int, dn, groups=()) -> tuple[dict[int, int], dict[int, int]]:
    """Each operand dim's position in a ``dot_general`` output (batch, lhs free, rhs free; the rhs's
    ``groups`` dims, a grouped matmul's experts, in none)."""
    (lc, rc), (lb, rb) = dn
    lhs = {d: i for i, d in enumerate(lb)}
    rhs = {d: i for i, d in enumerate(rb)}
    k = len(lb)
    for d in range(lhs_nd):
        if d not in lc and d not in lb:
            lhs[d] = k
            k += 1
    for d in range(rhs_nd):
        if d not in rc and d not in rb and d not in groups:
            rhs[d] = k
            k += 1
    return lhs, rhs


def grouped_contract(r, eqn) -> None:
    """``jax.lax.ragged_dot`` (a mixture of experts' grouped matmul: rows sorted by expert, each group
    of rows times its expert's matrix): for the weight stack ``(E, in, out)``, ``in`` is its input and
    ``out`` its output, as a ``dot_general``'s; its expert dim reaches no output (each row meets one
    expert), so the split it offers is each expert's hidden units, Megatron's, never the experts
    (which the partitioner could only all-gather). A stack that is not the rhs is not followed, nor
    one inside a ``shard_map`` or a ``custom_vmap``, whose author lays out its weights (the zoo's
    experts: expert parallel, each device running its own experts' grouped matmuls)."""
    rdn = eqn.params["ragged_dot_dimension_numbers"]
    lhs, rhs = eqn.invars[:2]
    if r.view(lhs) is not None or r.manual:
        _laid_out(r, rhs, rdn)
        return r.block_all(eqn, "passes through a grouped matmul (ragged_dot) that the reader does not split")
    contract(r, eqn, dn=rdn.dot_dimension_numbers, groups=tuple(rdn.rhs_group_dimensions), operands=(lhs, rhs))


def _laid_out(r, rhs, rdn) -> None:
    """Record what a grouped matmul the reader leaves to its author contracts and produces of its
    weight stack (``Facts.laid_out``: no split follows from it, but Muon's matrix dims do)."""
    (_, rc), _ = rdn.dot_dimension_numbers
    groups = tuple(rdn.rhs_group_dimensions)
    for leaf, dims in (r.view(rhs).parts if r.view(rhs) is not None else ()):
        known = lambda ds: tuple(dims[d] for d in ds if dims[d] is not None)  # noqa: E731
        produced = [d for d in range(len(dims)) if d not in rc and d not in groups]
        r.facts.laid_out.append(Use(leaf, known(rc), known(produced), known(groups), "grouped"))


def contract(r, eqn, dn=None, groups=(), operands=None) -> None:
    lhs, rhs = eqn.invars if operands is None else operands
    (lc, rc), (lb, rb) = dn = eqn.params["dimension_numbers"] if dn is None else dn
    lpos, rpos = _out_positions(len(_shape(lhs)), len(_shape(rhs)), dn, groups)
    lv, rv = r.view(lhs), r.view(rhs)
    if lv is not None and rv is not None and lv.normalized != rv.normalized:
        # normed weights with rows of their own times a weight (a Perceiver's normed latents times its
        # query projection) are its activation; a normed vector it contracts whole (spectral
        # normalisation's `u @ W @ v`) is not
        if not _contracted_whole(*((lhs, lc, lb) if lv.normalized else (rhs, rc, rb))):
            lv, rv = (None, rv) if lv.normalized else (lv, None)
    updated = None
    if lv is None and rv is None and (r.updated(lhs) is None) != (r.updated(rhs) is None):
        updated = lhs if r.updated(lhs) is not None else rhs  # a weight updated in the loss (`_ops._perturbed`)
        lv, rv = r.updated(lhs), r.updated(rhs)
    out = eqn.outvars[0]
    if _weights_only(r, lhs, lv, lc, lb) and _weights_only(r, rhs, rv, rc, rb) and (lv or rv):
        # weights times weights (a merged adapter), or a weight times what is made of weights alone or a
        # constant vector it contracts whole (spectral normalisation's power iteration, `W @ u` with `u`
        # from the model state): still weights, no use of them on an activation
        parts = [(leaf, _through(dims, lpos, len(_shape(out)))) for leaf, dims in lv.parts] if lv else []
        parts += [(leaf, _through(dims, rpos, len(_shape(out)))) for leaf, dims in rv.parts] if rv else []
        r.views[out] = View(tuple(parts))
        return
    sides = [(lhs, lv, lc, lb, lpos, rc, rb), (rhs, rv, rc, rb, rpos, lc, lb)]
    tags, rowed = _split_operands(r, sides, lhs, lv, rv, updated)
    for var, vw, contracting, batch, pos, _, _ in sides:
        if vw is None:
            continue
        for leaf, dims in vw.parts:
            known = lambda ds: tuple(dims[d] for d in ds if dims[d] is not None)  # noqa: E731
            kept = [d for d in range(len(dims)) if d not in contracting and d not in batch]
            produced = [d for d in kept if var is lhs or d not in groups]
            seed = r.facts.use(leaf, known(contracting), known(produced), known(batch), "matmul",
                               r.trips * nbytes(out))
            _row_seed(r.facts, seed, leaf, known(contracting), rowed)
            activation = rhs if var is lhs else lhs
            _one_hot_product(r, leaf, known(contracting), batch, activation)
            flops = 2 * math.prod(_shape(out)) * math.prod(_shape(var)[d] for d in contracting)
            r.facts.moves(leaf, eqn, r.trips * nbytes(activation) * r.is_learned(activation), r.trips * nbytes(out),
                         activation, r.trips * flops, r.trips)
            outs = [d for d in produced if dims[d] is not None]
            _transposed_splits(r.facts, leaf, dims, outs, pos, tags)
            if seed is not None and outs:
                r.facts.several_outputs |= len(outs) > 1
                out_dim = outs[-1] if r.facts.seed_last else outs[0]  # `read_program`'s second reading
                tags[seed] = pos[out_dim]
                r.facts.seed_dim[seed] = dims[out_dim]
    r.set_tags(out, tags, "dot_general")


def _split_operands(r, sides, lhs, lv, rv, updated=None) -> tuple[dict[int, int], dict[tuple[int, int], int]]:
    """What a product does with its operands' splits: a split dim it contracts against a weight
    makes that weight a row partner, one it keeps goes on in the output (``tags``), a batch dim
    beside a weight makes the weight follow. Returns ``tags`` and ``rowed``: (leaf, dim) -> the seed
    whose split the product contracts there. An ``updated`` weight's split on a dim the product
    contracts (its update's, the gradient's: the weight's own where its block splits) is the weight's,
    not an activation's summed against another."""
    tags: dict[int, int] = {}
    rowed: dict[tuple[int, int], int] = {}
    for var, vw, contracting, batch, pos, other_c, other_b in sides:
        other_view = rv if var is lhs else lv
        for seed, d in r.tag(var).items():
            if d in contracting and var is updated:
                continue
            if d in contracting:
                partner = other_c[contracting.index(d)]
                if other_view is None:
                    r.facts.block(seed, "its output features are summed against another activation, not a weight")
                for leaf, dims in (other_view.parts if other_view is not None else ()):
                    if dims[partner] is not None:
                        r.facts.row(seed, leaf, dims[partner], "contracts the split activation")
                        rowed[leaf, dims[partner]] = seed
            else:
                tags[seed] = pos[d]
                if d in batch and other_view is not None:
                    for leaf, dims in other_view.parts:
                        partner = other_b[batch.index(d)]
                        if dims[partner] is not None:
                            r.facts.follow(seed, leaf, dims[partner], "a batch dim beside the split activation")
    return tags, rowed


def _one_hot_product(r, leaf, contracted, batch, activation) -> None:
    """A weight contracted on one dim with a one-hot of data (``one_hot(t) @ emb``, a table looked up
    by a product, as TPU code often writes it) is looked up on that dim: split there, each device's
    part of the product is summed over ``model``, as a table's rows gathered by token ids are
    (`_roles.lookups`, which prices it against the table whole). Its own output's split is then not
    needed (`Facts.one_hot_uses`): a head tied to the table may split it on that dim. (Any product
    with data alone, a first layer's input, read so, split stems wherever the estimate favoured it.)"""
    if len(contracted) == 1 and not batch and not r.is_static(activation) and activation in r.one_hot:
        r.facts.lookup(leaf, contracted[0], positional=False, product=True)
        r.facts.one_hot_uses[len(r.facts.uses) - 1] = contracted[0]


def _transposed_splits(facts, leaf, dims, outs, pos, tags) -> None:
    """A product that transposes an earlier one of the same weight (`Facts.transposes`) seeds no split:
    its output is split where the earlier product's input was, by the seeds whose split that product
    contracted (its row partners'), on the dims it produces."""
    if len(facts.uses) - 1 in facts.transposed:
        for d in outs:
            for seed in facts.row_splits(leaf, dims[d]):
                tags[seed] = pos[d]


def _row_seed(facts, seed, leaf, contracted, rowed) -> None:
    """Note that ``seed``'s product is also a row partner: it contracts ``leaf``'s dim where the
    activation is split (`Facts.row_seeds`)."""
    for dim in contracted if seed is not None else ():
        if (leaf, dim) in rowed:
            facts.row_seeds[seed] = (rowed[leaf, dim], dim)


def _weights_only(r, var, view, contracting, batch) -> bool:
    """Whether ``var`` is a weight, or a constant or a value made of weights alone whose every dim
    the product contracts or batches (one with rows of its own is data: a grid of points a loss
    closes over, DETR's learned queries added to zeros; a weight's product with it is a use)."""
    return view is not None or (r.is_static(var) or r.is_derived(var)) and _contracted_whole(var, contracting, batch)


def _contracted_whole(var, contracting, batch) -> bool:
    """Whether a product contracts or batches every dim of its operand ``var`` (none of its own reaches
    the output: a vector it reduces against, not rows it transforms)."""
    return all(d in contracting or d in batch for d in range(len(_shape(var))))


def _through(dims, pos, nd):
    new = [None] * nd
    for d, leaf_dim in enumerate(dims):
        if d in pos:
            new[pos[d]] = leaf_dim
    return tuple(new)


def convolve(r, eqn) -> None:
    """A conv: the kernel's in-feature dim is its input, its out-feature dim its
    output; grouped convs (``feature_group_count > 1``) keep whole groups."""
    lhs, rhs = eqn.invars
    dn = eqn.params["dimension_numbers"]
    groups = eqn.params["feature_group_count"]
    kv, out = r.view(rhs), eqn.outvars[0]
    in_feature, out_feature = dn.lhs_spec[1], dn.out_spec[1]
    k_out, k_in = dn.rhs_spec[0], dn.rhs_spec[1]
    tags: dict[int, int] = {}
    rowed: dict[tuple[int, int], int] = {}
    for seed, d in r.tag(lhs).items():
        if d != in_feature or kv is None:
            r.facts.block(seed, "its output reaches a conv other than on its channels")
            continue
        for leaf, dims in kv.parts:  # (a part with no in-feature dim is a gain the kernel is scaled by)
            if groups == 1:
                if dims[k_in] is not None:
                    r.facts.row(seed, leaf, dims[k_in], "conv contracts the split channels")
                    rowed[leaf, dims[k_in]] = seed
            elif dims[k_out] is not None:
                r.facts.follow(seed, leaf, dims[k_out], f"grouped conv ({groups} groups) on the split channels")
                tags[seed] = out_feature
    follows = groups > 1 and any(d == in_feature for d in r.tag(lhs).values())
    flops = 2 * math.prod(_shape(out)) * math.prod(_shape(rhs)) // _shape(rhs)[k_out]  # each output: a kernel's
    for leaf, _ in (kv.parts if kv is not None else ()):
        r.facts.moves(leaf, eqn, r.trips * nbytes(lhs) * r.is_learned(lhs), r.trips * nbytes(out), lhs,
                      r.trips * flops, r.trips)
    if kv is not None and not follows:  # a conv of a split input is a use too: its own output can be split
        for leaf, dims in kv.parts:
            spatial = tuple(dims[d] for d in dn.rhs_spec[2:] if dims[d] is not None)
            contracted = tuple(x for x in (dims[k_in],) if x is not None) + spatial
            seed = r.facts.use(leaf, contracted, tuple(x for x in (dims[k_out],) if x is not None), (), "conv")
            _row_seed(r.facts, seed, leaf, contracted, rowed)
            _transposed_splits(r.facts, leaf, dims, [k_out] if dims[k_out] is not None else [],
                               {k_out: out_feature}, tags)
            if seed is not None and dims[k_out] is not None:
                tags[seed] = out_feature
                r.facts.seed_dim[seed] = dims[k_out]
                if groups > 1:
                    r.facts.conv_groups(seed, groups)
    r.set_tags(out, tags, "conv")
