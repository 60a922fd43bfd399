"""Grouped convolutions whose weight gradient the partitioner gets right:
`exact_conv_grads`.

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

So the weight gradient is computed without that convolution: for each
offset of the kernel window, one ``dot_general`` of the incoming gradient
with the (padded, dilated, strided) slice of the input that offset reads,
batched over the groups and contracting batch and space. The partitioner
reduces a ``dot_general``'s split contracting dim over exactly the axes that
split it. It is the convolution's own multiply-adds; the offsets run in a
``lax.scan`` so one slice of the input lives at a time (written out, XLA:CPU
cuts all K = 49 slices of a 7 x 7 kernel before the first product: 3x the
step's temporaries). The cost: one small all-reduce (the weight's size over
K) per offset instead of one per weight, the same bytes in all
(docs/guides/troubleshooting.md has the figures).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

from .._rewrite import rewritten
from .._typing import typechecked

_CONV = "conv_general_dilated"
# A shard_map body is not partitioned over its manual axes, and its values carry
# per-axis types that an equation built outside it would not match: left as written.
_LEFT_ALONE = frozenset({"shard_map"})


def _is_grouped(eqn) -> bool:
    return (eqn.primitive.name == _CONV and eqn.params["feature_group_count"] > 1
            and eqn.params["batch_group_count"] == 1)


def weight_grad(lhs, g, rhs_shape, rhs_dtype, params):
    """The gradient of ``conv_general_dilated(lhs, rhs, **params)`` with respect
    to ``rhs``, given the output's gradient ``g``: one batched ``dot_general``
    per kernel offset, in a loop over the offsets."""
    dn = params["dimension_numbers"]
    groups = params["feature_group_count"]
    x = jnp.transpose(lhs, dn.lhs_spec)  # (N, C, *spatial)
    dy = jnp.transpose(g, dn.out_spec)  # (N, O, *out_spatial)
    kernel = [rhs_shape[d] for d in dn.rhs_spec[2:]]
    # the input as the window reads it: padded at the edges, lhs_dilation - 1 zeros between elements
    x = jax.lax.pad(x, jnp.zeros((), x.dtype), [(0, 0, 0), (0, 0, 0)] + [
        (lo, hi, d - 1) for (lo, hi), d in zip(params["padding"], params["lhs_dilation"])])
    (n, c), o, out_spatial = x.shape[:2], dy.shape[1], dy.shape[2:]
    # groups first, then the features kept, then those summed (batch, space): a dot_general's own layout
    x = x.reshape(n, groups, c // groups, *x.shape[2:]).swapaxes(0, 1).swapaxes(1, 2)  # (G, C/G, N, *spatial)
    dy = dy.reshape(n, groups, o // groups, *out_spatial).swapaxes(0, 1).swapaxes(1, 2)  # (G, O/G, N, *out_spatial)
    summed = tuple(range(2, 3 + len(kernel)))
    strides = params["window_strides"]
    extent = [(t - 1) * stride + 1 for t, stride in zip(out_spatial, strides)]  # what one offset's window spans
    offsets = np.array(list(itertools.product(*map(range, kernel))), np.int32).reshape(-1, len(kernel))

    def one_offset(_, offset):  # a loop, so that one window lives at a time (unrolled, XLA cuts all K at once)
        start = jnp.concatenate([jnp.zeros(3, jnp.int32), offset * np.asarray(params["rhs_dilation"], np.int32)])
        window = jax.lax.dynamic_slice(x, start, (*x.shape[:3], *extent))
        window = jax.lax.slice(window, (0,) * window.ndim, window.shape, (1, 1, 1, *strides))  # (G, C/G, N, *out_spatial)
        return None, jax.lax.dot_general(dy, window, ((summed, summed), ((0,), (0,))), precision=params["precision"],
                                         preferred_element_type=jnp.promote_types(rhs_dtype, jnp.float32))

    _, parts = jax.lax.scan(one_offset, None, offsets)  # (K, G, O/G, C/G)
    w = jnp.moveaxis(parts, 0, -1).reshape(o, c // groups, *kernel).astype(rhs_dtype)  # (O, C/G, *kernel)
    return jnp.transpose(w, np.argsort(dn.rhs_spec))


def _exact_conv(prim, params) -> Callable:
    """``prim.bind(lhs, rhs, **params)`` (a grouped convolution) whose weight
    gradient is `weight_grad`; the input's gradient is JAX's own."""

    def conv(lhs, rhs):
        return prim.bind(lhs, rhs, **params)

    @jax.custom_vjp
    def exact(lhs, rhs):
        return conv(lhs, rhs)

    def fwd(lhs, rhs):
        return conv(lhs, rhs), (lhs, rhs)

    def bwd(res, g):
        lhs, rhs = res
        _, lhs_vjp = jax.vjp(lambda x: conv(x, rhs), lhs)
        return lhs_vjp(g)[0], weight_grad(lhs, g, rhs.shape, rhs.dtype, params)

    exact.defvjp(fwd, bwd)
    return exact


def _exact_conv_eqn(eqn):
    """A ``jit`` call of `_exact_conv` in ``eqn``'s place: same operands, same result."""
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
    (call,) = jax.make_jaxpr(jax.jit(_exact_conv(eqn.primitive, eqn.params)))(*avals).jaxpr.eqns
    return call.replace(invars=list(eqn.invars), outvars=list(eqn.outvars))


def _rewrite_jaxpr(jaxpr: jex.Jaxpr) -> tuple[jex.Jaxpr, int]:
    eqns, found = [], 0
    for eqn in jaxpr.eqns:
        if _is_grouped(eqn):
            eqn, found = _exact_conv_eqn(eqn), found + 1
        elif eqn.primitive.name not in _LEFT_ALONE:
            params = {}
            for name, value in eqn.params.items():
                new, inner = _rewrite_param(value)
                if inner:
                    params[name], found = new, found + inner
            if params:
                eqn = eqn.replace(params={**eqn.params, **params})
        eqns.append(eqn)
    return (jaxpr.replace(eqns=eqns) if found else jaxpr), found


def _rewrite_param(value):
    """A param holding a program (a scan's or a jit's body, a checkpoint's,
    a cond's branches), rewritten; and how many convolutions that was."""
    if isinstance(value, jex.ClosedJaxpr):
        inner, found = _rewrite_jaxpr(value.jaxpr)
        return (jex.ClosedJaxpr(inner, value.consts) if found else value), found
    if isinstance(value, jex.Jaxpr):
        return _rewrite_jaxpr(value)
    if isinstance(value, tuple) and any(isinstance(v, (jex.ClosedJaxpr, jex.Jaxpr)) for v in value):
        rewritten_values = [_rewrite_param(v) for v in value]
        return tuple(v for v, _ in rewritten_values), sum(n for _, n in rewritten_values)
    return value, 0


def exact_grouped_convs(closed: jex.ClosedJaxpr) -> jex.ClosedJaxpr:
    """Every grouped convolution in ``closed`` (and in the programs it calls)
    with its weight gradient from `weight_grad`: a rewrite for
    `redeqx._rewrite.rewritten`."""
    inner, found = _rewrite_jaxpr(closed.jaxpr)
    return jex.ClosedJaxpr(inner, closed.consts) if found else closed


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

    `make_train_step` applies it to ``loss_fn`` already. In a step you write
    with `make_step`, apply it to the function you differentiate. ``fn`` is
    traced once per call; its non-array arguments are constants.

    **Example:**

    ```python
    def step_fn(state, batch):
        grads = eqx.filter_grad(redeqx.exact_conv_grads(loss))(state.model, batch)
        return redeqx.apply_gradients(state, grads, optimizer), {}
    ```
    """
    if not callable(fn):
        raise TypeError(f"exact_conv_grads: fn must be a function to differentiate, got {fn!r}.")
    return rewritten(fn, exact_grouped_convs)
