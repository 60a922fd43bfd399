"""Compiled, sharded step functions: the general `make_step` and the train,
eval and predict steps built on it.

Every step is one ``jax.jit`` over the array leaves of its first argument
(the state, or the model), compiled once per structure. Where those leaves
must live is decided before the call: by ``specs`` for the train, eval and
predict steps (the contract: a model laid out otherwise is moved to its
specs, with a warning naming the leaves), and by the leaves' own shardings
for `make_step`. Outputs of a state-returning step leave with the same
shardings they came in with, so a loop of steps never re-lays anything out.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ._distributed import settle
from ._layout import apply_layout, check_layout, resolve
from ._mesh import DATA, MODEL, check_mesh
from ._rules import _axes_of, path_parts
from ._state import (
    TrainState,
    _check_leaf,
    _check_optimizer,
    _is_none,
    _is_spec,
    _mirror_specs,
    _trainable_params,
    check_specs,
    check_specs_match,
    named_leaves,
    place,
    refuse_deleted,
)
from ._typing import floating_dtype, short_repr, typechecked, warn_user

ARRAY_TYPES = (jax.Array, np.ndarray, np.generic)
_ARRAYLIKE = ARRAY_TYPES + (jax.ShapeDtypeStruct,)  # abstract leaves: lowering only


def _fn_name(fn) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def _mesh_text(mesh) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in mesh.shape.items()) + "}"


# ----------------------------------------------------------------------------- where leaves live


def _own_placement(path: str, x, mesh: Mesh) -> NamedSharding:
    """`make_step`'s rule: a leaf stays where it is on ``mesh``; a leaf not yet
    on a mesh (NumPy, a fresh single-device array) is replicated; a leaf on
    another mesh is an error, since nothing says how to lay it out here."""
    sh = getattr(x, "sharding", None)
    if not isinstance(sh, NamedSharding):
        return NamedSharding(mesh, P())
    if sh.mesh == mesh:
        return sh
    if sh.mesh.axis_names == mesh.axis_names and sh.mesh.devices.shape == mesh.devices.shape and np.array_equal(
        np.vectorize(lambda d: d.id)(sh.mesh.devices), np.vectorize(lambda d: d.id)(mesh.devices)
    ):
        return NamedSharding(mesh, sh.spec)  # the same devices and axes (e.g. Explicit vs Auto types)
    raise ValueError(
        f"state leaf '{path}' lives on the mesh {_mesh_text(sh.mesh)}, but this step was made for the mesh "
        f"{_mesh_text(mesh)}. Lay the state out on this mesh first (redeqx.shard(tree, specs, mesh)), or make "
        "the step with the mesh the state lives on."
    )


def _spec_leaves(tree, spec_tree) -> list:
    """The spec of each array leaf of ``tree`` (in flatten order) from a spec
    tree of the same structure (``None`` where there is no array)."""
    t_leaves = jax.tree.leaves(tree, is_leaf=_is_none)
    s_leaves = jax.tree.leaves(spec_tree, is_leaf=_is_spec)
    if len(t_leaves) != len(s_leaves):
        raise ValueError(f"specs have {len(s_leaves)} leaves for {len(t_leaves)} leaves.")
    return [P() if s is None else s for x, s in zip(t_leaves, s_leaves) if isinstance(x, _ARRAYLIKE)]


def _sharding_text(x) -> str:
    sh = getattr(x, "sharding", None)
    if isinstance(sh, NamedSharding):
        return f"{sh.spec} on {_mesh_text(sh.mesh)}"
    return type(sh).__name__ if sh is not None else type(x).__name__


def _is_committed(x) -> bool:
    return isinstance(x, jax.Array) and getattr(x, "committed", True)


class _Compiled:
    """One ``jax.jit`` of ``fn(tree, *args)`` per structure of ``tree``: its
    array leaves are the dynamic inputs (placed by ``targets``), its other
    leaves (activation functions, Python numbers) compile-time constants.

    ``returns_state=True``: ``fn`` returns ``(new_tree, out)``, ``new_tree``
    has ``tree``'s structure and its leaves leave with the input shardings
    (donated when ``donate``). ``targets(tree, paths, leaves)`` gives each
    dynamic leaf's sharding; a committed leaf placed elsewhere is moved there,
    with a warning when ``warn_moves``.
    """

    def __init__(self, fn, mesh: Mesh, *, donate: bool, returns_state: bool, targets, what: str,
                 batch_args: tuple[int, ...] = (), warn_moves: bool = True):
        self.fn = fn
        self.mesh = mesh
        self.donate = donate
        self.returns_state = returns_state
        self.targets = targets
        self.what = what
        self.batch_args = batch_args
        self.warn_moves = warn_moves
        self._entries: dict[Any, tuple] = {}
        self._fast: dict[Any, tuple] = {}

    # -- compile

    def _build(self, treedef, static_leaves, mask, shardings, paths):
        fn, what, returns_state = self.fn, self.what, self.returns_state

        def inner(dyn_leaves, args):
            it = iter(dyn_leaves)
            tree = jax.tree.unflatten(treedef, [next(it) if m else s for m, s in zip(mask, static_leaves)])
            result = fn(tree, *args)
            if not returns_state:
                return result
            if not (isinstance(result, tuple) and len(result) == 2):
                raise TypeError(
                    f"step_fn {_fn_name(fn)!r} must return (new_state, outputs), got {type(result).__name__}."
                )
            new_tree, out = result
            new_leaves, new_def = jax.tree.flatten(new_tree)
            if new_def != treedef:
                raise ValueError(
                    f"step_fn {_fn_name(fn)!r} returned a {what} whose structure differs from its input:\n"
                    f"  in:  {treedef}\n  out: {new_def}\n"
                    f"A step must return a {what} of the same structure (same fields, same array leaves)."
                )
            for path, x, m, old in zip(paths, new_leaves, mask, static_leaves):
                if m:
                    continue
                if isinstance(x, (jax.Array, np.ndarray)) or not _same_constant(x, old):
                    raise TypeError(
                        f"step_fn {_fn_name(fn)!r} changed the {what} leaf '{path}' from {short_repr(old)} to "
                        f"{short_repr(x)}, but that leaf is not an array, so it is a compile-time constant and "
                        f"the change would be lost. Make it an array in the {what} you pass in (e.g. "
                        "jnp.asarray(0) instead of 0)."
                    )
            return [x for x, m in zip(new_leaves, mask) if m], out

        if returns_state:
            return jax.jit(inner, out_shardings=(list(shardings), None), donate_argnums=(0,) if self.donate else ())
        return jax.jit(inner)

    # -- place and look up

    def _prepare(self, tree, *, abstract: bool = False):
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
        paths = tuple(".".join(path_parts(kp)) for kp, _ in flat)
        leaves = [x for _, x in flat]
        dynamic = ARRAY_TYPES + ((jax.ShapeDtypeStruct,) if abstract else ())
        for path, x in zip(paths, leaves):
            if not isinstance(x, dynamic):
                _check_leaf(path, x, self.what)
        mask = tuple(isinstance(x, dynamic) for x in leaves)
        dyn = [x for x, m in zip(leaves, mask) if m]
        static_leaves = tuple(None if m else x for x, m in zip(leaves, mask))
        current = tuple(x.sharding if isinstance(x, jax.Array) else None for x in dyn)
        try:
            fast_key = (treedef, mask, static_leaves, current)
            hit = self._fast.get(fast_key)
        except TypeError:  # an unhashable constant: look up by identity instead
            fast_key = (treedef, mask, tuple(map(id, static_leaves)), current)
            hit = self._fast.get(fast_key)
        if hit is None:
            key = fast_key[:3]
            entry = self._entries.get(key)
            if entry is None:
                dyn_paths = [p for p, m in zip(paths, mask) if m]
                shardings = tuple(self.targets(tree, dyn_paths, dyn))
                fn = self._build(treedef, static_leaves, mask, shardings, paths)
                entry = self._entries[key] = (fn, shardings, dyn_paths)
            hit = self._fast[fast_key] = entry
        fn, shardings, dyn_paths = hit
        if abstract:
            dyn = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) if isinstance(x, jax.ShapeDtypeStruct) else x
                   for x, s in zip(dyn, shardings)]
            return fn, dyn, treedef, mask, static_leaves
        refuse_deleted(zip(dyn_paths, dyn), self.what)
        moved = []
        out = []
        for x, cur, s, path in zip(dyn, current, shardings, dyn_paths):
            if cur is not s and cur != s:
                if _is_committed(x) and isinstance(cur, NamedSharding):
                    moved.append(f"{path}: {_sharding_text(x)} -> {s.spec}")
                x = place(x, s, copy=self.donate)  # a moved leaf never shares the caller's memory
            out.append(x)
        if moved and self.warn_moves:
            warn_user(
                f"redeqx: {len(moved)} {self.what} leaves were not laid out as this step's specs say and were moved "
                f"(each call that passes them so pays for the move): " + "; ".join(moved[:8])
                + (" ..." if len(moved) > 8 else "") + ". Use the state this step returns, or place the "
                f"{self.what} with redeqx.shard(tree, specs, mesh) / redeqx.init_state."
            )
        return fn, out, treedef, mask, static_leaves

    def _args(self, args):
        for i, arg in enumerate(args):
            refuse_deleted(named_leaves(arg), f"step's argument {i + 2}")
        if not self.batch_args:
            if jax.process_count() > 1:
                _refuse_local_arrays(args)
            return args
        args = list(args)
        for i in self.batch_args:
            if i < len(args):
                args[i] = _place_batch(args[i], self.mesh)
        return tuple(args)

    def __call__(self, tree, *args):
        fn, dyn, treedef, mask, static_leaves = self._prepare(tree)
        with jax.set_mesh(self.mesh):  # so redeqx.constrain inside user code sees the mesh
            result = settle(fn(dyn, self._args(args)))
        if not self.returns_state:
            return result
        new_dyn, out = result
        it = iter(new_dyn)
        return jax.tree.unflatten(treedef, [next(it) if m else s for m, s in zip(mask, static_leaves)]), out

    def lower(self, tree, *args):
        """``jax.jit(...).lower`` for these arguments, which may be abstract
        (``jax.ShapeDtypeStruct`` leaves, e.g. from ``eqx.filter_eval_shape``):
        nothing is allocated or run."""
        fn, dyn, *_ = self._prepare(tree, abstract=True)
        with jax.set_mesh(self.mesh):
            return fn.lower(dyn, self._args(args))


def _same_constant(a, b) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:
        return False


def _refuse_local_arrays(args) -> None:
    """With several processes a NumPy argument would be taken as the same
    global value everywhere; if processes hold different rows they would
    silently compute different things."""
    for kp, x in jax.tree_util.tree_flatten_with_path(args)[0]:
        if isinstance(x, np.ndarray) and x.ndim:
            raise ValueError(
                f"argument{jax.tree_util.keystr(kp)} is a NumPy array, but this run has {jax.process_count()} "
                "processes, and a step's arguments must be global arrays: each process's own rows with "
                "jax.make_array_from_process_local_data(NamedSharding(mesh, P('data')), x) (what redeqx.batches "
                "does), or a value every process holds alike with jax.device_put(x, NamedSharding(mesh, P()))."
            )


def _place_batch(batch, mesh: Mesh):
    """Batch arrays onto ``mesh``: arrays on it stay; arrays on the same
    devices under another mesh object (an ``Explicit`` twin) keep their
    layout; NumPy or single-device arrays are split over ``data``: with one
    process such an array is the whole global batch, with several each
    process's array is its own rows of it (as `batches` makes them)."""
    n_data = mesh.shape[DATA]
    one_process = jax.process_count() == 1

    def one(x):
        sh = getattr(x, "sharding", None)
        if isinstance(x, jax.ShapeDtypeStruct) and sh is None:  # an abstract batch, for lowering
            spec = P(DATA, *([None] * (x.ndim - 1))) if x.ndim and x.shape[0] % n_data == 0 else P()
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))
        if isinstance(sh, NamedSharding):
            if sh.mesh == mesh or sh.mesh.axis_names != mesh.axis_names or sh.mesh.devices.shape != mesh.devices.shape:
                return x
            return jax.device_put(x, NamedSharding(mesh, sh.spec))
        if isinstance(x, (np.ndarray, jax.Array)) and x.ndim >= 1:
            sharding = NamedSharding(mesh, P(DATA, *([None] * (x.ndim - 1))))
            if not one_process:
                return jax.make_array_from_process_local_data(sharding, np.asarray(x))
            if x.shape[0] % n_data == 0:
                return jax.device_put(x, sharding)
        return x

    return jax.tree.map(one, batch)


# ----------------------------------------------------------------------------- make_step


@typechecked
def make_step(step_fn: Callable, mesh: Mesh, *, donate: bool = True) -> Callable:
    """Compile a pure step ``step_fn(state, *args) -> (new_state, outputs)``.

    ``state`` is any pytree (one model or several, `TrainState`\\ s, optimizer
    states, a replay buffer...). Every array leaf of the new state keeps the
    sharding of the same leaf in the input state (leaves not yet on a mesh,
    such as NumPy arrays, are replicated; a leaf on another mesh is an error),
    so the step can be called in a loop with no re-layout and no retrace. With
    ``donate=True`` the old state's buffers are reused for the new one, so
    memory is not doubled: do not use the old state after the call (build it
    with `init_state` / `init_opt_state` / `shard`, which copy, so the arrays
    you built it from stay yours). Non-array leaves (activation functions,
    Python numbers) are compile-time constants and must come back unchanged:
    a step that changes one is an error (make it an array). ``outputs`` are
    laid out as the compiler chooses and stay on the device. Arguments are
    passed as they are: a batch from `batches` is already split over
    ``data``, but one made inside the step (sampled from a replay buffer in
    the state) is split only where you say so: ``redeqx.constrain(batch,
    P("data"))``. With several processes, arguments must be global arrays
    (NumPy ones are refused, naming the fix). `apply_gradients` is one
    model's optimizer update inside such a step.

    **Example** (two models and two optimizers, as in a GAN or actor-critic):

    ```python
    state = {"g": redeqx.init_state(gen, opt_g, mesh, g_specs, key=k1),
             "d": redeqx.init_state(disc, opt_d, mesh, d_specs, key=k2)}

    def gan_step(state, batch):
        ...  # gradients of each model, optimizer.update for each
        return {"g": new_g, "d": new_d}, {"g_loss": g_loss, "d_loss": d_loss}

    step = redeqx.make_step(gan_step, mesh)
    state, losses = step(state, batch)
    ```
    """
    if not callable(step_fn):
        raise TypeError(f"step_fn must be a function (state, *args) -> (state, outputs), got {short_repr(step_fn)}.")
    mesh = check_mesh(mesh)

    def targets(tree, paths, leaves):
        return [_own_placement(p, x, mesh) for p, x in zip(paths, leaves)]

    step = _Compiled(step_fn, mesh, donate=donate, returns_state=True, targets=targets, what="state",
                     warn_moves=False)
    return functools.wraps(step_fn)(_StepFunction(step))


class _StepFunction:
    """The callable a ``make_*_step`` returns: ``__call__`` runs it, ``lower``
    compiles it for (possibly abstract) arguments."""

    def __init__(self, compiled: _Compiled):
        self._compiled = compiled
        self.mesh = compiled.mesh

    def __call__(self, *args):
        return self._compiled(*args)

    def lower(self, *args):
        """``jax.jit(...).lower`` of this step for these arguments; leaves may
        be ``jax.ShapeDtypeStruct``\\ s (nothing is allocated)."""
        return self._compiled.lower(*args)


# ----------------------------------------------------------------------------- user functions


def _check_signature(fn, role: str, n: int | tuple[int, ...], call: str, example: str) -> None:
    """``fn`` can be called with ``n`` positional arguments (any of them, for
    a tuple), else an error naming the function and what it must look like."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins, some C callables: find out when called
        return
    for k in (n,) if isinstance(n, int) else n:
        try:
            sig.bind(*([None] * k))
            return
        except TypeError:
            pass
    raise TypeError(
        f"{role} {_fn_name(fn)!r} has the signature {sig}, but redeqx calls it as {role}{call}. "
        f"Write it as `{example}` (an argument it does not need may go unused)."
    )


_LOSS_CALL = "(model, batch, key)"
_LOSS_EXAMPLE = "def loss_fn(model, batch, key): ..."
_STATEFUL_CALL = "(model, batch, key, model_state)"
_STATEFUL_EXAMPLE = "def loss_fn(model, batch, key, model_state): ...; return loss, new_model_state"


def _cast_floats(tree, dtype):
    if dtype is None:
        return tree
    return jax.tree.map(
        lambda x: x.astype(dtype) if eqx.is_inexact_array(x) and jnp.issubdtype(x.dtype, jnp.floating) else x,
        tree,
    )


def _scalar_metric(fn, key: str, value):
    where = f"loss_fn {_fn_name(fn)!r} aux[{key!r}]"
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


_NO_STATE = object()


def _call_loss(loss_fn, model, batch, key, model_state=_NO_STATE):
    """Runs ``loss_fn`` and checks what it returned: ``(float32 loss, aux of
    scalars, new model_state or _NO_STATE)``."""
    name = _fn_name(loss_fn)
    if model_state is _NO_STATE:
        out = loss_fn(model, batch, key)
        if isinstance(out, tuple):
            if len(out) != 2 or not isinstance(out[1], dict):
                raise TypeError(
                    f"loss_fn {name!r} must return a scalar loss or (loss, aux_dict), got a tuple of {len(out)} items "
                    f"({', '.join(type(o).__name__ for o in out)})."
                )
            loss, aux = out
        else:
            loss, aux = out, {}
        new_state = _NO_STATE
    else:
        _check_signature(loss_fn, "loss_fn", 4, _STATEFUL_CALL, _STATEFUL_EXAMPLE)
        out = loss_fn(model, batch, key, model_state)
        if not (isinstance(out, tuple) and len(out) in (2, 3)):
            raise TypeError(
                f"loss_fn {name!r} gets a model_state, so it must return (loss, new_model_state) or "
                f"(loss, aux_dict, new_model_state), got {type(out).__name__}."
            )
        loss, aux, new_state = (out[0], {}, out[1]) if len(out) == 2 else out
        if not isinstance(aux, dict):
            raise TypeError(f"loss_fn {name!r} returned aux of type {type(aux).__name__}; aux must be a dict.")
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


def _check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}.")
    return int(value)


def _check_dtype(compute_dtype):
    floating_dtype(compute_dtype, "compute_dtype")


def _micro_batches(batch, accumulate: int, mesh: Mesh | None):
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
        spec = P(None, DATA, *([None] * (x.ndim - 2)))
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    return jax.tree.map(split, batch)


def _refuse_model_state(state) -> None:
    if state.model_state is not None:
        raise ValueError(
            "shard_mean_loss=True cannot keep a model_state: a state such as BatchNorm's statistics depends on "
            "the whole batch, not on each data shard's rows. Drop shard_mean_loss."
        )


def _check_whole_over_data(specs) -> None:
    split = [(".".join(path_parts(kp)), s) for kp, s in jax.tree_util.tree_flatten_with_path(specs, is_leaf=_is_spec)[0]
             if isinstance(s, P) and any(DATA in _axes_of(e) for e in s)]
    if split:
        path, spec = split[0]
        raise ValueError(
            f"shard_mean_loss=True needs every parameter whole on each data shard, but specs split '{path}' as "
            f"{spec} over '{DATA}' ({len(split)} such leaves; fsdp=True in redeqx.sharding_rules does this). Use "
            "fsdp or shard_mean_loss, not both."
        )


def _check_callable(fn, role: str, call: str, example: str) -> None:
    if not callable(fn):
        raise TypeError(f"{role} must be a function {call} -> ..., got {short_repr(fn)}.")
    _check_signature(fn, role, (3, 4), call, example)  # 4: with a model_state


def _model_targets(mesh: Mesh, specs):
    """Placement of a model (the eval and predict steps' first argument) by ``specs``."""

    def targets(model, paths, leaves):
        check_specs_match(model, specs, "model")
        return [NamedSharding(mesh, s) for s in _spec_leaves(model, specs)]

    return targets


def _model_state_specs(model_state, mesh: Mesh):
    if model_state is None:
        return None
    return jax.tree.map(lambda x: _own_placement("model_state", x, mesh).spec if isinstance(x, _ARRAYLIKE) else None,
                        model_state)


# ----------------------------------------------------------------------------- train


@typechecked
def make_train_step(
    loss_fn: Callable,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    specs: Any,
    *,
    accumulate: int = 1,
    compute_dtype: Any = None,
    trainable: Any = None,
    activation_layout: Any = "auto",
    shard_mean_loss: bool = False,
) -> Callable[..., tuple[TrainState, dict]]:
    """The training step: ``(state, batch) -> (new_state, metrics)``.

    One compiled, sharded, donated step: gradients of ``loss_fn(model, batch,
    key)``, an ``optimizer`` update, ``step + 1``. ``metrics`` holds ``loss``,
    ``grad_norm`` (global L2 norm of the gradients) and whatever dict
    ``loss_fn`` returns as aux (scalars), all still on the device (no host sync).

    ``specs`` (from `sharding_rules`) is where the model lives: the step takes
    ``state.model`` in that layout and returns it in that layout, with the
    optimizer state laid out like the parameters it mirrors and ``step`` /
    ``key`` replicated. A state laid out otherwise (restored onto another
    ``n_model_shards``, built by hand) is moved to ``specs`` before the step,
    with a warning naming the leaves; it is never silently replicated.

    - ``accumulate=k`` splits the batch into ``k`` micro-batches run one after
      another inside the step (a ``lax.scan``) and averages their gradients:
      the same update as the whole batch at once, with the activation memory
      of one micro-batch. The batch is still what `batches` yields,
      ``per_device_batch_size * data`` rows, so ``per_device_batch_size`` must
      be a multiple of ``k``; nothing else changes (not the schedule's length).
      "The same update" holds for a loss that is a mean over rows; a mean over
      the batch's non-padding tokens gets each micro-batch's own mean,
      weighted equally.
    - ``compute_dtype=jnp.bfloat16`` runs forward and backward with floating
      parameters and batch arrays cast to it; stored parameters, gradients and
      the optimizer state keep their own dtype.
    - ``trainable`` (an Equinox filter spec, e.g. a tree of bools from
      ``eqx.tree_at``) freezes the rest: frozen leaves get no gradient and come
      out bit-identical. Pass the same ``trainable`` to `init_state`.
    - ``activation_layout`` (``"auto"``, ``"sequence"``, ``"replicated"`` or
      None) pins the activations at the boundaries of a model's repeated
      blocks (see `redeqx._layout`): ``"sequence"`` splits them over
      ``model`` on the token axis (between blocks, as Megatron's sequence
      parallelism does),
      ``"replicated"`` keeps them whole on every ``model`` device. ``"auto"``
      (no pins) is what measured best on a GPT-style user model
      (benchmarks/RESULTS.md): GSPMD alone moves the Megatron plan's bytes,
      while ``"sequence"`` is faster on CPU only by gathering whole weights.
      Pins never apply on one model shard or to `redeqx.models`, which lay
      themselves out. Every exact `eqx.nn.Linear` is computed as ``x @ W.T``
      (the same function; under ``jax.vmap`` it needs no transposed copies
      of activations on XLA:CPU), and on CPU every exact `eqx.nn.LayerNorm`
      and `eqx.nn.RMSNorm` is recomputed in the backward pass from its input
      instead of keeping its insides (under ``jax.vmap``, its statistics and
      weight broadcast to the activation's shape, which XLA:CPU
      materialises): the same gradients to float rounding, fewer temporaries
      (`redeqx._layout._recomputed`; on TPU it added temporaries, so it is
      CPU's only).
    - ``shard_mean_loss=True`` promises that ``loss_fn`` of a batch equals the
      mean of ``loss_fn`` over equal slices of its rows: true of a mean over
      examples (the example below) or over tokens when every row has as many;
      false of a mean over the non-padding tokens of the whole batch, of a
      loss comparing rows with each other (contrastive) and of BatchNorm. The
      step then computes each data shard's gradients from its own rows (under
      `jax.shard_map`) and averages them with one all-reduce, as ``jax.pmap``
      data parallelism (and redco) does. Without it, XLA reduces the terms of
      a parameter used twice, such as a tied embedding (lookup and LM head),
      one after the other: 28.3 instead of 20.3 MiB per step on a 5.3M-parameter
      GPT at one model shard (benchmarks/RESULTS.md). Dropout draws from
      ``jax.random.fold_in(key, shard)``: the same distribution as one device,
      not the same masks. The first call checks the promise on its batch
      (whole-batch gradients against the shards' mean, with dropout off, in
      float32, on a few rows of each shard; once, compiled apart) and raises
      if it does not hold. Needs parameters whole over ``data``
      (not ``fsdp``) and no ``model_state``.
    - A model with state (``eqx.nn.State``, e.g. BatchNorm; give it to
      `init_state` as ``model_state``): ``loss_fn(model, batch, key,
      model_state)`` returns ``(loss, new_model_state)`` or ``(loss, aux,
      new_model_state)``, and the step keeps the new state in
      ``state.model_state``.

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
    _check_callable(loss_fn, "loss_fn", _LOSS_CALL, _LOSS_EXAMPLE)
    _check_optimizer(optimizer)
    check_layout(activation_layout)
    mesh = check_mesh(mesh)
    check_specs(specs, mesh)
    layout = resolve(activation_layout, mesh.shape[MODEL])

    if shard_mean_loss:
        _check_whole_over_data(specs)

    def grads_of(diff, static, batch, key, model_state, checking=False):
        """Loss, aux, gradients, new model state; ``checking``: with dropout
        off, in float32 (what the ``shard_mean_loss`` check compares)."""
        dtype = jnp.float32 if checking else compute_dtype

        def compute(diff):
            model = eqx.combine(diff, static)
            if checking:
                model = eqx.nn.inference_mode(model, True)
            model = apply_layout(_cast_floats(model, dtype), layout, mesh)
            loss, aux, new_ms = _call_loss(loss_fn, model, _cast_floats(batch, dtype), key, model_state)
            return loss, (aux, new_ms)

        (loss, (aux, new_ms)), grads = jax.value_and_grad(compute, has_aux=True)(diff)
        return loss, aux, grads, new_ms

    def accumulated(diff, static, batch, key, ms, micro_batches, checking=False):
        """``grads_of`` averaged over ``accumulate`` micro-batches, run one
        after another (a scan), as ``micro_batches(batch)`` splits them."""
        if accumulate == 1:
            return grads_of(diff, static, batch, key, ms, checking)
        micro = micro_batches(batch)
        keys = jax.random.split(key, accumulate)
        first = jax.tree.map(lambda x: x[0], micro)
        shapes = jax.eval_shape(lambda: grads_of(diff, static, first, keys[0], ms, checking)[:3])
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

        def body(carry, xs):
            total, ms = carry
            mb, k = xs
            *out, ms = grads_of(diff, static, mb, k, ms, checking)
            return (jax.tree.map(jnp.add, total, tuple(out)), ms), None

        if ms is _NO_STATE:
            def body(total, xs):  # noqa: F811 - no model state to thread
                mb, k = xs
                out = grads_of(diff, static, mb, k, _NO_STATE, checking)[:3]
                return jax.tree.map(jnp.add, total, out), None

            total, _ = jax.lax.scan(body, zeros, (micro, keys))
        else:
            (total, ms), _ = jax.lax.scan(body, (zeros, ms), (micro, keys))
        loss, aux, grads = jax.tree.map(lambda x: x / accumulate, total)
        return loss, aux, grads, ms

    def shard_mean_grads(diff, static, batch, key, checking=False):
        """Each data shard's loss, aux and gradients from its own rows, then
        one mean over ``data`` (``model`` stays GSPMD's, inside)."""
        def body(diff, batch, key):
            key = jax.random.fold_in(key, jax.lax.axis_index(DATA))
            loss, aux, grads, _ = accumulated(diff, static, batch, key, _NO_STATE,
                                              functools.partial(_micro_batches, accumulate=accumulate, mesh=None),
                                              checking)
            return jax.lax.pmean((loss, aux, grads), DATA)

        rows = jax.tree.map(lambda x: P(DATA) if jnp.ndim(x) else P(), batch)
        return jax.shard_map(body, mesh=mesh, in_specs=(P(), rows, P()), out_specs=P(),
                             axis_names=frozenset({DATA}), check_vma=False)(diff, batch, key)

    def train_step(state: TrainState, batch):
        key, step_key = jax.random.split(state.key)
        _check_batch(batch, mesh)
        diff, static = split_trainable(state.model, trainable)
        if jax.tree.structure(jax.eval_shape(optimizer.init, diff)) != jax.tree.structure(state.opt_state):
            raise ValueError(
                "state.opt_state does not match the trainable parameters of this step: pass the same "
                "optimizer and trainable= to redeqx.init_state and redeqx.make_train_step."
            )
        ms = _NO_STATE if state.model_state is None else state.model_state
        if shard_mean_loss:
            _refuse_model_state(state)
            loss, aux, grads = shard_mean_grads(diff, static, batch, step_key)
        else:
            loss, aux, grads, ms = accumulated(diff, static, batch, step_key, ms,
                                               functools.partial(_micro_batches, accumulate=accumulate, mesh=mesh))
        updates, opt_state = optimizer.update(grads, state.opt_state, diff)
        model = eqx.combine(optax.apply_updates(diff, updates), static)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), **aux}
        new = TrainState(model=model, opt_state=opt_state, step=state.step + 1, key=key,
                         model_state=None if ms is _NO_STATE else ms)
        return new, metrics

    def targets(state, paths, leaves):
        if not isinstance(state, TrainState):
            raise TypeError(
                f"state must be a redeqx.TrainState from redeqx.init_state, got {type(state).__name__}; for a "
                "step over another kind of state, write it with redeqx.make_step."
            )
        check_specs_match(state.model, specs, "model")
        replicated = P()
        spec_state = TrainState(
            model=specs,
            opt_state=_mirror_specs(state.opt_state, state.model, specs),
            step=replicated,
            key=replicated,
            model_state=_model_state_specs(state.model_state, mesh),
        )
        return [NamedSharding(mesh, s) for s in _spec_leaves(state, spec_state)]

    step = _Compiled(train_step, mesh, donate=True, returns_state=True, targets=targets, what="state",
                     batch_args=(0,))
    if not shard_mean_loss or mesh.shape[DATA] == 1:  # one data shard: the shards' mean is the loss
        return functools.wraps(loss_fn)(_StepFunction(step))

    def disagreement(state, batch):
        """How far the whole batch's gradients are from the shards' mean (a
        relative L2 distance), and whether the loss depends on ``key``, all
        with dropout off and in float32, so that rounding stays far below the
        tolerance. On the first ``accumulate`` rows of each data shard (one
        row per micro-batch): the promise is about how ``loss_fn`` combines
        rows, and so few rows keep the check's memory (two gradient trees,
        float32 activations) well below the step's."""
        _refuse_model_state(state)
        _check_batch(batch, mesh)
        n_data = mesh.shape[DATA]

        def first_rows(x):
            if not jnp.ndim(x):
                return x
            x = x.reshape(n_data, x.shape[0] // n_data, *x.shape[1:])[:, :accumulate]
            return x.reshape(n_data * accumulate, *x.shape[2:])

        batch = jax.tree.map(first_rows, batch)
        diff, static = split_trainable(state.model, trainable)
        key, other = jax.random.split(state.key)
        micro_batches = functools.partial(_micro_batches, accumulate=accumulate, mesh=mesh)
        loss, _, whole, _ = accumulated(diff, static, batch, key, _NO_STATE, micro_batches, checking=True)
        loss_other = accumulated(diff, static, batch, other, _NO_STATE, micro_batches, checking=True)[0]
        _, _, shards = shard_mean_grads(diff, static, batch, key, checking=True)
        apart, size = optax.tree.norm(jax.tree.map(jnp.subtract, shards, whole)), optax.tree.norm(whole)
        return jnp.where(apart == 0, 0.0, apart / size), loss != loss_other, jnp.isfinite(size) & jnp.isfinite(loss)

    check = _Compiled(disagreement, mesh, donate=False, returns_state=False, targets=targets, what="state",
                      batch_args=(0,))
    return functools.wraps(loss_fn)(_CheckedFirstCall(step, check, 1e-3, _fn_name(loss_fn)))


class _CheckedFirstCall(_StepFunction):
    """A ``shard_mean_loss`` train step: its first call checks, on that call's
    batch, that the shards' mean gradient is the whole batch's."""

    def __init__(self, compiled, check, tolerance: float, name: str):
        super().__init__(compiled)
        self._check, self._tolerance, self._name, self._checked = check, tolerance, name, False

    def __call__(self, *args):
        if not self._checked:
            gap, random, whole_finite = jax.device_get(self._check(*args))
            if not np.isfinite(gap) and whole_finite:  # a row mean is not finite on the batch and NaN on a shard
                raise ValueError(
                    f"shard_mean_loss=True, but loss_fn {self._name!r} is not the mean of its values on equal "
                    "slices of the batch: on this batch's first rows of each data shard, the whole batch's "
                    "gradients are finite and some shard's are not (a shard with no tokens to average over "
                    "divides 0 by 0). A mean over the non-padding tokens of the whole batch does this. Drop "
                    "shard_mean_loss (the step then differentiates the loss of the whole batch), or make loss_fn "
                    "a mean over its rows."
                )
            elif not np.isfinite(gap):
                warn_user(
                    f"shard_mean_loss=True is unchecked: loss_fn {self._name!r} gave non-finite gradients on the "
                    "first batch (checked in float32, dropout off), so they cannot be compared."
                )
            elif random:
                warn_user(
                    f"shard_mean_loss=True is unchecked: loss_fn {self._name!r} draws random numbers from its key "
                    "even with dropout off, so its whole-batch and per-shard gradients cannot be compared."
                )
            elif gap > self._tolerance:
                raise ValueError(
                    f"shard_mean_loss=True, but loss_fn {self._name!r} is not the mean of its values on equal "
                    f"slices of the batch: on this batch's first rows of each data shard, the shards' mean "
                    f"gradient is {gap:.2g} (relative L2) away from the whole's (tolerance {self._tolerance:g}). "
                    "A mean over non-padding tokens, a loss comparing rows, or a normalisation over the batch "
                    "does this. Drop shard_mean_loss (the step then differentiates the loss of the whole batch), "
                    "or make loss_fn a mean over its rows."
                )
            self._checked = True
        return self._compiled(*args)


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


# ----------------------------------------------------------------------------- eval and predict


def _inference(model, compute_dtype):
    return _cast_floats(eqx.nn.inference_mode(model, True), compute_dtype)


class EvalStep:
    """Compiled evaluation: ``eval_step(model, batch, key, *, model_state=None)
    -> metrics`` (example means). `evaluate` also uses ``eval_step.sums`` to
    weight examples exactly across a padded last batch."""

    def __init__(self, loss_fn, mesh, specs, compute_dtype, layout=None):
        def per_example(model, batch, key, model_state):
            _check_batch(batch, mesh)
            model = apply_layout(_inference(model, compute_dtype), layout, mesh)
            batch = _cast_floats(batch, compute_dtype)
            keys = jax.random.split(key, _batch_size(batch))

            def one(example, k):
                ms = _NO_STATE if model_state is None else model_state
                loss, aux, _ = _call_loss(loss_fn, model, jax.tree.map(lambda x: x[None], example), k, ms)
                return {"loss": loss, **aux}

            return jax.vmap(one)(batch, keys)

        def means(model, batch, key, model_state):
            return jax.tree.map(lambda v: v.mean(0), per_example(model, batch, key, model_state))

        def sums(model, batch, key, weights, model_state):
            values = per_example(model, batch, key, model_state)
            return jax.tree.map(lambda v: jnp.tensordot(weights, v, axes=1), values)

        targets = _model_targets(mesh, specs)
        self._means = _Compiled(means, mesh, donate=False, returns_state=False, targets=targets, what="model",
                                batch_args=(0,))
        self._sums = _Compiled(sums, mesh, donate=False, returns_state=False, targets=targets, what="model",
                               batch_args=(0, 2))
        self.mesh = mesh
        self.specs = specs

    def __call__(self, model, batch, key, *, model_state=None):
        return self._means(model, batch, key, model_state)

    def sums(self, model, batch, key, weights, *, model_state=None):
        return self._sums(model, batch, key, weights, model_state)

    def lower(self, model, batch, key, *, model_state=None):
        return self._means.lower(model, batch, key, model_state)


@typechecked
def make_eval_step(
    loss_fn: Callable, mesh: Mesh, specs: Any, *, compute_dtype: Any = None, activation_layout: Any = "auto"
) -> EvalStep:
    """Compiled evaluation: ``(model, batch, key) -> metrics``, the example
    mean of ``loss`` and ``loss_fn``'s aux, with the model in inference mode
    (``eqx.nn.inference_mode``: dropout off). Each example's loss is computed
    on its own (``loss_fn`` on a batch of one, vmapped), so means are exact
    however the batch was padded; ``loss_fn`` must therefore treat rows
    independently (no batch statistics; BatchNorm in inference mode reads its
    running statistics from ``model_state=``, passed to the call).

    The model is taken in the layout ``specs`` gives (a model laid out
    otherwise is moved there, with a warning naming the leaves);
    ``activation_layout`` is as in `make_train_step`.

    **Example:**

    ```python
    eval_step = redeqx.make_eval_step(loss_fn, mesh, specs)
    metrics = redeqx.evaluate(eval_step, state.model, test, collate_fn, 64, mesh, key=key)
    ```
    """
    _check_dtype(compute_dtype)
    _check_callable(loss_fn, "loss_fn", _LOSS_CALL, _LOSS_EXAMPLE)
    check_layout(activation_layout)
    mesh = check_mesh(mesh)
    check_specs(specs, mesh)
    return EvalStep(loss_fn, mesh, specs, compute_dtype, resolve(activation_layout, mesh.shape[MODEL]))


class PredictStep:
    """Compiled prediction: ``predict_step(model, batch, key, *,
    model_state=None) -> preds``."""

    def __init__(self, pred_fn, mesh, specs, compute_dtype, layout=None):
        name = _fn_name(pred_fn)

        def predict_step(model, batch, key, model_state):
            _batch_size(batch)  # one leading dim; any number of rows (an acting loop's few environments):
            # rows the data axis does not divide are computed whole on every data shard
            model = apply_layout(_inference(model, compute_dtype), layout, mesh)
            batch = _cast_floats(batch, compute_dtype)
            if model_state is None:
                out = pred_fn(model, batch, key)
            else:
                _check_signature(pred_fn, "pred_fn", 4, "(model, batch, key, model_state)",
                                 "def pred_fn(model, batch, key, model_state): ...")
                out = pred_fn(model, batch, key, model_state)
            b = _batch_size(batch)
            for x in jax.tree.leaves(out):
                if jnp.ndim(x) == 0 or jnp.shape(x)[0] != b:
                    raise ValueError(
                        f"pred_fn {name!r} must return arrays with the batch ({b} rows) as leading dim, got shape "
                        f"{jnp.shape(x)}."
                    )
            return out

        self._step = _Compiled(predict_step, mesh, donate=False, returns_state=False,
                               targets=_model_targets(mesh, specs), what="model", batch_args=(0,))
        self.mesh = mesh
        self.specs = specs
        functools.update_wrapper(self, pred_fn, updated=())

    def __call__(self, model, batch, key, *, model_state=None):
        return self._step(model, batch, key, model_state)

    def lower(self, model, batch, key, *, model_state=None):
        return self._step.lower(model, batch, key, model_state)


@typechecked
def make_predict_step(
    pred_fn: Callable, mesh: Mesh, specs: Any, *, compute_dtype: Any = None, activation_layout: Any = "auto"
) -> PredictStep:
    """Compiled prediction: ``(model, batch, key) -> preds``, with the model in
    inference mode and laid out as ``specs`` says (a model laid out otherwise
    is moved there, with a warning). Every array in ``preds`` must have the
    batch as its leading dim (one row per example), which `predict` relies
    on. A batch of any size works (rows the ``data`` axis does not divide,
    such as a few environments' observations, are computed on every data
    shard). ``compute_dtype=jnp.bfloat16`` casts floating parameters and batch
    arrays for the computation, and ``activation_layout`` pins activations,
    as in `make_eval_step`.

    **Example:**

    ```python
    def pred_fn(model, batch, key):
        return jnp.argmax(jax.vmap(model)(batch["x"]), -1)

    predict_step = redeqx.make_predict_step(pred_fn, mesh, specs)
    preds = redeqx.predict(predict_step, state.model, test, collate_fn, 64, mesh, key=key)
    ```
    """
    _check_dtype(compute_dtype)
    _check_callable(pred_fn, "pred_fn", "(model, batch, key)", "def pred_fn(model, batch, key): ...")
    check_layout(activation_layout)
    mesh = check_mesh(mesh)
    check_specs(specs, mesh)
    return PredictStep(pred_fn, mesh, specs, compute_dtype, resolve(activation_layout, mesh.shape[MODEL]))
