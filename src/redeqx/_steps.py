"""Compiled, sharded step functions: the general `make_step` and the train,
eval and predict steps built on it."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ._distributed import settle
from ._mesh import DATA
from ._state import TrainState, _trainable_params
from ._typing import typechecked


ARRAY_TYPES = (jax.Array, np.ndarray, np.generic)


def _placement(x, mesh: Mesh):
    """Where a state leaf lives: its own NamedSharding on ``mesh``, else replicated."""
    sh = getattr(x, "sharding", None)
    if isinstance(sh, NamedSharding) and (sh.mesh is mesh or sh.mesh == mesh):
        return sh
    return NamedSharding(mesh, P())


class _CompiledStep:
    """Holds one ``jax.jit`` per (state structure, state shardings); see `make_step`."""

    def __init__(self, step_fn: Callable, mesh: Mesh, donate: bool):
        self.step_fn = step_fn
        self.mesh = mesh
        self.donate = donate
        self._jitted: dict[Any, Callable] = {}
        functools.update_wrapper(self, step_fn)

    def _build(self, treedef, static_leaves, mask, shardings):
        step_fn = self.step_fn

        def inner(dyn_leaves, args):
            it = iter(dyn_leaves)
            leaves = [next(it) if m else s for m, s in zip(mask, static_leaves)]
            state = jax.tree.unflatten(treedef, leaves)
            result = step_fn(state, *args)
            if not (isinstance(result, tuple) and len(result) == 2):
                raise TypeError(
                    f"step_fn {getattr(step_fn, '__name__', step_fn)!r} must return (new_state, outputs), "
                    f"got {type(result).__name__}."
                )
            new_state, out = result
            new_leaves, new_def = jax.tree.flatten(new_state)
            if new_def != treedef:
                raise ValueError(
                    f"step_fn {getattr(step_fn, '__name__', step_fn)!r} returned a state whose structure differs "
                    f"from its input:\n  in:  {treedef}\n  out: {new_def}\n"
                    "A step must return a state of the same structure (same fields, same array leaves)."
                )
            for x, m, old in zip(new_leaves, mask, static_leaves):
                if not m and isinstance(x, jax.Array):
                    raise TypeError(
                        f"step_fn returned an array where its input state held the constant {old!r}; a state "
                        "leaf that changes from step to step must be an array in the input too "
                        "(e.g. jnp.asarray(0) instead of 0)."
                    )
            new_dyn = [x for x, m in zip(new_leaves, mask) if m]
            return new_dyn, out

        return jax.jit(
            inner,
            out_shardings=(list(shardings), None),
            donate_argnums=(0,) if self.donate else (),
        )

    def _prepare(self, state):
        leaves, treedef = jax.tree.flatten(state)
        mask = tuple(isinstance(x, ARRAY_TYPES) for x in leaves)
        dyn = [x for x, m in zip(leaves, mask) if m]
        static_leaves = tuple(None if m else x for x, m in zip(leaves, mask))
        # the arrays' own shardings key the cache: after the first step they are the
        # very objects the compiled step put on its outputs, so the lookup is cheap
        current = tuple(x.sharding if isinstance(x, jax.Array) else None for x in dyn)
        cache_key = (treedef, mask, static_leaves, current)
        hit = self._jitted.get(cache_key)
        if hit is None:
            shardings = tuple(_placement(x, self.mesh) for x in dyn)
            fn = self._jitted.get((treedef, mask, static_leaves, shardings))
            if fn is None:
                fn = self._build(treedef, static_leaves, mask, shardings)
                self._jitted[(treedef, mask, static_leaves, shardings)] = (fn, shardings)
            hit = self._jitted[cache_key] = (fn, shardings)
        fn, shardings = hit
        dyn = [x if cur == s else jax.device_put(x, s) for x, cur, s in zip(dyn, current, shardings)]
        return fn, dyn, treedef, mask, static_leaves

    def __call__(self, state, *args):
        fn, dyn, treedef, mask, static_leaves = self._prepare(state)
        with jax.set_mesh(self.mesh):  # so redeqx.constrain inside step_fn sees the mesh
            new_dyn, out = settle(fn(dyn, args))
        it = iter(new_dyn)
        return jax.tree.unflatten(treedef, [next(it) if m else s for m, s in zip(mask, static_leaves)]), out

    def lower(self, state, *args):
        """``jax.jit(...).lower`` for these arguments (for inspecting the compiled step)."""
        fn, dyn, *_ = self._prepare(state)
        with jax.set_mesh(self.mesh):
            return fn.lower(dyn, args)


@typechecked
def make_step(step_fn: Callable, mesh: Mesh, *, donate: bool = True) -> Callable:
    """Compile a pure step ``step_fn(state, *args) -> (new_state, outputs)``.

    ``state`` is any pytree (one model or several, optimizer states, a replay
    buffer...). Every array leaf of the new state keeps the sharding of the
    same leaf in the input state (leaves not yet on ``mesh`` are replicated),
    so the step can be called in a loop with no re-layout and no retrace; with
    ``donate=True`` the old state's buffers are reused for the new one, so
    memory is not doubled (do not use the old state after the call). Non-array
    leaves (activation functions, Python numbers) are compile-time constants
    and must come back unchanged. ``outputs`` are laid out as the compiler
    chooses and stay on the device.

    **Example** (DP-SGD style: per-example clipped gradients):

    ```python
    def dp_step(state, batch):
        model, opt_state = state
        def per_example(x, y):
            return eqx.filter_grad(lambda m: loss(m, x[None], y[None]))(model)
        grads = jax.vmap(per_example)(batch["x"], batch["y"])
        grads = jax.vmap(lambda g: clip(g, 1.0))(grads)
        grads = jax.tree.map(lambda g: g.mean(0), grads)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return (eqx.apply_updates(model, updates), opt_state), {}

    step = redeqx.make_step(dp_step, mesh)
    state, out = step(state, batch)
    ```
    """
    if not callable(step_fn):
        raise TypeError(f"step_fn must be a function (state, *args) -> (state, outputs), got {step_fn!r}.")
    return _CompiledStep(step_fn, mesh, donate)


def _cast_floats(tree, dtype):
    if dtype is None:
        return tree
    return jax.tree.map(
        lambda x: x.astype(dtype) if eqx.is_inexact_array(x) and jnp.issubdtype(x.dtype, jnp.floating) else x,
        tree,
    )


def _call_loss(loss_fn, model, batch, key):
    out = loss_fn(model, batch, key)
    if isinstance(out, tuple):
        if len(out) != 2 or not isinstance(out[1], dict):
            raise TypeError(
                f"loss_fn {getattr(loss_fn, '__name__', loss_fn)!r} must return a scalar loss or "
                f"(loss, aux_dict), got a tuple of {len(out)} items ({', '.join(type(o).__name__ for o in out)})."
            )
        loss, aux = out
    else:
        loss, aux = out, {}
    loss = jnp.asarray(loss)
    if loss.shape != ():
        raise ValueError(
            f"loss_fn {getattr(loss_fn, '__name__', loss_fn)!r} must return a scalar loss, got shape {loss.shape}. "
            "Reduce it over the batch, e.g. `return jnp.mean(per_example_loss)`."
        )
    aux = {k: jnp.asarray(v).astype(jnp.float32) if jnp.issubdtype(jnp.asarray(v).dtype, jnp.floating) else v
           for k, v in aux.items()}
    return loss.astype(jnp.float32), aux


def _check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}.")
    return int(value)


def _check_dtype(compute_dtype):
    if compute_dtype is not None and not jnp.issubdtype(jnp.dtype(compute_dtype), jnp.floating):
        raise ValueError(f"compute_dtype must be a floating dtype such as jnp.bfloat16, or None; got {compute_dtype!r}.")


def _micro_batches(batch, accumulate: int, mesh: Mesh):
    """(B, ...) -> (accumulate, B / accumulate, ...). Micro-batch j holds rows
    j, j + accumulate, j + 2 accumulate, ... so each data shard keeps its own
    rows and the split moves nothing between devices."""
    n_data = mesh.shape[DATA]

    def split(x):
        b = x.shape[0]
        if b % accumulate or (b // accumulate) % n_data:
            raise ValueError(
                f"accumulate={accumulate} cannot split a batch of {b} rows into micro-batches that the "
                f"{n_data}-way data axis also splits: make per_device_batch_size a multiple of accumulate "
                f"(rows per step = per_device_batch_size * {n_data})."
            )
        x = x.reshape(b // accumulate, accumulate, *x.shape[1:]).swapaxes(0, 1)
        spec = P(None, DATA, *([None] * (x.ndim - 2)))
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    return jax.tree.map(split, batch)


@typechecked
def make_train_step(
    loss_fn: Callable,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    specs,
    *,
    accumulate: int = 1,
    compute_dtype=None,
    trainable=None,
) -> Callable[[TrainState, Any], tuple[TrainState, dict]]:
    """The training step: ``(state, batch) -> (new_state, metrics)``.

    One compiled, sharded, donated step: gradients of ``loss_fn(model, batch,
    key)``, an ``optimizer`` update, ``step + 1``. ``metrics`` holds ``loss``,
    ``grad_norm`` (global L2 norm of the gradients) and whatever dict
    ``loss_fn`` returns as aux, all still on the device (no host sync).

    - ``accumulate=k`` splits the batch into ``k`` micro-batches run one after
      another inside the step (a ``lax.scan``) and averages their gradients: the
      same update as the whole batch at once, with the activation memory of
      one micro-batch. The batch still has ``per_device_batch_size * data``
      rows; ``per_device_batch_size`` must be a multiple of ``k``.
    - ``compute_dtype=jnp.bfloat16`` runs forward and backward with floating
      parameters and batch arrays cast to it; stored parameters, gradients and
      the optimizer state keep their own dtype.
    - ``trainable`` (an Equinox filter spec, e.g. a tree of bools from
      ``eqx.tree_at``) freezes the rest: frozen leaves get no gradient and come
      out bit-identical. Pass the same ``trainable`` to `init_state`.

    **Example:**

    ```python
    def loss_fn(model, batch, key):
        logits = jax.vmap(model)(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    train_step = redeqx.make_train_step(loss_fn, optimizer, mesh, specs)
    state, metrics = train_step(state, batch)
    ```
    """
    accumulate = _check_positive_int("accumulate", accumulate)
    _check_dtype(compute_dtype)
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be a function (model, batch, key) -> loss, got {loss_fn!r}.")
    if not isinstance(optimizer, optax.GradientTransformation):
        raise TypeError(
            f"optimizer must be an optax.GradientTransformation (e.g. optax.adamw(1e-3)), got {type(optimizer).__name__}."
        )

    def grads_of(diff, static, batch, key):
        def compute(diff):
            model = _cast_floats(eqx.combine(diff, static), compute_dtype)
            return _call_loss(loss_fn, model, _cast_floats(batch, compute_dtype), key)

        (loss, aux), grads = jax.value_and_grad(compute, has_aux=True)(diff)
        return loss, aux, grads

    def train_step(state: TrainState, batch):
        if not isinstance(state, TrainState):
            raise TypeError(f"state must be a redeqx.TrainState from redeqx.init_state, got {type(state).__name__}.")
        key, step_key = jax.random.split(state.key)
        _check_batch(batch, mesh)
        diff, static = split_trainable(state.model, trainable)
        if jax.tree.structure(jax.eval_shape(optimizer.init, diff)) != jax.tree.structure(state.opt_state):
            raise ValueError(
                "state.opt_state does not match the trainable parameters of this step: pass the same "
                "optimizer and trainable= to redeqx.init_state and redeqx.make_train_step."
            )
        if accumulate == 1:
            loss, aux, grads = grads_of(diff, static, batch, step_key)
        else:
            micro = _micro_batches(batch, accumulate, mesh)
            keys = jax.random.split(step_key, accumulate)
            first = jax.tree.map(lambda x: x[0], micro)
            shapes = jax.eval_shape(lambda: grads_of(diff, static, first, keys[0]))
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

            def body(carry, xs):
                mb, k = xs
                out = grads_of(diff, static, mb, k)
                return jax.tree.map(jnp.add, carry, out), None

            total, _ = jax.lax.scan(body, zeros, (micro, keys))
            loss, aux, grads = jax.tree.map(lambda x: x / accumulate, total)
        updates, opt_state = optimizer.update(grads, state.opt_state, diff)
        model = eqx.combine(optax.apply_updates(diff, updates), static)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), **aux}
        return TrainState(model=model, opt_state=opt_state, step=state.step + 1, key=key), metrics

    return make_step(train_step, mesh, donate=True)


def split_trainable(model, trainable):
    """(trainable floating arrays, everything else), as ``eqx.partition`` gives."""
    params = _trainable_params(model, trainable)
    mask = jax.tree.map(lambda x: x is not None, params, is_leaf=lambda x: x is None)
    return eqx.partition(model, mask)


def _batch_size(batch) -> int:
    sizes = {x.shape[0] for x in jax.tree.leaves(batch) if hasattr(x, "shape") and x.ndim > 0}
    if len(sizes) != 1:
        raise ValueError(
            f"every batch array needs the same leading (batch) dim, got sizes {sorted(sizes) or 'none'}."
        )
    return sizes.pop()


def _check_batch(batch, mesh: Mesh) -> None:
    b, n_data = _batch_size(batch), mesh.shape[DATA]
    if b % n_data:
        raise ValueError(
            f"a batch of {b} rows cannot be split over the data axis of {n_data} devices: use a batch size "
            f"that is a multiple of {n_data}, e.g. build batches with redeqx.batches(..., per_device_batch_size, mesh)."
        )


class EvalStep:
    """Compiled evaluation: ``eval_step(model, batch, key) -> metrics``
    (example means). `evaluate` also uses ``eval_step.sums`` to weight
    examples exactly across a padded last batch."""

    def __init__(self, loss_fn, mesh, compute_dtype):
        def per_example(model, batch, key):
            _check_batch(batch, mesh)
            model = _cast_floats(eqx.nn.inference_mode(model, True), compute_dtype)
            batch = _cast_floats(batch, compute_dtype)
            keys = jax.random.split(key, _batch_size(batch))

            def one(example, k):
                loss, aux = _call_loss(loss_fn, model, jax.tree.map(lambda x: x[None], example), k)
                return {"loss": loss, **aux}

            return jax.vmap(one)(batch, keys)

        def means(model, batch, key):
            return jax.tree.map(lambda v: v.mean(0), per_example(model, batch, key))

        def sums(model, batch, key, weights):
            values = per_example(model, batch, key)
            return jax.tree.map(lambda v: jnp.tensordot(weights, v, axes=1), values)

        self._means = eqx.filter_jit(means)
        self._sums = eqx.filter_jit(sums)
        self.mesh = mesh

    def __call__(self, model, batch, key):
        with jax.set_mesh(self.mesh):
            return settle(self._means(model, batch, key))

    def sums(self, model, batch, key, weights):
        with jax.set_mesh(self.mesh):
            return settle(self._sums(model, batch, key, weights))


@typechecked
def make_eval_step(loss_fn: Callable, mesh: Mesh, specs, *, compute_dtype=None) -> EvalStep:
    """Compiled evaluation: ``(model, batch, key) -> metrics``, the example
    mean of ``loss`` and ``loss_fn``'s aux, with the model in inference mode
    (``eqx.nn.inference_mode``: dropout off). Each example's loss is computed
    on its own (``loss_fn`` on a batch of one, vmapped), so means are exact
    however the batch was padded; ``loss_fn`` must therefore treat rows
    independently (no batch statistics).

    **Example:**

    ```python
    eval_step = redeqx.make_eval_step(loss_fn, mesh, specs)
    metrics = redeqx.evaluate(eval_step, state.model, test, collate_fn, 64, mesh, key=key)
    ```
    """
    _check_dtype(compute_dtype)
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be a function (model, batch, key) -> loss, got {loss_fn!r}.")
    return EvalStep(loss_fn, mesh, compute_dtype)


@typechecked
def make_predict_step(pred_fn: Callable, mesh: Mesh, specs) -> Callable:
    """Compiled prediction: ``(model, batch, key) -> preds``, with the model in
    inference mode. Every array in ``preds`` must have the batch as its
    leading dim (one row per example), which `predict` relies on.

    **Example:**

    ```python
    def pred_fn(model, batch, key):
        return jnp.argmax(jax.vmap(model)(batch["x"]), -1)

    predict_step = redeqx.make_predict_step(pred_fn, mesh, specs)
    preds = redeqx.predict(predict_step, state.model, test, collate_fn, 64, mesh, key=key)
    ```
    """
    if not callable(pred_fn):
        raise TypeError(f"pred_fn must be a function (model, batch, key) -> predictions, got {pred_fn!r}.")

    def predict_step(model, batch, key):
        _check_batch(batch, mesh)
        out = pred_fn(eqx.nn.inference_mode(model, True), batch, key)
        b = _batch_size(batch)
        for x in jax.tree.leaves(out):
            if jnp.ndim(x) == 0 or jnp.shape(x)[0] != b:
                raise ValueError(
                    f"pred_fn {getattr(pred_fn, '__name__', pred_fn)!r} must return arrays with the batch "
                    f"({b} rows) as leading dim, got shape {jnp.shape(x)}."
                )
        return out

    jitted = eqx.filter_jit(predict_step)

    @functools.wraps(pred_fn)
    def run(model, batch, key):
        with jax.set_mesh(mesh):  # so redeqx.constrain inside pred_fn sees the mesh
            return settle(jitted(model, batch, key))

    return run
