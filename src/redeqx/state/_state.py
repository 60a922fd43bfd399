"""The immutable training state: `TrainState`, `init_state` (a sharded one,
or an abstract one for `plan`) and `apply_gradients`.

The pieces it is built from have their own modules: spec and argument
checks (``_spec_checks.py``), placing arrays (``_placement.py``), the
optimizer state (``_opt_state.py``) and building a model in its shards
(``_build.py``). Their names stay importable from here too.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Int, PRNGKeyArray, PyTree

from ._build import constructor, is_abstract, is_constructor
from ..mesh import check_key, check_mesh, check_specs, check_specs_match, place, place_tree, replicate_key, sharding_of
from ._muon import warn_muon_layout
from ._opt_state import Optimizer, as_optimizer, init_opt_state, mirror_specs, split_trainable, trainable_params
from .._trees import is_array_like, is_none, is_spec
from .._typing import typechecked


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
    check_key(key)
    mesh = check_mesh(mesh)
    check_specs(specs, mesh)
    if is_constructor(model):  # build it in its shards; nobody else holds these arrays
        jitted, static = constructor(model, mesh, specs, key)
        model, donate_model = eqx.combine(jitted(key), static), True
    if is_abstract(model):
        return _abstract_state(model, optimizer, mesh, specs, key, trainable, model_state)
    model = place_tree(model, specs, mesh, copy=not donate_model, what="model")
    opt_state = init_opt_state(model, optimizer, mesh, specs, trainable=trainable)
    if model_state is not None:
        model_state = place_tree(model_state, jax.tree.map(lambda _: P(), model_state), mesh,
                                  copy=True, what="model_state")
    replicated = NamedSharding(mesh, P())
    return TrainState(
        model=model,
        opt_state=opt_state,
        step=place(jnp.zeros((), jnp.int32), replicated, copy=False),
        key=replicate_key(key, mesh),
        model_state=model_state,
    )


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
    warn_muon_layout(abstract_os, model)
    os_specs = mirror_specs(abstract_os, model, specs, mesh)
    opt_state = jax.tree.map(with_sharding, abstract_os, os_specs)
    replicated = NamedSharding(mesh, P())
    key_struct = jax.eval_shape(lambda: key)
    if model_state is not None:
        model_state = jax.tree.map(lambda x: with_sharding(x, P()), model_state)
    return TrainState(model=model, opt_state=opt_state,
                      step=jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated),
                      key=jax.ShapeDtypeStruct(key_struct.shape, key_struct.dtype, sharding=replicated),
                      model_state=model_state)


def optimizer_update(optimizer: optax.GradientTransformation, params, static, grads, opt_state, **extra_args):
    """``(new_model, new_opt_state)``: the one optimizer update, of `make_train_step` and `apply_gradients`.

    ``optimizer.update`` of the trainable parameters ``params`` (with
    ``static``, the rest of the model: `split_trainable`'s pair; ``grads``
    filtered to them), with ``extra_args`` passed to an optimizer that takes
    them (optax's ``GradientTransformationExtraArgs``, e.g. ``value=`` for
    ``reduce_on_plateau``) and ignored by one that does not, as
    ``optax.with_extra_args_support`` does; the updates are added in each
    parameter's own dtype (``optax.apply_updates``)."""
    if jax.tree.structure(jax.eval_shape(optimizer.init, params)) != jax.tree.structure(opt_state):
        raise ValueError(
            "state.opt_state does not match the trainable parameters of this step: pass the same optimizer and "
            "trainable= to redeqx.init_state and to redeqx.make_train_step (or redeqx.apply_gradients)."
        )
    _check_grads_cover(grads, params)
    grads = eqx.filter(grads, jax.tree.map(lambda x: x is not None, params, is_leaf=is_none))
    updates, opt_state = optax.with_extra_args_support(optimizer).update(grads, opt_state, params, **extra_args)
    return eqx.combine(optax.apply_updates(params, updates), static), opt_state


def _check_grads_cover(grads, params) -> None:
    """Every trainable parameter has a gradient: grads taken of one part of the model
    (``eqx.partition``) leave None where the optimizer state (made for ``params``) holds moments."""
    with_grad = {path for path, g in jax.tree_util.tree_flatten_with_path(grads, is_leaf=is_none)[0]
                 if g is not None}
    missing = [jax.tree_util.keystr(path) for path, p in jax.tree_util.tree_flatten_with_path(params)[0]
               if p is not None and path not in with_grad]
    if missing:
        raise ValueError(
            f"grads has no gradient for {len(missing)} trainable parameters ({', '.join(missing[:4])}"
            f"{', ...' if len(missing) > 4 else ''}), for which the optimizer state holds its statistics. If they are "
            "frozen, say so where the state is made and where it is updated: redeqx.init_state(..., trainable=) "
            "and apply_gradients(..., trainable=) (or make_train_step(..., trainable=)), with the same filter.")


@typechecked
def apply_gradients(
    state: TrainState, grads: PyTree, optimizer: Optimizer, *, trainable: Any = None, **extra_args: Any
) -> TrainState:
    """One optimizer update of ``state`` with ``grads`` (as from
    ``eqx.filter_grad(loss)(state.model)``): the new model, the new
    optimizer state and ``step + 1``, the key unchanged. For steps you write
    with `make_step` over several models; `make_train_step` does this for
    one, by the same code. ``extra_args`` go to an optimizer that takes
    them (optax's ``GradientTransformationExtraArgs``: ``value=loss`` for
    ``optax.contrib.reduce_on_plateau``); one that does not ignores them.

    **Example:**

    ```python
    def step(state, batch):
        grads = eqx.filter_grad(actor_loss)(state["actor"].model, batch)
        return {**state, "actor": redeqx.apply_gradients(state["actor"], grads, actor_optimizer)}, {}
    ```
    """
    params, static = split_trainable(state.model, trainable)  # as init_state(..., trainable=) made the optimizer state
    model, opt_state = optimizer_update(as_optimizer(optimizer), params, static, grads, state.opt_state, **extra_args)
    return dataclasses.replace(state, model=model, opt_state=opt_state, step=state.step + 1)
