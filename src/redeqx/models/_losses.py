"""The token loss with Transformers' ignore index: `cross_entropy`."""

from __future__ import annotations

import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int

from .._typing import typechecked

IGNORE_INDEX = -100  # what Transformers' losses skip


@typechecked
def cross_entropy(logits: Float[Array, "*batch vocab"], labels: Int[Array, "*batch"], *,
                  ignore_index: int | None = IGNORE_INDEX) -> Float[Array, ""]:
    """The mean cross-entropy of ``logits`` against integer ``labels`` over the labels that are not
    ``ignore_index`` (``-100``, as in Transformers: padding, a prompt's tokens), 0 when all are.

    Any other label outside ``[0, vocab)`` makes the loss NaN (the NaN guards then name the step):
    ``optax.softmax_cross_entropy_with_integer_labels`` alone reads ``-1`` or ``-100`` as a token
    counted from the end of the vocabulary, and trains on it with a finite loss.

    **Example:**

    ```python
    def loss_fn(model, batch, key):
        logits = jax.vmap(model)(batch["input_ids"])
        return redeqx.models.cross_entropy(logits[:, :-1], batch["labels"][:, 1:])  # -100: not counted
    ```
    """
    vocab = logits.shape[-1]
    counted = labels != ignore_index if ignore_index is not None else jnp.ones(labels.shape, bool)
    known = (labels >= 0) & (labels < vocab)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), jnp.where(known, labels, 0))
    nll = jnp.where(counted & ~known, jnp.nan, jnp.where(counted, nll, 0.0))
    return nll.sum() / jnp.maximum(counted.sum(), 1)
