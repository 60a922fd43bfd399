"""Optimizer wrappers for memory: keep an optimizer's state in a smaller dtype."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from .._typing import floating_dtype, typechecked


def _cast(tree, dtype):
    return jax.tree.map(
        lambda x: x.astype(dtype) if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating) else x, tree
    )


@typechecked
def with_opt_state_dtype(optimizer: optax.GradientTransformation, dtype: Any) -> optax.GradientTransformation:
    """``optimizer`` whose state is stored in ``dtype`` (e.g. ``jnp.bfloat16``:
    half the memory of Adam's moments) and computed in float32: each update
    casts the state up, runs ``optimizer.update``, and casts the new state
    down. Parameters and gradients keep their own dtype. Counters and other
    integer leaves are untouched.

    bfloat16 keeps 8 bits of mantissa: the second moment of small gradients
    loses precision, which large-model training usually tolerates; compare
    a short run against float32 before relying on it.

    **Example:**

    ```python
    optimizer = redeqx.with_opt_state_dtype(optax.adamw(1e-4), jnp.bfloat16)
    ```
    """
    dtype = floating_dtype(dtype, "with_opt_state_dtype(): dtype", allow_none=False)

    def init(params):
        return _cast(optimizer.init(params), dtype)

    def update(updates, state, params=None):
        updates, new_state = optimizer.update(updates, _cast(state, jnp.float32), params)
        return updates, _cast(new_state, dtype)

    return optax.GradientTransformation(init, update)
