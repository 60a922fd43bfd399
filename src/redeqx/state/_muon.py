"""Muon's matrices, read from the program: `muon_dimensions`, and the warning
for optax's default rule on a stacked model (`warn_muon_layout`).

``optax.contrib.muon`` orthogonalises every 2-D parameter as ``x @ W`` (Flax's
``(in, out)``) and gives every other one to AdamW. An Equinox model breaks both
halves: a stacked layer's ``(layers, out, in)`` matrices go to AdamW while its
``(layers, features)`` norm scales are orthogonalised as matrices, and an
``(out, in)`` linear weight gets its width scale ``sqrt(max(1, out / in))``
with ``out`` and ``in`` swapped. `muon_dimensions` says, for each weight, the
dims the program contracts and produces, which is what Muon needs to know.
"""

from __future__ import annotations

import math
from typing import Any

import jax
from jax.sharding import PartitionSpec as P
from jaxtyping import PyTree
from optax.contrib import MuonDimensionNumbers

from ..mesh import CONTEXT, DATA
from ..sharding import axes_of, layer_axes, program_facts
from .._trees import is_array_like, is_none, path_str
from .._typing import typechecked, warn_user


def _matrices(facts, output_layers: bool) -> tuple[dict[int, MuonDimensionNumbers], list[int]]:
    """(leaf index -> its first product's dims, for the weights a product uses as a matrix against
    an activation; the output layers left out). None for a table looked up by index (an
    embedding) and, unless ``output_layers``, none for a layer whose output no weight contracts
    (an LM head, a classifier's last layer, a router)."""
    contracted_later = {facts.find(seed) for seed, *_ in facts.rows}
    heads: dict[int, bool] = {}
    for seed, use_index in enumerate(facts.seed_use):
        leaf = facts.uses[use_index].leaf
        heads[leaf] = heads.get(leaf, True) and facts.find(seed) not in contracted_later
    found: dict[int, MuonDimensionNumbers] = {}
    left: list[int] = []
    for use in facts.uses + facts.laid_out:  # laid out: a grouped matmul in the zoo's expert shard_map
        if use.leaf in found or use.leaf in left or use.leaf in facts.lookups or not use.contracted \
                or not use.produced:
            continue
        if heads.get(use.leaf, False) and not output_layers:
            left.append(use.leaf)
            continue
        found[use.leaf] = MuonDimensionNumbers(reduction_axis=use.contracted, output_axis=use.produced)
    return found, left


@typechecked
def muon_dimensions(
    model: PyTree,
    loss_fn: Any,
    batch: PyTree,
    *,
    model_state: PyTree = None,
    output_layers: bool = False,
) -> MuonMatrices:
    """For ``optax.contrib.muon(..., muon_weight_dimension_numbers=...)``: which
    weights Muon orthogonalises, and along which dims, read from the program
    ``loss_fn(model, batch, key)`` as `sharding_rules` reads it.

    A weight that a product (a matmul, an einsum, a convolution) contracts with
    an activation gets ``MuonDimensionNumbers(reduction_axis=<the dims it
    contracts>, output_axis=<the dims it produces>)``; its other dims (a
    stack's layer axis, an expert axis) are batch dims, each slice
    orthogonalised on its own. Everything else is None, which gives it to
    Muon's AdamW: biases, norm scales, gains, and a table looked up by index
    (an embedding, tied or not). With ``output_layers=False`` (default, as
    Muon's authors advise) a layer whose output no other weight contracts (an
    LM head, a classifier's last layer, a mixture's router) stays on AdamW
    too.

    Why not optax's default: it takes every 2-D array as a matrix in Flax's
    ``(in, out)`` order. With stacked layers (redeqx's zoo models by default)
    the ``(layers, out, in)`` matrices then go to AdamW and the
    ``(layers, features)`` norm scales are orthogonalised; an Equinox linear
    weight ``(out, in)`` gets its width scale with fan-in and fan-out swapped.

    The result is a `MuonMatrices`: a function of the parameters, as optax
    takes one (an Equinox model is itself callable, so optax would call it),
    giving ``model``'s structure with None at every leaf that is not a
    matrix: a prefix of the parameters optax sees, with or without
    ``trainable=``. Print it to see each matrix's dims. ``model`` may be abstract (``eqx.filter_eval_shape``) and
    ``batch`` ``jax.ShapeDtypeStruct`` s; nothing is compiled.

    **Example:**

    ```python
    dims = redeqx.muon_dimensions(model, loss_fn, batch)
    optimizer = optax.contrib.muon(0.02, adam_learning_rate=3e-4, muon_weight_dimension_numbers=dims)
    state = redeqx.init_state(model, optimizer, mesh, specs, key=key)
    ```
    """
    if loss_fn is None or batch is None:
        raise ValueError(
            "muon_dimensions needs loss_fn= and batch=, the pair make_train_step receives: each weight's matrix "
            "dims are read from the program loss_fn(model, batch, key)."
        )
    facts = program_facts(model, loss_fn, batch, model_state)
    found, left = _matrices(facts, output_layers)
    treedef = jax.tree.structure(model, is_leaf=is_none)
    out, paths, outputs, index = [], [], [], 0
    for kp, x in jax.tree_util.tree_flatten_with_path(model, is_leaf=is_none)[0]:
        dims = found.get(index) if is_array_like(x) else None
        if is_array_like(x) and index in left:
            outputs.append(path_str(kp))
        index += is_array_like(x)
        out.append(dims)
        if dims is not None:
            paths.append((path_str(kp), dims))
    return MuonMatrices(jax.tree.unflatten(treedef, out), tuple(paths), tuple(outputs))


class MuonMatrices:
    """What `muon_dimensions` returns: a function of the parameters, as optax's
    ``muon_weight_dimension_numbers`` takes one, giving ``tree`` (the model's
    structure, ``MuonDimensionNumbers`` at each matrix, None elsewhere). It
    prints as a table: each matrix's path, reduction dims and output dims, and
    the output layers left to AdamW."""

    def __init__(self, tree, matrices: tuple, output_layers: tuple = ()):
        self.tree, self.matrices, self.output_layers = tree, matrices, output_layers

    def __call__(self, params=None):
        return self.tree

    def __repr__(self) -> str:
        rows = [f"  {path}: reduction {tuple(d.reduction_axis)}, output {tuple(d.output_axis)}"
                for path, d in self.matrices]
        rows += [f"  {path}: AdamW, an output layer (output_layers=True gives it to Muon)"
                 for path in self.output_layers]
        return (f"MuonMatrices({len(self.matrices)} matrices; everything else AdamW)"
                + "".join("\n" + r for r in rows))


def _muon_momenta(opt_state) -> list[tuple]:
    """The key paths of the ``MuonState`` s in ``opt_state``, each with its ``mu`` key."""
    from optax.contrib import MuonState

    flat = jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=lambda x: isinstance(x, MuonState))[0]
    return [tuple(kp) + (jax.tree_util.GetAttrKey("mu"),) for kp, x in flat if isinstance(x, MuonState)]


def _without(entry, axes: tuple[str, ...]):
    """A spec entry with mesh ``axes`` taken out (fsdp's ``data``, or ``(data, context)``, on a matrix dim)."""
    kept = tuple(n for n in axes_of(entry) if n is not None and n not in axes)
    return kept if len(kept) > 1 else (kept[0] if kept else None)


def spread_muon_momentum(opt_state, model, specs, os_specs, mesh):
    """``os_specs`` (the optimizer state's mirrored specs) with each stacked matrix's Muon momentum
    split over ``data`` on its layer axis, where that axis is whole in the weight's spec and
    divides by ``data``: each device then runs Newton-Schulz on its own layers' slices, where
    every device ran it on every layer, and the momentum takes 1/data of the memory. The cost is
    one all-gather of these weights' updates a step (`benchmarks/muon.py`: a stacked LLaMA at
    data 8, 0.16x the FLOPs and 0.5x the peak for 1.9x the bytes). Under fsdp, which splits the
    weight over ``data`` on a matrix dim, the momentum takes ``data`` on the layer axis instead:
    mirrored, each Newton-Schulz product of a split matrix made the partitioner gather it (2.9x
    AdamW's bytes on libtpu). Muon orthogonalises each slice of a stack on its own
    (`muon_dimensions`), so the values are the same."""
    prefixes = _muon_momenta(opt_state)
    sizes = dict(mesh.shape)
    if not prefixes or sizes.get(DATA, 1) == 1:
        return os_specs
    try:
        axes = layer_axes(model)
    except ValueError:
        return os_specs
    flat = [(tuple(kp), x) for kp, x in jax.tree_util.tree_flatten_with_path(model)[0] if is_array_like(x)]
    spec_leaves = [s for s in jax.tree.leaves(specs, is_leaf=lambda s: s is None or isinstance(s, P))]
    arrays = [x for x in jax.tree.leaves(model, is_leaf=is_none)]
    spec_of = [s for x, s in zip(arrays, spec_leaves) if is_array_like(x)]
    stacked = {}
    for (kp, x), a, spec in zip(flat, axes, spec_of):
        spec = tuple(spec or ())
        # fsdp's group (data, and context on a mesh with it) moves from a matrix dim to the layer axis
        group = tuple(n for n in (DATA, CONTEXT) if any(n in axes_of(e) for e in spec)) or (DATA,)
        if a and x.ndim - a >= 2 and (not spec or spec[0] is None) and x.shape[0] % math.prod(sizes[n] for n in group) == 0:
            stacked[kp] = (tuple(x.shape), P(group if len(group) > 1 else DATA, *(_without(e, group) for e in spec[1:])))

    def spread(kp, leaf, spec):
        for prefix in prefixes:
            if kp[:len(prefix)] == prefix:
                hit = stacked.get(kp[len(prefix):])
                if hit is not None and hit[0] == tuple(leaf.shape):
                    return hit[1]
        return spec

    leaves = jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=is_none)[0]
    spec_tree = jax.tree.leaves(os_specs, is_leaf=lambda s: s is None or isinstance(s, P))
    treedef = jax.tree.structure(os_specs, is_leaf=lambda s: s is None or isinstance(s, P))
    return jax.tree.unflatten(treedef, [spread(tuple(kp), x, s) if is_array_like(x) else s
                                        for (kp, x), s in zip(leaves, spec_tree, strict=True)])


def _muon_covered(opt_state) -> list[set[tuple]]:
    """For each ``MuonState`` in ``opt_state``: the paths (within the parameters) of the leaves
    it orthogonalises (its momentum holds an array there, not optax's ``MaskedNode``)."""
    from optax.contrib import MuonState

    found = []
    for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, MuonState)):
        if isinstance(x, MuonState):
            found.append({tuple(p) for p, leaf in jax.tree_util.tree_flatten_with_path(x.mu)[0]
                          if is_array_like(leaf)})
    return found


def warn_muon_layout(opt_state, model) -> None:
    """Warn where an ``optax.contrib.muon`` state shows optax's default rule (every 2-D array,
    nothing else) meeting stacked layers: a stack's norm scales orthogonalised as matrices, or
    no stacked matrix orthogonalised at all. ``opt_state`` may be abstract."""
    covered_sets = _muon_covered(opt_state)
    if not covered_sets:
        return
    try:
        axes = layer_axes(model)
    except ValueError:  # the rules name a malformed stack where it matters
        return
    flat = [(kp, x) for kp, x in jax.tree_util.tree_flatten_with_path(model)[0] if is_array_like(x)]
    stacked = [(tuple(kp), x, a) for (kp, x), a in zip(flat, axes) if a]
    if not stacked:
        return
    for covered in covered_sets:
        vectors = [path_str(kp) for kp, x, a in stacked if kp in covered and x.ndim - a < 2]
        matrices = [kp for kp, x, a in stacked if x.ndim - a >= 2]
        if vectors or (matrices and not any(kp in covered for kp in matrices)):
            what = (f"it orthogonalises the stacked vectors {', '.join(vectors[:3])}"
                    f"{' ...' if len(vectors) > 3 else ''} as matrices" if vectors else
                    f"none of the {len(matrices)} stacked matrices ({path_str(matrices[0])}, ...) gets Muon")
            warn_user(
                f"optax.contrib.muon with its default rule (every 2-D array is a matrix, nothing else) meets stacked "
                f"layers here: {what}, and each layer's matrices go to AdamW. Pass "
                "muon_weight_dimension_numbers=redeqx.muon_dimensions(model, loss_fn, batch), which reads "
                "each weight's matrix dims from the program."
            )
            return
