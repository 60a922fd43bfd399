"""Text generation for any decoder: greedy, sampling, beam search.

Everything here is a traceable JAX function of a fixed shape (a
``lax.scan`` over new tokens), so it runs under ``jax.jit`` and as a
``pred_fn`` of `redeqx.make_predict_step`, sharded like the model it drives.
A model drives generation through the `Decoder` protocol (``prefill`` and
``decode`` with a cache), which every model of `redeqx.models` follows and
yours can too; a model that only maps tokens to logits is driven without a
cache (`Recomputing`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from ..context import context_shards
from .._typing import positive_int
from ._layers import CausalLM, caches_by_layer, sliced_for_decoding

Sampler = Callable[[Float[Array, "batch vocab"], PRNGKeyArray], Int[Array, " batch"]]


@dataclasses.dataclass(frozen=True)
class _Greedy:
    needs_key = False

    def __call__(self, logits, key):
        del key
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class _Sample:
    temperature: float
    top_k: int | None
    top_p: float | None
    needs_key = True

    def __call__(self, logits, key):
        logits = logits.astype(jnp.float32) / self.temperature
        neg = jnp.finfo(jnp.float32).min
        if self.top_k is not None and self.top_k < logits.shape[-1]:
            kth = jax.lax.top_k(logits, self.top_k)[0][:, -1:]  # (B, 1)
            logits = jnp.where(logits < kth, neg, logits)
        if self.top_p is not None and self.top_p < 1:
            order = jnp.argsort(-logits, axis=-1)
            sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
            probs = jax.nn.softmax(sorted_logits, axis=-1)
            before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more likely tokens
            keep_sorted = before < self.top_p  # the most likely token always stays
            keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
            logits = jnp.where(keep, logits, neg)
        return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def greedy() -> Sampler:
    """The most likely next token (what Transformers' ``do_sample=False`` does)."""
    return _Greedy()


def sample(temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None) -> Sampler:
    """Draw the next token from ``softmax(logits / temperature)``, keeping only
    the ``top_k`` most likely tokens and/or the smallest set whose probability
    reaches ``top_p`` (nucleus sampling).

    **Example:**

    ```python
    tokens = generate(model, prompts, max_new_tokens=64, sampler=sample(0.7, top_p=0.9), key=key)
    ```
    """
    if not temperature > 0:
        raise ValueError(f"sample: temperature must be > 0, got {temperature!r}; use greedy() for temperature 0.")
    if top_k is not None:
        positive_int(top_k, "sample: top_k")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"sample: top_p must be in (0, 1] or None, got {top_p!r}.")
    return _Sample(float(temperature), top_k, None if top_p is None else float(top_p))


@runtime_checkable
class Decoder(Protocol):
    """What `generate` and `beam_search` drive, for one sequence (they
    ``jax.vmap`` it over the batch):

    - ``prefill(input_ids, attention_mask, max_new_tokens) -> (next_logits,
      cache)`` reads the prompt ``(prompt_len,)`` (``attention_mask`` is
      ``False`` on padding, which may sit anywhere) and returns the logits of
      the token after its last real one, ``(vocab,)``, and a cache with room
      for ``max_new_tokens`` more tokens;
    - ``decode(input_ids, cache) -> (logits, cache)`` runs tokens ``(t,)``
      after what ``cache`` holds: their logits ``(t, vocab)`` and the cache
      with them.

    A cache is any pytree of arrays whose shapes do not change (a KV cache, a
    recurrent state); beam search reorders it along the batch.

    **Example** (a recurrent decoder whose cache is its hidden state):

    ```python
    class CharRNN(eqx.Module):
        embed: eqx.nn.Embedding
        cell: eqx.nn.GRUCell
        head: eqx.nn.Linear

        def step(self, h, token):
            h = self.cell(self.embed(token), h)
            return h, self.head(h)

        def prefill(self, input_ids, attention_mask, max_new_tokens):
            def read(h, xs):  # padding leaves the state as it is
                token, real = xs
                return jnp.where(real, self.step(h, token)[0], h), None
            h, _ = jax.lax.scan(read, jnp.zeros(self.cell.hidden_size), (input_ids, attention_mask))
            return self.head(h), h

        def decode(self, input_ids, h):
            h, logits = jax.lax.scan(lambda h, token: self.step(h, token), h, input_ids)
            return logits, h

    tokens = redeqx.models.generate(CharRNN(...), prompts, max_new_tokens=20)
    ```
    """

    def prefill(self, input_ids: Int[Array, " prompt"], attention_mask: Bool[Array, " prompt"],
                max_new_tokens: int) -> tuple[Float[Array, " vocab"], Any]: ...

    def decode(self, input_ids: Int[Array, " seq"], cache: Any) -> tuple[Float[Array, "seq vocab"], Any]: ...


class Recomputing(eqx.Module):
    """A decoder without a cache, ``model(input_ids) -> logits`` for a causal
    ``model`` (``(seq,) -> (seq, vocab)``), as a `Decoder`: the cache is the
    tokens so far in a buffer of prompt + ``max_new_tokens`` slots, and each
    new token re-runs the model on the whole buffer (no KV cache: a step
    costs a forward pass of that length). `generate` and `beam_search` use it
    for a model without ``prefill``/``decode``."""

    model: Callable

    def prefill(self, input_ids, attention_mask, max_new_tokens: int):
        order = jnp.argsort(~attention_mask.astype(bool), stable=True)  # real tokens first, in their order
        length = jnp.sum(attention_mask.astype(jnp.int32))
        buffer = jnp.concatenate([input_ids[order], jnp.zeros((max_new_tokens,), input_ids.dtype)])
        return self._logits(buffer)[length - 1], (buffer, length)

    def decode(self, input_ids, cache):
        buffer, length = cache
        buffer = jax.lax.dynamic_update_slice_in_dim(buffer, input_ids.astype(buffer.dtype), length, axis=0)
        logits = jax.lax.dynamic_slice_in_dim(self._logits(buffer), length, input_ids.shape[0], axis=0)
        return logits, (buffer, length + input_ids.shape[0])

    def _logits(self, buffer):
        logits = self.model(buffer)
        if jnp.ndim(logits) != 2 or logits.shape[0] != buffer.shape[0]:
            raise ValueError(
                f"generate: the model maps {buffer.shape[0]} tokens to logits of shape {jnp.shape(logits)}, where "
                f"({buffer.shape[0]}, vocab) was expected: a model without prefill/decode (redeqx.models.Decoder) "
                "is called on one sequence of token ids, as model(input_ids), and must return one row of "
                "logits per token."
            )
        return logits


def as_decoder(model) -> Decoder:
    """``model`` if it follows the `Decoder` protocol, else ``Recomputing(model)``."""
    if isinstance(model, Decoder):
        return model
    if callable(model):
        return Recomputing(model)
    raise TypeError(
        f"model is a {type(model).__name__}, which generate can neither decode with (prefill and decode, the "
        "redeqx.models.Decoder protocol) nor call (model(input_ids) -> logits)."
    )


_CONTEXT_MESH = (
    "{what} on a mesh that splits sequences over 'context' ({n} shards) needs a model whose prefill reads a prompt "
    "in the split order (redeqx.batches or redeqx.predict with seq_keys put it there): the zoo's decoder-only "
    "models do; a {model} does not. Generate on a mesh without a context axis over the same devices: "
    "mesh2 = redeqx.make_mesh(n_model_shards), the model moved with "
    "redeqx.shard(model, redeqx.sharding_rules(model, mesh2), mesh2), and predict(..., mesh2) without seq_keys."
)


def _static(eos_token_id):
    """``eos_token_id`` as a value the compiled loops can key on (a list becomes a tuple)."""
    return tuple(eos_token_id) if isinstance(eos_token_id, list) else eos_token_id


def _check(model, input_ids, max_new_tokens, attention_mask, what):
    if context_shards() > 1 and not isinstance(model, CausalLM):
        raise ValueError(_CONTEXT_MESH.format(what=what, n=context_shards(), model=type(model).__name__))
    if jnp.ndim(input_ids) != 2:
        raise ValueError(
            f"input_ids must be (batch, prompt_len) token ids, got shape {jnp.shape(input_ids)}; "
            "for one prompt write input_ids[None]."
        )
    positive_int(max_new_tokens, "max_new_tokens")
    if attention_mask is not None and jnp.shape(attention_mask) != jnp.shape(input_ids):
        raise ValueError(
            f"attention_mask has shape {jnp.shape(attention_mask)} but input_ids has {jnp.shape(input_ids)}; "
            "give one flag per prompt token (False for padding)."
        )
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    concrete = not isinstance(input_ids, jax.core.Tracer) and getattr(input_ids, "is_fully_addressable", True)
    if vocab is not None and concrete and np.size(input_ids):  # under jit the ids are a tracer: unchecked
        ids = np.asarray(input_ids)
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab:
            raise ValueError(
                f"input_ids holds token ids from {lo} to {hi}, outside the model's vocabulary of {vocab} "
                f"(ids 0..{vocab - 1}); an embedding lookup out of range gives no error, only wrong tokens. "
                "Tokenise with the model's own tokenizer, or map unknown tokens to its unk id."
            )
    return jnp.ones(input_ids.shape, bool) if attention_mask is None else jnp.asarray(attention_mask).astype(bool)


def _eos_hit(tokens, eos_token_id):
    if eos_token_id is None:
        return jnp.zeros(tokens.shape, bool)
    ids = jnp.asarray(eos_token_id, jnp.int32).reshape(-1)
    return jnp.any(tokens[..., None] == ids.reshape((1,) * tokens.ndim + (-1,)), axis=-1)


def _prefill(model, input_ids, mask, max_new_tokens):
    return jax.vmap(lambda i, m: model.prefill(i, m, max_new_tokens))(input_ids, mask)


def _step(model, tokens, cache):
    logits, cache = jax.vmap(lambda t, c: model.decode(t[None], c))(tokens, cache)
    return logits[:, 0], cache


def generate(
    model,
    input_ids: Int[Array, "batch prompt"],
    *,
    max_new_tokens: int,
    attention_mask: Bool[Array, "batch prompt"] | None = None,
    sampler: Sampler | None = None,
    key: PRNGKeyArray | None = None,
    eos_token_id: int | tuple[int, ...] | None = None,
    pad_token_id: int = 0,
) -> Int[Array, "batch max_new_tokens"]:
    """The ``max_new_tokens`` tokens that follow each prompt, one cached
    decoding step per token (``model`` a `Decoder`; a model that only maps
    tokens to logits re-runs the whole sequence per token, `Recomputing`).

    Prompts of different lengths are padded (on the left, the right, or
    both: the same tokens follow), with ``attention_mask`` ``False`` on the
    padding. ``sampler`` picks each token (default
    `greedy`; `sample` for temperature/top-k/top-p, which needs ``key``).
    After a sequence emits ``eos_token_id`` its remaining tokens are
    ``pad_token_id``. On a mesh that splits sequences over ``context``, a
    zoo decoder-only model takes the prompt in the split order and splits
    its prefill (the model's ``prefill``); the decoding steps then
    run on the whole cache. Other models raise there.

    **Example** (as a ``pred_fn``, sharded with the model):

    ```python
    def pred_fn(model, batch, key):
        return generate(model, batch["input_ids"], attention_mask=batch["attention_mask"],
                        max_new_tokens=32, eos_token_id=2)

    predict_step = redeqx.make_predict_step(pred_fn, mesh, specs)
    ```
    """
    mask = _check(model, input_ids, max_new_tokens, attention_mask, "generate")
    model = as_decoder(model)
    sampler = greedy() if sampler is None else sampler
    if key is None:
        if getattr(sampler, "needs_key", True):
            raise ValueError("generate: this sampler draws random tokens; pass key=jax.random.key(...).")
        key = jax.random.key(0)
    return _generate(model, input_ids, mask, key, sampler, max_new_tokens, _static(eos_token_id), pad_token_id)


# The decoding loops, compiled once per model, shapes and setting when generate or beam_search is called
# outside jit (the prefill would otherwise run op by op); inside a jitted step they are traced inline.
@eqx.filter_jit
def _generate(model, input_ids, mask, key, sampler, max_new_tokens, eos_token_id, pad_token_id):
    b = input_ids.shape[0]
    last, cache = _prefill(model, input_ids, mask, max_new_tokens)
    model = sliced_for_decoding(model)  # on a GPU: each layer's weights sliced once, not every token
    cache = jax.vmap(caches_by_layer)(cache)  # a stacked cache as each layer's own buffer

    def body(carry, step_key):
        last, cache, done = carry
        token = jnp.where(done, pad_token_id, sampler(last, step_key)).astype(jnp.int32)
        done = done | _eos_hit(token, eos_token_id)
        last, cache = _step(model, token, cache)
        return (last, cache, done), token

    keys = jax.random.split(key, max_new_tokens)
    _, tokens = jax.lax.scan(body, (last, cache, jnp.zeros((b,), bool)), keys)
    return tokens.T  # (batch, max_new_tokens)


def beam_search(
    model,
    input_ids: Int[Array, "batch prompt"],
    *,
    max_new_tokens: int,
    num_beams: int,
    attention_mask: Bool[Array, "batch prompt"] | None = None,
    length_penalty: float = 1.0,
    eos_token_id: int | tuple[int, ...] | None = None,
    pad_token_id: int = 0,
) -> Int[Array, "batch max_new_tokens"]:
    """The best of ``num_beams`` hypotheses kept by total log-probability.

    Each step extends every live beam by every token and keeps the
    ``num_beams`` best; a beam that emitted ``eos_token_id`` is finished and
    carries its score unchanged (padded with ``pad_token_id``). The winner
    maximises ``log p / length ** length_penalty``. A finished beam keeps
    its place among the ``num_beams``, so fewer stay live: Hugging Face's
    ``generate(num_beams=...)`` keeps ``num_beams`` live beams beside a pool
    of finished ones, and once a beam ends early the two may choose other
    hypotheses (each its own rule's best; without ``eos_token_id`` they
    agree, tested against Transformers).

    **Example:**

    ```python
    tokens = beam_search(model, prompts, max_new_tokens=32, num_beams=4, eos_token_id=2)
    ```
    """
    mask = _check(model, input_ids, max_new_tokens, attention_mask, "beam_search")
    positive_int(num_beams, "num_beams")
    return _beam_search(as_decoder(model), input_ids, mask, max_new_tokens, num_beams, float(length_penalty),
                        _static(eos_token_id), pad_token_id)


@eqx.filter_jit
def _beam_search(model, input_ids, mask, max_new_tokens, num_beams, length_penalty, eos_token_id, pad_token_id):
    b, k = input_ids.shape[0], num_beams
    rep = lambda x: jnp.repeat(x, k, axis=0)  # (B, ...) -> (B*K, ...), beams of a row adjacent
    last, cache = _prefill(model, rep(input_ids), rep(mask), max_new_tokens)
    model, cache = sliced_for_decoding(model), jax.vmap(caches_by_layer)(cache)
    neg = jnp.finfo(jnp.float32).min
    scores = jnp.tile(jnp.asarray([0.0] + [neg] * (k - 1), jnp.float32), (b, 1))  # only beam 0 starts live

    def reorder(x, beam):  # x: (B*K, ...) ; beam: (B, K) source beam of each new beam
        x = x.reshape(b, k, *x.shape[1:])
        x = jnp.take_along_axis(x, beam.reshape(b, k, *([1] * (x.ndim - 2))), axis=1)
        return x.reshape(b * k, *x.shape[2:])

    def body(carry, i):
        last, cache, scores, done, lengths, history = carry
        logp = jax.nn.log_softmax(last.astype(jnp.float32), axis=-1).reshape(b, k, -1)  # (B, K, V)
        v = logp.shape[-1]
        pad_only = jnp.full((v,), neg).at[pad_token_id].set(0.0)
        logp = jnp.where(done.reshape(b, k, 1), pad_only.reshape(1, 1, v), logp)  # finished beams only extend with pad, for free
        cand = (scores[:, :, None] + logp).reshape(b, k * v)  # (B, K*V)
        scores, idx = jax.lax.top_k(cand, k)  # (B, K)
        beam, token = idx // v, (idx % v).astype(jnp.int32)
        flat = lambda x: x.reshape(b * k)
        was_done = flat(jnp.take_along_axis(done.reshape(b, k), beam, axis=1))
        token_flat = jnp.where(was_done, pad_token_id, flat(token))
        lengths = jnp.where(was_done, reorder(lengths, beam), reorder(lengths, beam) + 1)
        done = was_done | _eos_hit(token_flat, eos_token_id)
        history = reorder(history, beam).at[:, i].set(token_flat)
        cache = jax.tree.map(lambda x: reorder(x, beam), cache)
        last, cache = _step(model, token_flat, cache)
        return (last, cache, scores, done, lengths, history), None

    init = (last, cache, scores, jnp.zeros((b * k,), bool), jnp.zeros((b * k,), jnp.int32),
            jnp.full((b * k, max_new_tokens), pad_token_id, jnp.int32))
    (_, _, scores, _, lengths, history), _ = jax.lax.scan(body, init, jnp.arange(max_new_tokens))
    normed = scores / jnp.maximum(lengths.reshape(b, k), 1).astype(jnp.float32) ** length_penalty
    best = jnp.argmax(normed, axis=1)
    return jnp.take_along_axis(history.reshape(b, k, -1), best[:, None, None], axis=1)[:, 0]
