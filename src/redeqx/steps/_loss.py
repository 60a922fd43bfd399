"""The user's ``loss_fn``, called and differentiated: gradient functions
composed like optax's transformations.

A gradient function maps ``(params, static, batch, key, model_state)`` to
``(loss, aux, grads, model_state)``: ``params`` are the trainable arrays
(``eqx.partition``'s first half), ``static`` the rest of the model,
``model_state`` the model's ``eqx.nn.State`` or None. `loss_and_grads`
makes one from ``loss_fn``; `accumulated` runs one over micro-batches;
`redeqx.steps._shard_mean.shard_mean` runs one on each data shard's rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ._conv_grads import exact_grouped_convs
from ._batch_pins import on_mesh
from ._per_shard import per_data_shard
from ._fp8 import fp8_matmuls
from ._remat import ScanResiduals, keep_products
from ..mesh import CONTEXT, DATA
from .._rewrite import rewritten
from .._trees import is_floating
from .._typing import STATEFUL_CALL, STATEFUL_EXAMPLE, check_signature, fn_name, short_repr, takes

GradFn = Callable[..., tuple[Any, dict, Any, Any]]


# ----------------------------------------------------------------------------- checking the user's functions



def check_user_fn(fn, role: str, call: str, example: str) -> None:
    """A ``loss_fn`` or ``pred_fn``: callable with 3 arguments, or 4 with a model_state."""
    if not callable(fn):
        raise TypeError(f"{role} must be a function {call} -> ..., got {short_repr(fn)}.")
    check_signature(fn, role, (3, 4), call, example)


def _scalar_metric(fn, key: str, value):
    where = f"loss_fn {fn_name(fn)!r} aux[{key!r}]"
    try:
        v = jnp.asarray(value)
    except TypeError:
        raise TypeError(f"{where} is a {type(value).__name__}; aux values must be numbers (scalar arrays).") from None
    if not (jnp.issubdtype(v.dtype, jnp.number) or v.dtype == jnp.bool_):
        raise TypeError(f"{where} has dtype {v.dtype}; aux values must be numbers (scalar arrays).")
    if v.shape != ():
        raise ValueError(
            f"{where} has shape {v.shape}, but aux values must be scalars (they are logged, and averaged over "
            f"examples by redeqx.evaluate). Reduce it, e.g. jnp.mean({key}); return per-example outputs from "
            "pred_fn instead."
        )
    return v.astype(jnp.float32) if jnp.issubdtype(v.dtype, jnp.floating) or v.dtype == jnp.bool_ else v


def _unpack(loss_fn, out, stateful: bool):
    name = fn_name(loss_fn)
    if not stateful:
        if not isinstance(out, tuple):
            return out, {}, None
        if len(out) != 2 or not isinstance(out[1], dict):
            raise TypeError(
                f"loss_fn {name!r} must return a scalar loss or (loss, aux_dict), got a tuple of {len(out)} items "
                f"({', '.join(type(o).__name__ for o in out)})."
            )
        return out[0], out[1], None
    if not (isinstance(out, tuple) and len(out) in (2, 3)):
        raise TypeError(
            f"loss_fn {name!r} gets a model_state, so it must return (loss, new_model_state) or "
            f"(loss, aux_dict, new_model_state), got {type(out).__name__}."
        )
    loss, aux, new_state = (out[0], {}, out[1]) if len(out) == 2 else out
    if not isinstance(aux, dict):
        raise TypeError(f"loss_fn {name!r} returned aux of type {type(aux).__name__}; aux must be a dict.")
    return loss, aux, new_state


def _note_batch(error: Exception, name: str, batch) -> None:
    """An error raised inside ``loss_fn`` (a float label into an integer-label loss, a missing
    feature) gets a note saying what the batch it was traced on holds: each key's dtype and shape,
    where the error itself names none of them."""
    if not hasattr(error, "add_note") or any("redeqx: raised inside" in n for n in getattr(error, "__notes__", ())):
        return
    leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    said = ", ".join(f"batch{jax.tree_util.keystr(path)}: {getattr(x, 'dtype', type(x).__name__)}"
                     f"{list(getattr(x, 'shape', ()))}" for path, x in leaves[:12])
    error.add_note(f"redeqx: raised inside loss_fn {name!r}, traced on a batch of {said}"
                   + (" ..." if len(leaves) > 12 else "") + ".")


def call_loss(loss_fn, model, batch, key, model_state=None):
    """``loss_fn(model, batch, key[, model_state])``, checked: ``(float32
    loss, aux of scalars, new model_state or None)``."""
    name = fn_name(loss_fn)
    if model_state is not None:
        check_signature(loss_fn, "loss_fn", 4, STATEFUL_CALL, STATEFUL_EXAMPLE)
    elif takes(loss_fn, 3) is False:
        raise TypeError(
            f"loss_fn {name!r} takes a model_state (4 arguments: {STATEFUL_CALL}), but none was given: make the "
            "state with redeqx.init_state(..., model_state=state) (eqx.nn.make_with_state gives it), and pass "
            "model_state= to redeqx.evaluate, redeqx.predict or an eval step's call.")
    try:
        out = loss_fn(model, batch, key) if model_state is None else loss_fn(model, batch, key, model_state)
    except Exception as e:
        _note_batch(e, name, batch)
        raise
    loss, aux, new_state = _unpack(loss_fn, out, model_state is not None)
    if model_state is not None and jax.tree.structure(new_state) != jax.tree.structure(model_state):
        raise TypeError(
            f"loss_fn {name!r} gets a model_state, so it must return (loss, new_model_state) or (loss, aux_dict, "
            f"new_model_state); what it returned as the new model_state ({short_repr(new_state)}) is not a "
            "model_state like the one it was given. Return the state the model's layers gave back (e.g. "
            "`out, state = model(x, state)`), and any metrics as the middle item.")
    if isinstance(loss, dict):
        raise TypeError(
            f"loss_fn {name!r} returned a dict as its loss; return the scalar to minimise, with any metrics "
            "as aux: `return loss, {'accuracy': acc}`."
        )
    try:
        loss = jnp.asarray(loss)
    except TypeError:
        raise TypeError(f"loss_fn {name!r} returned a {type(loss).__name__} as its loss; return a scalar array.") from None
    if not jnp.issubdtype(loss.dtype, jnp.floating):
        raise TypeError(
            f"loss_fn {name!r} returned a loss of dtype {loss.dtype}: the gradient of an integer is zero, so "
            "nothing would train. Return a differentiable float loss (e.g. a cross-entropy); counts such as an "
            "error rate belong in the aux dict."
        )
    if loss.shape != ():
        raise ValueError(
            f"loss_fn {name!r} must return a scalar loss, got shape {loss.shape}. "
            "Reduce it over the batch, e.g. `return jnp.mean(per_example_loss)`."
        )
    clash = sorted(set(aux) & {"loss", "grad_norm"})
    if clash:
        raise ValueError(f"loss_fn {name!r} returned aux keys {clash}, which redeqx's metrics use; rename them.")
    aux = {k: _scalar_metric(loss_fn, k, v) for k, v in aux.items()}
    return loss.astype(jnp.float32), aux, new_state


def cast_floats(tree, dtype):
    """``tree`` with its floating arrays cast to ``dtype`` (None: unchanged)."""
    if dtype is None:
        return tree
    return jax.tree.map(lambda x: x.astype(dtype) if eqx.is_array(x) and is_floating(x) else x, tree)


# ----------------------------------------------------------------------------- gradient functions


def loss_and_grads(loss_fn, compute_dtype=None, *, inference: bool = False,
                   scan_residuals: ScanResiduals = "products", mesh: Mesh | None = None,
                   microbatches: int | None = None, weights_over_data: bool = False, specs=None,
                   fp8: bool = False) -> GradFn:
    """The gradient function of ``loss_fn``: model and batch floats cast to
    ``compute_dtype`` for the computation (gradients come back in the
    parameters' own dtypes); ``inference=True`` with dropout off;
    ``scan_residuals="products"``: ``loss_fn``'s scans keep only their
    non-elementwise results for the backward pass (`scans_keep_products`).
    Grouped convolutions take their weight gradient from matrix products
    (`redeqx.exact_conv_grads`: XLA's own is ``n_model_shards`` times too
    large under redeqx's batch layout). Both rewrite one trace of ``loss_fn``. On a ``mesh`` with
    pipeline stages, its stacked layers run as a pipeline of ``microbatches``
    (`redeqx.steps._pipeline.pipelined_layer_scans`). ``fp8``: its weight-by-activation products
    in float8 (`redeqx.steps._fp8.fp8_matmuls`). On a ``mesh``, FFTs, ``top_k`` and grouped
    convolutions run on each data shard's rows (`redeqx.steps._per_shard.per_data_shard`), rewritten
    first. With weights split over ``data``
    (fsdp), the model's layout pins keep the batch split over ``data``
    (`redeqx.steps._batch_pins.batch_over_data`)."""
    if mesh is not None:
        loss_fn = per_data_shard(loss_fn, mesh)
    if fp8:
        loss_fn = fp8_matmuls(loss_fn)
    loss_fn = rewritten(loss_fn, exact_grouped_convs, *([keep_products] if scan_residuals == "products" else []))
    if mesh is not None:
        loss_fn = on_mesh(loss_fn, mesh, microbatches, weights_over_data=weights_over_data, specs=specs)

    def grads_of(params, static, batch, key, model_state):
        def loss_of(params):
            model = eqx.combine(params, static)
            if inference:
                model = eqx.nn.inference_mode(model, True)
            loss, aux, new_state = call_loss(loss_fn, cast_floats(model, compute_dtype),
                                             cast_floats(batch, compute_dtype), key, model_state)
            return loss, (aux, new_state)

        (loss, (aux, new_state)), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
        return loss, aux, grads, new_state

    return grads_of


def micro_batches(batch, accumulate: int, mesh: Mesh | None):
    """(B, ...) -> (accumulate, B / accumulate, ...). Micro-batch j holds rows
    j, j + accumulate, j + 2 accumulate, ... so each data shard keeps its own
    rows and the split moves nothing between devices. ``mesh=None``: the rows
    of one data shard (inside `jax.shard_map`), which this split cuts into the
    same micro-batches as the whole batch's split does on that shard."""
    n_data = 1 if mesh is None else mesh.shape[DATA]

    def split(x):
        b = x.shape[0]
        if b % accumulate or (b // accumulate) % n_data:
            where = (f"a data shard's {b} rows into equal micro-batches" if mesh is None else
                     f"a batch of {b} rows into micro-batches that the {n_data}-way data axis also splits")
            raise ValueError(
                f"accumulate={accumulate} cannot split {where}: make per_device_batch_size a multiple of "
                f"accumulate (rows per step = per_device_batch_size * {mesh.shape[DATA] if mesh else 'data shards'})."
            )
        x = x.reshape(b // accumulate, accumulate, *x.shape[1:]).swapaxes(0, 1)
        if mesh is None:
            return x
        # on a mesh with a context axis a sequence dim keeps its split (left to the batch's own layout)
        rest = P.UNCONSTRAINED if CONTEXT in mesh.axis_names else None
        spec = P(None, DATA, *([rest] * (x.ndim - 2)))
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    return jax.tree.map(split, batch)


def accumulated(grad_fn: GradFn, accumulate: int, mesh: Mesh | None) -> GradFn:
    """``grad_fn`` averaged over ``accumulate`` micro-batches run one after
    another (a ``lax.scan``), split by `micro_batches`; the model state
    threads through them. ``accumulate=1``: ``grad_fn`` itself."""
    if accumulate == 1:
        return grad_fn

    def grads_of(params, static, batch, key, model_state):
        micro = micro_batches(batch, accumulate, mesh)
        keys = jax.random.split(key, accumulate)
        first = jax.tree.map(lambda x: x[0], micro)
        shapes = jax.eval_shape(lambda: grad_fn(params, static, first, keys[0], model_state)[:3])
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

        def body(carry, xs):
            total, model_state = carry
            *out, model_state = grad_fn(params, static, *xs, model_state)
            return (jax.tree.map(jnp.add, total, tuple(out)), model_state), None

        (total, model_state), _ = jax.lax.scan(body, (zeros, model_state), (micro, keys))
        loss, aux, grads = jax.tree.map(lambda x: x / accumulate, total)
        return loss, aux, grads, model_state

    return grads_of
