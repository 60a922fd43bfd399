"""Optimizer state: specs mirroring the parameters' (Adam's moments split
like their weight), and `init_opt_state`, which builds it in its shards."""

from __future__ import annotations

import functools
from typing import Any

import equinox as eqx
import jax
import optax
from jax.sharding import Mesh, PartitionSpec as P
from jaxtyping import PyTree

from ..mesh import check_mesh, check_specs, check_specs_match, named_shardings, place_tree
from .._trees import is_floating, leaves_with_specs, path_str
from .._typing import typechecked, warn_user
from ._muon import spread_muon_momentum, warn_muon_layout


def mirror_specs(abstract_state, model, specs, mesh: Mesh | None = None):
    """Specs for an optimizer state: a leaf whose tree path ends with a
    parameter's path and has its shape takes that parameter's spec (Adam's mu
    and nu); everything else (counts, scalars) is replicated. Given the
    ``mesh``, Muon's momentum of a stacked matrix is also split over ``data``
    on its layer axis (`spread_muon_momentum`)."""
    by_path = {tuple(path.split(".")): (tuple(x.shape), spec) for path, x, spec in leaves_with_specs(model, specs)}

    def spec_for(kp, leaf):
        parts = tuple(path_str(kp).split("."))
        for start in range(len(parts)):
            hit = by_path.get(parts[start:])
            if hit is not None and hit[0] == tuple(leaf.shape):
                return hit[1]
        return P()

    mirrored = jax.tree_util.tree_map_with_path(spec_for, abstract_state)
    return mirrored if mesh is None else spread_muon_momentum(abstract_state, model, specs, mirrored, mesh)


def trainable_params(model, trainable):
    """The floating arrays of ``model`` (concrete or abstract) that
    ``trainable`` (an Equinox filter spec, or None: all) selects."""
    params = eqx.filter(model, is_floating)
    if trainable is None:
        return params
    return eqx.filter(params, trainable)


def split_trainable(model, trainable):
    """(trainable floating arrays, everything else), as ``eqx.partition`` gives."""
    params = trainable_params(model, trainable)
    mask = jax.tree.map(lambda x: x is not None, params, is_leaf=lambda x: x is None)
    return eqx.partition(model, mask)


def opt_state_specs(optimizer: optax.GradientTransformation, model, specs, trainable=None, mesh: Mesh | None = None):
    """PartitionSpecs for the optimizer state of ``model``'s trainable
    parameters, each mirroring the spec of the parameter it belongs to."""
    abstract = jax.eval_shape(optimizer.init, trainable_params(model, trainable))
    warn_muon_layout(abstract, model)
    return mirror_specs(abstract, model, specs, mesh)


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
    model: PyTree,
    optimizer: Optimizer,
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
    optimizers; `init_state` uses it for one model. Its arguments come in
    `init_state`'s order; the old order ``(optimizer, model, ...)`` still
    works this release, with a ``DeprecationWarning``.

    **Example:**

    ```python
    actor_opt = redeqx.init_opt_state(actor, optax.adam(3e-4), mesh, actor_specs)
    ```
    """
    optimizer = as_optimizer(optimizer)
    mesh = check_mesh(mesh)
    check_specs(specs, mesh)
    check_specs_match(model, specs, "model")
    os_specs = opt_state_specs(optimizer, model, specs, trainable, mesh)
    # on the mesh first (a no-op for a placed model): the compiled init takes its inputs where they are
    params = trainable_params(place_tree(model, specs, mesh, copy=False, what="model"), trainable)
    return jax.jit(optimizer.init, out_shardings=named_shardings(os_specs, mesh))(params)


def _accept_old_order(fn):
    """``fn`` that also takes redeqx 0.1.0's order, ``(optimizer, model, ...)``,
    for one release: an optimizer first and none second can only be that."""

    @functools.wraps(fn)
    def init_opt_state(*args, **kwargs):
        if len(args) >= 2 and isinstance(args[0], Optimizer) and not isinstance(args[1], Optimizer):
            warn_user("redeqx.init_opt_state(optimizer, model, ...) is deprecated and stops working in the next "
                      "release: pass the model first, as to init_state: init_opt_state(model, optimizer, mesh, specs).",
                      DeprecationWarning)
            args = (args[1], args[0], *args[2:])
        return fn(*args, **kwargs)

    return init_opt_state


init_opt_state = _accept_old_order(init_opt_state)
