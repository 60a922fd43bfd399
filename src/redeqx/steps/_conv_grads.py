"""Grouped convolutions whose weight gradient the partitioner gets right:
`exact_conv_grads` (around a function to differentiate) and
`products_for_batch_grouped_convs` (a rewrite of a program that already
differentiates, which `make_step` applies to the step it compiles).

XLA's fault (jax 0.10.2, under Shardy and under GSPMD): the weight gradient
of a grouped convolution (``feature_group_count > 1``: ``eqx.nn.Conv(...,
groups=g)``, depthwise convolutions) is itself a convolution, with
``batch_group_count = g``, that contracts the batch. When that batch is
split over ``data`` and replicated over ``model`` (how redeqx lays out every
batch), the SPMD partitioner sums the per-device partial results with an
all-reduce over *every* device (``replica_groups={{0,...,7}}`` on a 4 x 2
mesh) where the data groups alone hold distinct rows (``{0,2,4,6},{1,3,5,7}``):
each of the ``n_model_shards`` identical copies is added in, and the gradient
comes out ``n_model_shards`` times too large. The forward pass and the input
gradient (convolutions with ``feature_group_count``, contracting channels)
are right, and so is a batch split over ``model`` too, or channels split
over ``model``. docs/guides/troubleshooting.md has the repro.

So a convolution with ``batch_group_count > 1`` (what JAX's transpose rule
makes of a grouped convolution's weight gradient; nothing else makes one)
is computed without XLA's convolution (`batch_grouped_conv`): for each
position of its output window (an offset of the original kernel), one
``dot_general`` of the (padded, dilated, strided) slice of the input that
position reads with the other operand, batched over the groups and
contracting the rest. The partitioner reduces a ``dot_general``'s split
contracting dim over exactly the axes that split it. It is the
convolution's own multiply-adds; the positions run in a ``lax.scan`` so one
slice of the input lives at a time (written out, XLA:CPU cuts all K = 49
slices of a 7 x 7 kernel before the first product: 3x the step's
temporaries). The cost: one small all-reduce (the weight's size over K) per
position instead of one per weight, the same bytes in all
(docs/guides/troubleshooting.md has the figures).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

from .._rewrite import call_in_place, rewritten
from .._typing import typechecked

_CONV = "conv_general_dilated"
# A shard_map body is not partitioned over its manual axes, and its values carry
# per-axis types that an equation built outside it would not match: left as written.
_LEFT_ALONE = frozenset({"shard_map"})


def _is_grouped(eqn) -> bool:
    return (eqn.primitive.name == _CONV and eqn.params["feature_group_count"] > 1
            and eqn.params["batch_group_count"] == 1)


def _is_batch_grouped(eqn) -> bool:
    return (eqn.primitive.name == _CONV and eqn.params["batch_group_count"] > 1
            and eqn.params["feature_group_count"] == 1)


def batch_grouped_conv(lhs, rhs, params):
    """``conv_general_dilated(lhs, rhs, **params)`` for ``batch_group_count = G > 1``
    (the lhs batch and the output features cut into G groups, group ``b`` of the
    one convolved with group ``b`` of the other), by one batched ``dot_general``
    per output position, in a loop over the positions."""
    dn = params["dimension_numbers"]
    groups, strides, rhs_dilation = params["batch_group_count"], params["window_strides"], params["rhs_dilation"]
    x = jnp.transpose(lhs, dn.lhs_spec)  # (N, C, *space)
    w = jnp.transpose(rhs, dn.rhs_spec)  # (O, C, *kernel)
    # the input as the window reads it: padded at the edges, lhs_dilation - 1 zeros between elements
    x = jax.lax.pad(x, jnp.zeros((), x.dtype), [(0, 0, 0), (0, 0, 0)] + [
        (lo, hi, d - 1) for (lo, hi), d in zip(params["padding"], params["lhs_dilation"])])
    (n, c), (o, kernel) = x.shape[:2], (w.shape[0], w.shape[2:])
    extent = [(k - 1) * d + 1 for k, d in zip(kernel, rhs_dilation)]  # what one position's window spans
    out_space = [(s - e) // st + 1 for s, e, st in zip(x.shape[2:], extent, strides)]
    # groups first, then the kept dims, then the summed ones (features, window): a dot_general's own layout
    x = x.reshape(groups, n // groups, c, *x.shape[2:])  # (G, N/G, C, *space)
    w = w.reshape(groups, o // groups, c, *kernel)  # (G, O/G, C, *kernel)
    summed = tuple(range(2, 3 + len(kernel)))
    positions = np.array(list(itertools.product(*map(range, out_space))), np.int32).reshape(-1, len(kernel))

    def one_position(_, position):  # a loop, so that one window lives at a time
        start = jnp.concatenate([jnp.zeros(3, jnp.int32), position * np.asarray(strides, np.int32)])
        window = jax.lax.dynamic_slice(x, start, (*x.shape[:3], *extent))
        window = jax.lax.slice(window, (0,) * window.ndim, window.shape, (1, 1, 1, *rhs_dilation))  # (G, N/G, C, *kernel)
        return None, jax.lax.dot_general(window, w, ((summed, summed), ((0,), (0,))), precision=params["precision"],
                                         preferred_element_type=params["preferred_element_type"])

    _, parts = jax.lax.scan(one_position, None, positions)  # (positions, G, N/G, O/G)
    out = parts.transpose(2, 1, 3, 0).reshape(n // groups, o, *out_space)  # (N/G, O, *out_space)
    return jnp.transpose(out, np.argsort(dn.out_spec))


def _products_eqn(eqn):
    return call_in_place(eqn, lambda lhs, rhs: batch_grouped_conv(lhs, rhs, eqn.params))


def _exact_conv(prim, params) -> Callable:
    """``prim.bind(lhs, rhs, **params)`` (a grouped convolution) whose
    gradients are JAX's own, with the weight's (a batch-grouped convolution)
    computed by `batch_grouped_conv`."""

    def conv(lhs, rhs):
        return prim.bind(lhs, rhs, **params)

    def conv_vjp(lhs, rhs, g):
        return jax.vjp(conv, lhs, rhs)[1](g)

    @jax.custom_vjp
    def exact(lhs, rhs):
        return conv(lhs, rhs)

    def fwd(lhs, rhs):
        return conv(lhs, rhs), (lhs, rhs)

    def bwd(res, g):
        return tuple(rewritten(conv_vjp, products_for_batch_grouped_convs)(*res, g))

    exact.defvjp(fwd, bwd)
    return exact


def _exact_conv_eqn(eqn):
    return call_in_place(eqn, _exact_conv(eqn.primitive, eqn.params))


def _rewrite_jaxpr(jaxpr: jex.Jaxpr, matches, replace) -> tuple[jex.Jaxpr, int]:
    """``jaxpr`` with each equation that ``matches`` (in it and in the programs
    it calls) replaced by ``replace(eqn)``; and how many that was."""
    eqns, found = [], 0
    for eqn in jaxpr.eqns:
        if matches(eqn):
            eqn, found = replace(eqn), found + 1
        elif eqn.primitive.name not in _LEFT_ALONE:
            params = {}
            for name, value in eqn.params.items():
                new, inner = _rewrite_param(value, matches, replace)
                if inner:
                    params[name], found = new, found + inner
            if params:
                eqn = eqn.replace(params={**eqn.params, **params})
        eqns.append(eqn)
    return (jaxpr.replace(eqns=eqns) if found else jaxpr), found


def _rewrite_param(value, matches, replace):
    """A param holding a program (a scan's or a jit's body, a checkpoint's,
    a cond's branches), rewritten; and how many equations that was."""
    if isinstance(value, jex.ClosedJaxpr):
        inner, found = _rewrite_jaxpr(value.jaxpr, matches, replace)
        return (jex.ClosedJaxpr(inner, value.consts) if found else value), found
    if isinstance(value, jex.Jaxpr):
        return _rewrite_jaxpr(value, matches, replace)
    if isinstance(value, tuple) and any(isinstance(v, (jex.ClosedJaxpr, jex.Jaxpr)) for v in value):
        rewritten_values = [_rewrite_param(v, matches, replace) for v in value]
        return tuple(v for v, _ in rewritten_values), sum(n for _, n in rewritten_values)
    return value, 0


def _rewrite_closed(closed: jex.ClosedJaxpr, matches, replace) -> jex.ClosedJaxpr:
    inner, found = _rewrite_jaxpr(closed.jaxpr, matches, replace)
    return jex.ClosedJaxpr(inner, closed.consts) if found else closed


def exact_grouped_convs(closed: jex.ClosedJaxpr) -> jex.ClosedJaxpr:
    """Every grouped convolution in ``closed`` (and in the programs it calls)
    made to take its weight gradient from `batch_grouped_conv`, and every
    batch-grouped one it already holds (a gradient taken inside the function:
    MAML's inner step, a penalty on a weight's gradient) computed by it: a
    rewrite, for `redeqx._rewrite.rewritten`, of a program yet to be
    differentiated. (Before the second, a loss's inner gradient of a grouped
    convolution's weight came out ``n_model_shards`` times too large.)"""
    return _rewrite_closed(closed, lambda e: _is_grouped(e) or _is_batch_grouped(e),
                           lambda e: _exact_conv_eqn(e) if _is_grouped(e) else _products_eqn(e))


def products_for_batch_grouped_convs(closed: jex.ClosedJaxpr) -> jex.ClosedJaxpr:
    """Every batch-grouped convolution in ``closed`` (a grouped convolution's
    weight gradient, in a program that already differentiates) computed by
    `batch_grouped_conv`: a rewrite for `redeqx._rewrite.rewritten`."""
    return _rewrite_closed(closed, _is_batch_grouped, _products_eqn)


@typechecked
def exact_conv_grads(fn: Callable) -> Callable:
    """``fn`` whose grouped and depthwise convolutions (``eqx.nn.Conv1d/2d/3d``
    or ``ConvTranspose`` with ``groups > 1``, any ``lax.conv_general_dilated``
    with ``feature_group_count > 1``) get their weight gradient from batched
    matrix products instead of XLA's grouped weight-gradient convolution,
    which XLA's partitioner sums over the ``model`` axis too when the batch
    is split over ``data`` only (the gradient comes out ``n_model_shards``
    times too large; docs/guides/troubleshooting.md). Values, and gradients
    on one device, do not change.

    `make_train_step` applies it to ``loss_fn`` already, and `make_step`
    computes the same weight gradients in the step it compiles; apply it
    yourself around a function you differentiate under your own
    ``jax.jit``. ``fn`` is traced once per call; its non-array arguments are
    constants.

    **Example:**

    ```python
    grad_fn = jax.jit(eqx.filter_grad(redeqx.exact_conv_grads(loss)))
    grads = grad_fn(model, batch)  # one device's gradient, on any layout
    ```
    """
    if not callable(fn):
        raise TypeError(f"exact_conv_grads: fn must be a function to differentiate, got {fn!r}.")
    return rewritten(fn, exact_grouped_convs)
