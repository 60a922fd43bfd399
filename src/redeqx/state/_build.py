"""Building a model straight into its shards: `init_model`, and the
compiled constructor `init_state` uses for a ``make_model(key)``."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh
from jaxtyping import PRNGKeyArray, PyTree

from ..mesh import check_key, check_mesh, check_specs_match, sharding_of
from .._trees import is_none, is_spec
from .._typing import typechecked
from ..sharding import sharding_rules


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


def is_abstract(tree) -> bool:
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
    check_key(key)
    specs = sharding_rules(abstract_model(make_model, key), mesh, loss_fn=loss_fn, batch=batch,
                           overrides=overrides, fsdp=fsdp)
    jitted, static = constructor(make_model, mesh, specs, key)
    return eqx.combine(jitted(key), static)
