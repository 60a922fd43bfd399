"""What T5 and BART share: the teacher-forcing shift, the decoding cache of an
encoder-decoder model, and cached decoding (`EncoderDecoderLM`)."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from ..context import context_shards
from ._layers import KVCache, check_fits, empty_caches, is_stacked, n_layers


def shift_right(labels: Int[Array, "*batch tgt"], config) -> Int[Array, "*batch tgt"]:
    """Decoder inputs for teacher forcing: ``config.decoder_start_token_id``
    then the labels but the last, with ignored labels (``-100``) read as
    ``config.pad_token_id``."""
    labels = jnp.where(labels == -100, config.pad_token_id, labels)
    start = jnp.full(labels.shape[:-1] + (1,), config.decoder_start_token_id, labels.dtype)
    return jnp.concatenate([start, labels[..., :-1]], axis=-1)


def refuse_split(model) -> None:
    """A clear error for an encoder-decoder model traced under a mesh that splits
    sequences over ``context``: its positions and masks read ``arange``, so the
    split order (`redeqx.batches`' ``seq_keys``) would train it on wrong ones."""
    if context_shards() > 1:
        raise ValueError(
            f"{type(model).__name__}: encoder-decoder models cannot run on a mesh that splits sequences over "
            f"'context' ({context_shards()} context shards) yet; only the decoder-only families can "
            "(docs/guides/long_context.md). Use a mesh without n_context_shards, e.g. "
            "redeqx.make_mesh(n_model_shards), and redeqx.batches without seq_keys."
        )


class EncoderDecoderCache(eqx.Module):
    """The decoding state of one sequence pair: the decoder's own keys and
    values (``max_len`` slots, ``index`` the next free one), each decoder
    layer's cross-attention keys and values of the encoder output, and which
    encoder positions are real tokens. Per layer a list, or stacked for
    stacked layers."""

    self_attention: list[KVCache] | KVCache
    cross_attention: list[KVCache] | KVCache
    source_valid: Bool[Array, " src"]
    index: Int[Array, ""]


def cache_slots(cache: EncoderDecoderCache) -> int:
    """How many tokens the decoder's side of ``cache`` holds."""
    sa = cache.self_attention
    return sa[0].k.shape[0] if isinstance(sa, list) else sa.k.shape[1]


def each_layer(layers, fn):
    """``fn(layer)`` for every layer: a list, or stacked (``eqx.filter_vmap``) for stacked layers."""
    if is_stacked(layers):
        return eqx.filter_vmap(fn)(layers)
    return [fn(layer) for layer in layers]


def layer_caches(layers, *caches):
    """Several per-layer caches as `redeqx.models._layers.run_layers` takes
    them: one tuple of stacks, or a list of per-layer tuples."""
    return tuple(caches) if is_stacked(layers) else list(zip(*caches))


class EncoderDecoderLM(eqx.Module):
    """Cached decoding for an encoder-decoder family (`redeqx.models.Decoder`'s
    protocol), built on its ``encode(input_ids, attention_mask) -> source``,
    ``_decoder_layers()``, ``_cross_kv(layer, source) -> KVCache``,
    ``_self_attention_shape() -> (heads, head_dim)``,
    ``_decode(ids, cache) -> (logits, new self-attention caches)``, and the teacher-forced
    forward (``__call__``) on its ``_teacher_forced``."""

    def _dtype(self):
        return jax.tree.leaves(eqx.filter(self, eqx.is_array))[0].dtype

    def _check_positions(self, where: str, n: int) -> None:
        """A family with a learned position table checks ``n`` positions fit it."""

    def __call__(
        self,
        input_ids: Int[Array, " src"],
        decoder_input_ids: Int[Array, " tgt"],
        *,
        attention_mask: Bool[Array, " src"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "tgt vocab"]:
        """Logits for every decoder position (teacher forcing).
        ``attention_mask`` marks real encoder tokens. ``key`` is unused (no dropout)."""
        del key
        self._check_positions("__call__ (decoder_input_ids)", decoder_input_ids.shape[0])
        valid = jnp.ones(input_ids.shape, bool) if attention_mask is None else attention_mask.astype(bool)
        return self._teacher_forced(decoder_input_ids, self.encode(input_ids, valid), valid)

    def _teacher_forced(self, decoder_input_ids, source, valid) -> Float[Array, "tgt vocab"]:
        """The decoder's logits for ``decoder_input_ids`` over the encoder output ``source``
        (``valid``: its real tokens), as the family computes them."""
        raise NotImplementedError

    def init_cache(
        self, encoder_output: Float[Array, "src d_model"], attention_mask: Bool[Array, " src"], max_len: int
    ) -> EncoderDecoderCache:
        """A decoding cache: the encoder output projected to every decoder
        layer's cross-attention keys/values (once), and ``max_len`` empty
        slots for the decoder's own tokens."""
        self._check_positions("init_cache", max_len)
        layers, dtype = self._decoder_layers(), self._dtype()
        heads, head_dim = self._self_attention_shape()
        cross = each_layer(layers, lambda layer: jax.tree.map(lambda a: a.astype(dtype),
                                                              self._cross_kv(layer, encoder_output)))
        return EncoderDecoderCache(
            self_attention=empty_caches(n_layers(layers), is_stacked(layers), max_len, heads, head_dim, dtype),
            cross_attention=cross,
            source_valid=attention_mask.astype(bool),
            index=jnp.zeros((), jnp.int32),
        )

    def decode(
        self, decoder_input_ids: Int[Array, " seq"], cache: EncoderDecoderCache, *, attention_mask=None
    ) -> tuple[Float[Array, "seq vocab"], EncoderDecoderCache]:
        """Run decoder tokens after what ``cache`` holds: their logits and the
        cache with them appended. ``attention_mask`` must be ``None`` (the
        decoder side has no padding)."""
        name = type(self).__name__
        if attention_mask is not None:
            raise ValueError(
                f"{name}.decode: attention_mask is for the encoder input; pass it to init_cache (or prefill) "
                "and leave it None here."
            )
        t = decoder_input_ids.shape[0]
        check_fits(f"{name}.decode", t, cache_slots(cache))
        logits, self_attention = self._decode(decoder_input_ids, cache)
        cache = EncoderDecoderCache(self_attention, cache.cross_attention, cache.source_valid, cache.index + t)
        return logits, cache

    def prefill(
        self, input_ids: Int[Array, " src"], attention_mask: Bool[Array, " src"], max_new_tokens: int
    ) -> tuple[Float[Array, " vocab"], EncoderDecoderCache]:
        """Encode the prompt once and decode the start token: the first new
        token's logits and a cache with room for ``max_new_tokens`` more (what
        `redeqx.models.generate` and `beam_search` start from)."""
        source = self.encode(input_ids, attention_mask)
        cache = self.init_cache(source, attention_mask, max_new_tokens + 1)
        start = jnp.full((1,), self.config.decoder_start_token_id, jnp.int32)
        logits, cache = self.decode(start, cache)
        return logits[-1], cache
