"""Rematerialisation that holds on every backend: `checkpoint` for one call,
`remat` for the repeated blocks of any Equinox model.

``jax.checkpoint`` asks the compiler to recompute a block's activations in
the backward pass instead of keeping them. It marks the recomputation with
optimization barriers; XLA:CPU removes those barriers early and then merges
the recomputation with the forward pass (common-subexpression elimination),
so on CPU, where redeqx plans large models, it saves nothing (measured: the
same temporaries for 16 unrolled layers, 392 MiB, with and without it).

Here the backward pass recomputes the block from its inputs plus an exact
zero computed from the incoming gradient (``0 * g``, with ``g`` a finite
element of it). A compiler cannot prove that zero, so it can neither merge the
recomputation with the forward pass nor run it before the gradient arrives:
each block's activations exist only while its backward pass runs (the same
16 layers: 160 MiB). Adding a zero changes no value, except the sign of a
zero input (-0.0 + 0.0 = +0.0).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._typing import typechecked


def _floating(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray)) and jnp.issubdtype(x.dtype, jnp.floating)


def _finite_zero(x):
    return jnp.where(jnp.isfinite(x), x, 0) * 0


def tie(tree, cotangent):
    """``tree`` with an exact zero added to its floating arrays, computed from
    ``cotangent``: what depends on the result can only run once ``cotangent``
    exists, and is never merged with the same computation on ``tree``.

    An array shaped like a leaf of ``cotangent`` (a residual block's input and
    its output's gradient) gets that leaf times zero, elementwise, which needs
    no communication whatever the layout. If none is, the first floating array
    gets a zero from one element of the gradient.
    """
    cts = [c for c in jax.tree.leaves(cotangent) if _floating(c) and c.size]
    leaves, treedef = jax.tree.flatten(tree)
    if not cts:
        return tree
    by_shape = {c.shape: c for c in cts}
    out, tied = [], False
    for x in leaves:
        if _floating(x) and x.shape in by_shape:
            x, tied = x + _finite_zero(by_shape[x.shape]).astype(x.dtype), True
        out.append(x)
    if not tied:
        first = next((i for i, x in enumerate(out) if _floating(x)), None)
        if first is not None:
            probe = cts[0][(0,) * cts[0].ndim].astype(jnp.float32)
            out[first] = out[first] + _finite_zero(probe).astype(out[first].dtype)
    return jax.tree.unflatten(treedef, out)


def checkpoint(fn: Callable) -> Callable:
    """``fn`` whose intermediate values are recomputed in the backward pass:
    only its array inputs are kept from the forward pass. ``fn``'s non-array
    arguments are constants; when ``fn`` is a module, its arrays are inputs
    too (the recomputation is tied to the gradient through the call's other
    arguments, not through them, so no weight is copied).

    **Example:**

    ```python
    for block in self.blocks:
        x = redeqx.checkpoint(block)(x)
    ```
    """

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        own, own_def = jax.tree.flatten(fn)
        leaves, treedef = jax.tree.flatten((args, kwargs))
        is_dyn = [isinstance(x, (jax.Array, np.ndarray)) for x in own + leaves]
        static = [None if d else x for x, d in zip(own + leaves, is_dyn)]
        n_own = sum(is_dyn[:len(own)])

        def run(dyn):
            it = iter(dyn)
            full = [next(it) if d else s for d, s in zip(is_dyn, static)]
            f = jax.tree.unflatten(own_def, full[:len(own)])
            a, k = jax.tree.unflatten(treedef, full[len(own):])
            return f(*a, **k)

        @jax.custom_vjp
        def call(dyn):
            return run(dyn)

        def forward(dyn):
            return run(dyn), dyn

        def backward(dyn, ct):
            dyn = list(dyn[:n_own]) + tie(list(dyn[n_own:]), ct)
            _, vjp = jax.vjp(run, dyn)
            return vjp(ct)

        call.defvjp(forward, backward)
        return call([x for x, d in zip(own + leaves, is_dyn) if d])

    return wrapped


# ----------------------------------------------------------------------------- remat for any model


def _is_block(x) -> bool:
    """An Equinox module with at least two weight matrices (a transformer
    block, a residual stage), not a single layer."""
    if not isinstance(x, eqx.Module) or not callable(x):
        return False
    return sum(1 for a in jax.tree.leaves(x) if eqx.is_array(a) and a.ndim >= 2) >= 2


def _is_repeated_blocks(x) -> bool:
    return (isinstance(x, (list, tuple)) and len(x) >= 2 and all(_is_block(b) for b in x)
            and len({type(b) for b in x}) == 1)


@functools.lru_cache(maxsize=None)
def _rematerialised(cls):
    """A subclass of ``cls`` with the same fields (so the same paths, specs
    and checkpoint names) whose call runs under `checkpoint`."""

    def __call__(self, *args, **kwargs):
        return checkpoint(jax.tree_util.Partial(cls.__call__, self))(*args, **kwargs)

    return _with_call(cls, __call__)


def _with_call(cls, __call__):
    """A subclass of module class ``cls`` that differs only in its call: the
    same name, fields, paths and specs (what the models' swaps rely on)."""
    return type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                        "__qualname__": cls.__qualname__})


def _as(cls, module):
    new = object.__new__(cls)
    for name in vars(module):
        object.__setattr__(new, name, getattr(module, name))
    return new


def remat_blocks(model):
    """``model`` with each element of every list or tuple of two or more
    same-class blocks (see `_is_block`) rematerialised by `checkpoint`."""

    def swap(x):
        if not _is_repeated_blocks(x):
            return x
        blocks = [_as(_rematerialised(type(b)), b) for b in x]
        return type(x)(blocks) if isinstance(x, (list, tuple)) else blocks

    return jax.tree.map(swap, model, is_leaf=_is_repeated_blocks)


@typechecked
def remat(loss_fn: Callable) -> Callable:
    """``loss_fn`` whose model recomputes its repeated blocks' activations in
    the backward pass instead of keeping them: activation memory of one block
    (plus each block's input) for about one more forward pass of compute.

    A block is an element of a list or tuple of at least two modules of the
    same class, each holding at least two weight matrices (the layers of a
    transformer, the units of a ResNet stage); single layers are left alone.
    Paths, specs and checkpoints do not change; the result is the same loss
    and gradients.

    **Example:**

    ```python
    train_step = redeqx.make_train_step(redeqx.remat(loss_fn), optimizer, mesh, specs)
    ```
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be a function (model, batch, key) -> loss, got {loss_fn!r}.")

    @functools.wraps(loss_fn)
    def rematerialised(model, *args):
        return loss_fn(remat_blocks(model), *args)

    return rematerialised
