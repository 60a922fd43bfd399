"""The program reader: each weight's role, read from the jaxpr of ``loss_fn``.

`read_program` traces ``loss_fn(model, batch, key)`` on abstract shapes
(nothing is computed or allocated) and walks its jaxpr once, nested calls
included (``jit``, ``remat``, ``custom_jvp``/``custom_vjp``, ``scan``,
``while``, ``cond``). It follows two kinds of values:

- a *view* of weights: a weight as read, transposed, cast, scaled, sliced by
  a ``scan`` (its layer axis) or indexed, or normalised by statistics of
  weights (weight and spectral normalisation); each of the view's dims says
  which dim of which weight it is;
- an activation *split* by a candidate column-parallel layer: every matmul or
  conv of a weight with an activation is a *seed* whose output is split on the
  weight's produced dim. The split is carried forward through the ops that
  keep it local (elementwise ops, transposes, reshapes that keep it the
  leading factor, batched contractions such as attention's, reductions over
  other dims) until it reaches a weight that contracts it (a row-parallel
  partner), a reduction over it (a vocabulary-parallel loss), or an op that
  would need the whole activation (then the seed is blocked, with the reason).

The facts it returns are independent of the mesh; `_roles` turns them into
specs for one ``n_model_shards``. Each handler below is one primitive family.
"""

from __future__ import annotations

import equinox as eqx
import jax

from .._trees import is_array_like
from . import _loops
from . import _ops
from . import _topk
from ._contract import contract, convolve, grouped_contract
from ._facts import Facts
from ._reader import Reader, View

HANDLERS = {name: _ops.elementwise for name in _ops.ELEMENTWISE}
HANDLERS.update({name: _ops.reduction for name in _ops.REDUCTIONS})
HANDLERS["psum"] = _ops.psum
HANDLERS.update({name: _ops.ordered for name in _ops.ORDERED})
HANDLERS.update({name: _ops.pool for name in _ops.POOLS})
HANDLERS.update({
    "transpose": _ops.transpose, "broadcast_in_dim": _ops.broadcast_in_dim, "reshape": _ops.reshape,
    "squeeze": _ops.squeeze, "rev": _ops.rev, "fft": _ops.fft, "dynamic_update_slice": _ops.update_slice,
    "slice": _ops.slicing, "dynamic_slice": _ops.slicing, "pad": _ops.slicing,
    "concatenate": _ops.concatenate, "gather": _ops.gather, "split": _ops.split, "stack": _ops.stack,
    "scatter-add": _ops.scatter, "scatter": _ops.scatter, "scatter-max": _ops.scatter, "scatter-min": _ops.scatter,
    "scatter-mul": _ops.scatter,
    "dot_general": contract, "ragged_dot_general": grouped_contract, "conv_general_dilated": convolve, "scan": _loops.scan, "while": _loops.while_loop,
    "cond": _loops.cond, "<call>": _loops.call, "<unknown>": _ops.unknown,
})
HANDLERS.update({"top_k": _topk.top_k, "scatter": _topk.scatter})
HANDLERS.update({name: _topk.carrying_indices(HANDLERS[name]) for name in _topk.CARRIES_INDICES})


def read_program(model, loss_fn, batch, paths: list[str], model_state=None) -> Facts:
    """The facts of ``loss_fn(model, batch, key)``'s program (``loss_fn(model, batch, key,
    model_state)`` given a ``model_state``) about each array leaf of ``model`` (flatten order, as
    in ``paths``), read on abstract shapes."""
    params, static = eqx.partition(model, _is_leaf)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
    batch, state = (jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x, t)
                    for t in (batch, model_state))
    key = jax.eval_shape(lambda: jax.random.key(0))

    def program(flat, b, k, s):
        m = eqx.combine(jax.tree_util.tree_unflatten(treedef, flat), static)
        return loss_fn(m, b, k) if model_state is None else loss_fn(m, b, k, s)

    closed = jax.make_jaxpr(program)(abstract, batch, key, state)
    facts = _read(closed.jaxpr, paths, abstract, len(jax.tree.leaves(state)), seed_last=False)
    if facts.several_outputs:  # an expert stack: its experts split, or its hidden units (`_roles.decide_read`)
        facts.alternative = _read(closed.jaxpr, paths, abstract, len(jax.tree.leaves(state)), seed_last=True)
    return facts


def _read(jaxpr, paths: list[str], abstract, n_state: int, *, seed_last: bool) -> Facts:
    """One reading of the program's ``jaxpr``: its first ``len(abstract)`` inputs the model's
    leaves, its last ``n_state`` inputs and outputs the model state's."""
    facts = Facts(paths, [tuple(x.shape) for x in abstract], [x.dtype.itemsize for x in abstract], seed_last)
    reader = Reader(facts, HANDLERS)
    n = len(abstract)
    views = [View(((i, tuple(range(len(x.shape)))),)) for i, x in enumerate(abstract)]
    views += [None] * (len(jaxpr.invars) - n)
    # the model state's buffers (BatchNorm's running statistics, its last inputs and outputs) are read as
    # constants: a split activation's statistics folded into them is no residual stream, and a split
    # reaching the new state (a buffer's few numbers, gathered as the step returns it) costs nothing.
    # So are the model's integer and boolean leaves (buffers: a relative position index as timm
    # registers one, a mask), which no step trains: a table gathered by one is still the weight, as
    # by a NumPy index array (read as token ids, it kept Swin's attention whole).
    constant = [not jax.numpy.issubdtype(x.dtype, jax.numpy.inexact) for x in abstract]
    constant += [False] * (len(jaxpr.invars) - n - n_state) + [True] * n_state
    _, out_tags, _ = reader.run(jaxpr, views, [{}] * len(jaxpr.invars), constant)
    for tags in out_tags[:len(out_tags) - n_state]:
        for seed in tags:
            facts.reduce(seed, "reaches the loss's outputs while split", whole=True)
    return facts


def _is_leaf(x) -> bool:
    return is_array_like(x)
