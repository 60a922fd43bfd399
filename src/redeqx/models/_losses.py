"""The token loss with Transformers' ignore index: `cross_entropy`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from .._typing import typechecked

IGNORE_INDEX = -100  # what Transformers' losses skip


@typechecked
def cross_entropy(logits: Float[Array | np.ndarray, "*batch vocab"], labels: Int[Array | np.ndarray, "*batch"], *,
                  ignore_index: int | None = IGNORE_INDEX) -> Float[Array, ""]:
    """The mean cross-entropy of ``logits`` against integer ``labels`` over the labels that are not
    ``ignore_index`` (``-100``, as in Transformers: padding, a prompt's tokens), 0 when all are.

    Any other label outside ``[0, vocab)`` makes the loss NaN (the NaN guards then name the step):
    ``optax.softmax_cross_entropy_with_integer_labels`` alone reads ``-1`` or ``-100`` as a token
    counted from the end of the vocabulary, and trains on it with a finite loss.

    The statistics are taken in float32 whatever the logits' dtype, and the gradient
    (``softmax - one_hot``) is formed in one elementwise pass in the logits' dtype: bfloat16
    logits are never copied to float32 nor scattered into (`_token_nll`).

    **Example:**

    ```python
    def loss_fn(model, batch, key):
        logits = jax.vmap(model)(batch["input_ids"])
        return redeqx.models.cross_entropy(logits[:, :-1], batch["labels"][:, 1:])  # -100: not counted
    ```
    """
    logits, labels = jnp.asarray(logits), jnp.asarray(labels)  # NumPy arrays too (outside a step)
    vocab = logits.shape[-1]
    counted = labels != ignore_index if ignore_index is not None else jnp.ones(labels.shape, bool)
    known = (labels >= 0) & (labels < vocab)
    nll = _token_nll(logits, jnp.where(known, labels, 0))
    nll = jnp.where(counted & ~known, jnp.nan, jnp.where(counted, nll, 0.0))
    return nll.sum() / jnp.maximum(counted.sum(), 1)


@jax.custom_jvp
def _token_nll(logits, labels):
    """``logsumexp(logits) - logits[label]`` per token in float32, ``labels`` in ``[0, vocab)``.

    Its derivative is written out (`_nll_jvp`): the tangent is ``sum((softmax - one_hot) * t)``,
    whose transpose, the gradient, is one elementwise pass in the logits' dtype. Autodiff of
    ``optax.softmax_cross_entropy_with_integer_labels(logits.astype(float32), labels)`` (the same
    values) costs a large vocabulary two more passes: a float32 copy of the logits (the
    ``astype``'s transpose) and a scatter of the label's gradient into a float32 zero array
    (``take_along_axis``'s transpose). On an LM head of 16,384 tokens x 32,000 that is 13.7 GB moved
    a step against 5.3 (XLA:GPU's program for an H100, ``python -m benchmarks.gpu_compile``). Forward
    mode (``jax.jvp``, Hessian-vector products) works as for any JAX function."""
    return _nll_and_lse(logits, labels)[0]


def _nll_and_lse(logits, labels):
    lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
    return lse - jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0].astype(jnp.float32), lse


@_token_nll.defjvp
def _nll_jvp(primals, tangents):
    logits, labels = primals
    out, lse = _nll_and_lse(logits, labels)
    return out, _tangent(logits, lse, labels, tangents[0])


@functools.partial(jax.checkpoint, prevent_cse=False)  # the softmax recomputed, not an (N, vocab) residual
def _tangent(logits, lse, labels, t):
    p = jnp.exp(logits.astype(jnp.float32) - lse[..., None])
    hit = jax.lax.broadcasted_iota(labels.dtype, logits.shape, logits.ndim - 1) == labels[..., None]
    return jnp.sum((p - hit) * t.astype(jnp.float32), axis=-1)
