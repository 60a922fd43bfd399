"""Optimizer wrappers for memory: keep an optimizer's state in a smaller dtype."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from .._typing import floating_dtype, typechecked


def _cast(tree, dtype):
    """``tree``'s floating arrays of at least one dim in ``dtype``. Scalars keep theirs: a step count,
    the hyperparameters ``optax.inject_hyperparams`` keeps in the state (Adam's b2 = 0.999 is 1.0 in
    bfloat16, and the second moment then never grows: NaN on the second step), a scalar parameter's
    moments (bytes nobody saves)."""
    return jax.tree.map(
        lambda x: x.astype(dtype) if isinstance(x, jax.Array) and x.ndim and jnp.issubdtype(x.dtype, jnp.floating)
        else x, tree
    )


@typechecked
def with_opt_state_dtype(optimizer: optax.GradientTransformation, dtype: Any) -> optax.GradientTransformation:
    """``optimizer`` whose state is stored in ``dtype`` (e.g. ``jnp.bfloat16``:
    half the memory of Adam's moments) and computed in float32: each update
    casts the state up, runs ``optimizer.update``, and casts the new state
    down. Parameters and gradients keep their own dtype. Scalars (counters,
    the hyperparameters ``optax.inject_hyperparams`` stores) keep theirs.
    Extra arguments reach ``optimizer`` (``value=`` for
    ``optax.contrib.reduce_on_plateau``).

    bfloat16 keeps 8 bits of mantissa: the second moment of small gradients
    loses precision, which large-model training usually tolerates; compare
    a short run against float32 before relying on it.

    **Example:**

    ```python
    optimizer = redeqx.with_opt_state_dtype(optax.adamw(1e-4), jnp.bfloat16)
    ```
    """
    dtype = floating_dtype(dtype, "with_opt_state_dtype(): dtype", allow_none=False)
    if jnp.finfo(dtype).maxexp < jnp.finfo(jnp.float32).maxexp:
        raise ValueError(
            f"with_opt_state_dtype(): dtype={jnp.dtype(dtype).name} has a narrower range than float32: squares of "
            f"gradients below {float(jnp.sqrt(jnp.finfo(dtype).smallest_subnormal)):.1e} underflow to 0 in Adam's "
            "second moment, and its updates grow many times over (13x for gradients of 1e-3 in float16). Use "
            "jnp.bfloat16, which has float32's range.")
    optimizer = optax.with_extra_args_support(optimizer)

    def init(params):
        return _cast(optimizer.init(params), dtype)

    def update(updates, state, params=None, **extra_args):
        updates, new_state = optimizer.update(updates, _cast(state, jnp.float32), params, **extra_args)
        return updates, _cast(new_state, dtype)

    return optax.GradientTransformationExtraArgs(init, update)
