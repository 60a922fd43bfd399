"""Placing arrays on the mesh, and the immutable training state."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Int, PRNGKeyArray, PyTree

from ._mesh import check_mesh
from .sharding import sharding_rules
from ._trees import is_array, is_array_like, is_floating, is_none, is_spec, leaves_with_specs, named_leaves, path_str
from ._typing import short_repr, typechecked
from .sharding._specs import named_shardings, sharding_of


def check_specs(specs, mesh: Mesh, name: str = "specs") -> None:
    """``specs`` is a tree of PartitionSpecs (``None`` where there is no array)
    naming only this mesh's axes; an error saying what to pass otherwise."""
    fix = "pass the tree made by redeqx.sharding_rules(model, mesh)"
    if specs is None or isinstance(specs, (str, bytes, int, float)):
        raise TypeError(f"{name}={short_repr(specs)} is not a tree of PartitionSpecs: {fix}.")
    leaves = named_leaves(specs, is_leaf=is_spec)
    bad = [(path, x) for path, x in leaves if not is_spec(x)]
    if bad:
        where, x = bad[0]
        raise TypeError(
            f"{name} holds {short_repr(x)} ({type(x).__name__}) at '{where or '<root>'}', where a PartitionSpec "
            f"or None belongs: {fix}."
        )
    if not any(isinstance(x, P) for _, x in leaves):
        raise ValueError(f"{name} holds no PartitionSpec at all ({short_repr(specs)}): {fix}.")
    for path, spec in leaves:
        for entry in spec or ():
            for axis in entry if isinstance(entry, tuple) else (entry,):
                if axis is not None and axis not in mesh.shape:
                    raise ValueError(
                        f"{name} at '{path}' is {spec}, naming axis {axis!r}; the mesh has axes "
                        f"{tuple(mesh.shape)}."
                    )


def check_specs_match(tree, specs, what: str) -> None:
    """``specs`` has the structure of ``tree`` (same attribute paths), else an
    error listing where they differ."""
    # None fields (a Linear's missing bias) are leaves on both sides here
    tree_paths = [p for p, _ in named_leaves(tree, is_leaf=is_none)]
    spec_paths = [p for p, _ in named_leaves(specs, is_leaf=is_spec)]
    if tree_paths == spec_paths:
        return
    only_tree = [p for p in tree_paths if p not in set(spec_paths)]
    only_specs = [p for p in spec_paths if p not in set(tree_paths)]
    detail = []
    if only_tree:
        detail.append(f"in the {what}, not in specs: {', '.join(only_tree[:5])}{' ...' if len(only_tree) > 5 else ''}")
    if only_specs:
        detail.append(f"in specs, not in the {what}: {', '.join(only_specs[:5])}{' ...' if len(only_specs) > 5 else ''}")
    if not detail:
        detail.append("the same paths in another order")
    raise ValueError(
        f"specs do not match the {what} ({len(spec_paths)} spec leaves for {len(tree_paths)} leaves; "
        + "; ".join(detail) + f"). Build specs from this {what}: redeqx.sharding_rules({what}, mesh)."
    )


# ----------------------------------------------------------------------------- placing arrays


def _buffers(x) -> set | None:
    """The memory ``x`` lives in, as buffer addresses (None: cannot tell)."""
    if isinstance(x, np.ndarray):
        return {x.__array_interface__["data"][0]}
    if isinstance(x, jax.Array):
        try:
            return {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}
        except Exception:
            return None
    return set()


@functools.lru_cache(maxsize=None)
def _copier(sharding):
    return jax.jit(jnp.copy, out_shardings=sharding)


def place(x, sharding: NamedSharding, *, copy: bool):
    """``x`` laid out by ``sharding``. With ``copy=True`` the result never
    shares memory with ``x``: ``jax.device_put`` hands back ``x`` itself, or
    an array whose shard on ``x``'s device is ``x``'s buffer (a replicated
    placement), and a donating step would then delete the caller's array."""
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        # through its raw data: device_put refuses a typed key for a sharding that
        # spans other processes' devices
        return jax.random.wrap_key_data(place(jax.random.key_data(x), sharding, copy=copy),
                                        impl=jax.random.key_impl(x))
    y = jax.device_put(x, sharding)
    if copy:
        before, after = _buffers(x), _buffers(y)
        if y is x or before is None or after is None or before & after:
            y = _copier(sharding)(y)
    return y


def check_leaf(path: str, x, what: str):
    """Arrays of other libraries (a torch tensor) would pass as constants."""
    if isinstance(x, (jax.Array, np.ndarray, np.generic)) or x is None:
        return
    if hasattr(x, "__array__") or (hasattr(x, "shape") and hasattr(x, "dtype")):
        hint = (" an abstract array: build the real model first (or plan with redeqx.plan)"
                if isinstance(x, jax.ShapeDtypeStruct) else
                "; redeqx places JAX and NumPy arrays only: convert it with jnp.asarray(...)")
        raise TypeError(f"{what} leaf '{path}' is a {type(x).__module__}.{type(x).__qualname__}{hint}.")


@typechecked
def shard(tree: PyTree, specs: PyTree, mesh: Mesh) -> PyTree:
    """Places every array leaf of ``tree`` with ``NamedSharding(mesh, spec)``.

    ``specs`` has ``tree``'s structure (as made by `sharding_rules`); non-array
    leaves pass through unchanged. The result never shares memory with
    ``tree`` (an array already in place is copied), so a donating step can
    consume it while ``tree`` stays usable.

    **Example:**

    ```python
    model = redeqx.shard(model, redeqx.sharding_rules(model, mesh), mesh)
    ```
    """
    mesh = check_mesh(mesh)
    check_specs(specs, mesh)
    return _place_tree(tree, specs, mesh, copy=True, what="tree")


def _place_tree(tree, specs, mesh: Mesh, *, copy: bool, what: str):
    check_specs_match(tree, specs, what)
    placed = []
    for (path, leaf), spec in zip(named_leaves(tree, is_leaf=is_none), jax.tree.leaves(specs, is_leaf=is_spec)):
        check_leaf(path, leaf, what)
        placed.append(place(leaf, sharding_of(spec, mesh), copy=copy) if is_array(leaf)
                      else leaf)
    return jax.tree.unflatten(jax.tree.structure(tree, is_leaf=is_none), placed)


# ----------------------------------------------------------------------------- optimizer state


def mirror_specs(abstract_state, model, specs):
    """Specs for an optimizer state: a leaf whose tree path ends with a
    parameter's path and has its shape takes that parameter's spec (Adam's mu
    and nu); everything else (counts, scalars) is replicated."""
    by_path = {tuple(path.split(".")): (tuple(x.shape), spec) for path, x, spec in leaves_with_specs(model, specs)}

    def spec_for(kp, leaf):
        parts = tuple(path_str(kp).split("."))
        for start in range(len(parts)):
            hit = by_path.get(parts[start:])
            if hit is not None and hit[0] == tuple(leaf.shape):
                return hit[1]
        return P()

    return jax.tree_util.tree_map_with_path(spec_for, abstract_state)


def trainable_params(model, trainable):
    """The floating arrays of ``model`` (concrete or abstract) that
    ``trainable`` (an Equinox filter spec, or None: all) selects."""
    params = eqx.filter(model, is_floating)
    if trainable is None:
        return params
    return eqx.filter(params, trainable)


def opt_state_specs(optimizer: optax.GradientTransformation, model, specs, trainable=None):
    """PartitionSpecs for the optimizer state of ``model``'s trainable
    parameters, each mirroring the spec of the parameter it belongs to."""
    abstract = jax.eval_shape(optimizer.init, trainable_params(model, trainable))
    return mirror_specs(abstract, model, specs)


Optimizer = optax.GradientTransformation | optax.MultiSteps


def as_optimizer(optimizer) -> optax.GradientTransformation:
    """``optimizer`` as the ``(init, update)`` pair steps use: an
    ``optax.MultiSteps`` gives its ``gradient_transformation()``."""
    if isinstance(optimizer, optax.MultiSteps):
        return optimizer.gradient_transformation()
    if not isinstance(optimizer, optax.GradientTransformation):
        raise TypeError(
            f"optimizer must be an optax.GradientTransformation (e.g. optax.adamw(1e-3)), got {type(optimizer).__name__}."
        )
    return optimizer


@typechecked
def init_opt_state(
    optimizer: Optimizer,
    model: PyTree,
    mesh: Mesh,
    specs: PyTree,
    *,
    trainable: Any = None,
) -> PyTree:
    """The optimizer state of ``model``'s trainable parameters, each leaf
    sharded like the parameter it mirrors (Adam's moments of a weight split on
    ``model`` are split the same way). It is created by a compiled function
    that writes each shard where it lives: nothing is gathered.

    For steps you write yourself with `make_step` over several models and
    optimizers; `init_state` uses it for one model.

    **Example:**

    ```python
    actor_opt = redeqx.init_opt_state(optax.adam(3e-4), actor, mesh, actor_specs)
    ```
    """
    optimizer = as_optimizer(optimizer)
    mesh = check_mesh(mesh)
    check_specs(specs, mesh)
    check_specs_match(model, specs, "model")
    os_specs = opt_state_specs(optimizer, model, specs, trainable)
    # on the mesh first (a no-op for a placed model): the compiled init takes its inputs where they are
    params = trainable_params(_place_tree(model, specs, mesh, copy=False, what="model"), trainable)
    return jax.jit(optimizer.init, out_shardings=named_shardings(os_specs, mesh))(params)


# ----------------------------------------------------------------------------- the train state


class TrainState(eqx.Module):
    """Everything a training step reads and returns, as one immutable value.

    ``step`` counts optimizer updates done so far (0 before the first).
    ``key`` is split once per step for the step's randomness (dropout...).
    ``model_state`` holds a model's non-trained state (``eqx.nn.State``:
    BatchNorm statistics), or None. Replace fields with ``eqx.tree_at`` or
    ``dataclasses.replace``; steps return a new state and never change the
    old one.
    """

    model: PyTree
    opt_state: optax.OptState
    step: Int[Array, ""]
    key: PRNGKeyArray
    model_state: PyTree = None


def _check_key(key) -> None:
    if not (isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key)):
        raise TypeError(
            f"key must be a typed PRNG key from jax.random.key(seed), got {type(key).__name__} "
            f"{getattr(key, 'dtype', '')}; write key=jax.random.key(0)."
        )


def replicate_key(key, mesh: Mesh):
    return place(key, NamedSharding(mesh, P()), copy=True)


@typechecked
def init_state(
    model: PyTree,
    optimizer: Optimizer,
    mesh: Mesh,
    specs: PyTree,
    *,
    key: PRNGKeyArray,
    trainable: Any = None,
    model_state: PyTree = None,
    donate_model: bool = False,
) -> TrainState:
    """A sharded `TrainState`: the model placed by ``specs`` and the optimizer
    state sharded like the parameters it mirrors (see `init_opt_state`).

    - ``trainable`` is the same Equinox filter spec given to
      `make_train_step`: frozen leaves get no optimizer state.
    - ``model_state`` is the model's ``eqx.nn.State`` (BatchNorm statistics),
      if it has one: kept replicated in ``state.model_state`` and passed to
      ``loss_fn`` as its fourth argument (see `make_train_step`).
    - ``donate_model=False`` (default): the state holds copies, so ``model``
      stays alive and usable after the first (donating) train step.
      ``donate_model=True`` moves the arrays instead, for a model too large to
      hold twice: ``model`` must not be used afterwards (its arrays may be
      deleted by the first step).
    - ``model`` may also be a constructor ``make_model(key)``: it is built
      straight into its shards (see `init_model`, using ``key``), or an
      abstract model (``eqx.filter_eval_shape``): the result is then the
      abstract TrainState, ``jax.ShapeDtypeStruct`` leaves with their
      shardings, to compile a step on with `plan` without allocating.

    **Example:**

    ```python
    state = redeqx.init_state(model, optax.adamw(1e-3), mesh, specs, key=jax.random.key(0))
    ```
    """
    optimizer = as_optimizer(optimizer)
    _check_key(key)
    mesh = check_mesh(mesh)
    check_specs(specs, mesh)
    if is_constructor(model):  # build it in its shards; nobody else holds these arrays
        jitted, static = constructor(model, mesh, specs, key)
        model, donate_model = eqx.combine(jitted(key), static), True
    if _is_abstract(model):
        return _abstract_state(model, optimizer, mesh, specs, key, trainable, model_state)
    model = _place_tree(model, specs, mesh, copy=not donate_model, what="model")
    opt_state = init_opt_state(optimizer, model, mesh, specs, trainable=trainable)
    if model_state is not None:
        model_state = _place_tree(model_state, jax.tree.map(lambda _: P(), model_state), mesh,
                                  copy=True, what="model_state")
    replicated = NamedSharding(mesh, P())
    return TrainState(
        model=model,
        opt_state=opt_state,
        step=place(jnp.zeros((), jnp.int32), replicated, copy=False),
        key=replicate_key(key, mesh),
        model_state=model_state,
    )


# ----------------------------------------------------------------------------- building models in their shards


def _call_with_key(make_model, key):
    """``make_model(key=key)`` when it names a ``key`` parameter (Equinox
    constructors, ``functools.partial`` of them), else ``make_model(key)``."""
    try:
        params = inspect.signature(make_model).parameters
    except (TypeError, ValueError):
        params = {}
    if "key" in params:
        return make_model(key=key)
    return make_model(key)


def is_constructor(x) -> bool:
    return callable(x) and not isinstance(x, eqx.Module) and not isinstance(x, (jax.Array, np.ndarray))


def _is_abstract(tree) -> bool:
    return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


def abstract_model(make_model, key):
    """The model ``make_model`` would build, as ``jax.ShapeDtypeStruct``
    leaves: nothing is allocated."""
    return eqx.filter_eval_shape(lambda k: _call_with_key(make_model, k), key)


def constructor(make_model, mesh: Mesh, specs, key):
    """The compiled constructor: ``make_model``'s arrays come out laid out by
    ``specs``, so each device computes and holds only its own shards (random
    initialisation included: JAX's partitionable PRNG draws each shard where
    it lives, and the values equal those of an unsharded build). Returns
    ``(jitted, static)``: ``jitted(key)`` gives the array leaves,
    ``eqx.combine`` with ``static`` gives the model."""
    abstract = abstract_model(make_model, key)
    check_specs_match(abstract, specs, "model")
    arrays, static = eqx.partition(abstract, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    leaves, treedef = jax.tree.flatten(arrays, is_leaf=is_none)
    spec_leaves = jax.tree.leaves(specs, is_leaf=is_spec)
    shardings = jax.tree.unflatten(treedef, [
        None if x is None else sharding_of(s, mesh) for x, s in zip(leaves, spec_leaves)
    ])

    def build(k):
        return eqx.filter(_call_with_key(make_model, k), eqx.is_array)

    return jax.jit(build, out_shardings=shardings), static


@typechecked
def init_model(
    make_model: Callable,
    mesh: Mesh,
    *,
    key: PRNGKeyArray,
    overrides: Sequence = (),
    fsdp: bool = False,
    loss_fn: Callable | None = None,
    batch: Any = None,
) -> PyTree:
    """Build ``make_model(key)`` straight into its shards.

    The constructor runs compiled, with the shardings of
    ``sharding_rules(model, mesh, loss_fn=loss_fn, batch=batch, overrides=overrides,
    fsdp=fsdp)`` (found on the abstract model, nothing allocated) as its outputs: a model too large for
    one device is never whole anywhere, and with ``fsdp=True`` each device holds
    about ``1 / n_devices`` of it. The values are those ``make_model(key)``
    gives on one device.

    ``make_model`` takes the key as ``key=`` if it has a parameter of that
    name (an Equinox class, a ``functools.partial`` of one), else as its only
    positional argument.

    **Example:**

    ```python
    config = models.LlamaConfig(hidden_size=2048, num_hidden_layers=16, ...)
    model = redeqx.init_model(lambda key: models.LlamaForCausalLM(config, key=key), mesh,
                              key=jax.random.key(0), fsdp=True)
    specs = redeqx.sharding_rules(model, mesh, fsdp=True)
    state = redeqx.init_state(model, optimizer, mesh, specs, key=key, donate_model=True)
    ```
    """
    mesh = check_mesh(mesh)
    _check_key(key)
    specs = sharding_rules(abstract_model(make_model, key), mesh, loss_fn=loss_fn, batch=batch,
                           overrides=overrides, fsdp=fsdp)
    jitted, static = constructor(make_model, mesh, specs, key)
    return eqx.combine(jitted(key), static)


def _abstract_state(model, optimizer, mesh: Mesh, specs, key, trainable, model_state) -> TrainState:
    """`init_state` on an abstract model: the same TrainState as
    ``jax.ShapeDtypeStruct`` leaves carrying their shardings (for `plan`)."""
    check_specs_match(model, specs, "model")

    def with_sharding(x, spec):
        if is_array_like(x):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_of(spec, mesh))
        return x

    leaves, treedef = jax.tree.flatten(model, is_leaf=is_none)
    model = jax.tree.unflatten(treedef, [with_sharding(x, s) for x, s in
                                         zip(leaves, jax.tree.leaves(specs, is_leaf=is_spec))])
    params = trainable_params(model, trainable)
    abstract_os = jax.eval_shape(optimizer.init, params)
    os_specs = mirror_specs(abstract_os, model, specs)
    opt_state = jax.tree.map(with_sharding, abstract_os, os_specs)
    replicated = NamedSharding(mesh, P())
    key_struct = jax.eval_shape(lambda: key)
    if model_state is not None:
        model_state = jax.tree.map(lambda x: with_sharding(x, P()), model_state)
    return TrainState(model=model, opt_state=opt_state,
                      step=jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated),
                      key=jax.ShapeDtypeStruct(key_struct.shape, key_struct.dtype, sharding=replicated),
                      model_state=model_state)


@typechecked
def apply_gradients(
    state: TrainState, grads: PyTree, optimizer: Optimizer, *, trainable: Any = None
) -> TrainState:
    """One optimizer update of ``state`` with ``grads`` (as from
    ``eqx.filter_grad(loss)(state.model)``): the new model, the new
    optimizer state and ``step + 1``, the key unchanged. For steps you write
    with `make_step` over several models; `make_train_step` does this for one.

    **Example:**

    ```python
    def step(state, batch):
        grads = eqx.filter_grad(actor_loss)(state["actor"].model, batch)
        return {**state, "actor": redeqx.apply_gradients(state["actor"], grads, actor_optimizer)}, {}
    ```
    """
    optimizer = as_optimizer(optimizer)
    params = trainable_params(state.model, trainable)  # as init_state(..., trainable=) made the optimizer state
    mask = jax.tree.map(lambda x: x is not None, params, is_leaf=is_none)
    grads = eqx.filter(grads, mask)
    updates, opt_state = optimizer.update(grads, state.opt_state, params)
    return dataclasses.replace(state, model=eqx.apply_updates(state.model, updates), opt_state=opt_state,
                               step=state.step + 1)


def refuse_deleted(tree, what: str, paths=None) -> None:
    """A step given an array whose buffer an earlier donating call took would
    crash the process (XLA:CPU segfaults executing it) or fail deep in JAX:
    name the leaf and the usual cause instead. (Paths are spelled out only
    when a leaf was deleted, unless ``paths`` already name ``tree``'s leaves:
    this runs on every step call.)"""
    leaves = jax.tree.leaves(tree)
    if not any(isinstance(x, jax.Array) and x.is_deleted() for x in leaves):
        return
    for path, x in zip(paths, leaves) if paths is not None else named_leaves(tree):
        if isinstance(x, jax.Array) and x.is_deleted():
            raise ValueError(
                f"leaf '{path}' of the {what} was deleted: an earlier step was given it and donated its memory (a train "
                "step reuses the state it is given for the state it returns). Use what that call returned, e.g. "
                "`state, metrics = train_step(state, batch)`, and evaluate or save that state, not the one passed "
                "in. To keep an old state too, copy it first: jax.tree.map(lambda x: x.copy() if "
                "eqx.is_array(x) else x, state)."
            )
