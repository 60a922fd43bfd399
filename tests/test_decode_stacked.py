"""Decoding a stacked model (the default layout) against the same weights
listed: the same tokens, and a compiled decoding loop that copies neither a
layer's weights out of the stack nor the KV cache on each token (read from
the compiled program), a prompt's pass that is one layer's program whatever
the depth, with the cache in the compute dtype."""

import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from redeqx import models
from redeqx.planner._hlo import repeated_copies
from redeqx.steps._loss import cast_floats

V, NEW = 96, 12
LLAMA = models.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2)
MIXTRAL = models.MixtralConfig(vocab_size=V, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                               num_experts_per_tok=2)
BART = models.BartConfig(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                         decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48,
                         max_position_embeddings=32)
FAMILIES = {"llama": (models.LlamaForCausalLM, LLAMA), "mixtral": (models.MixtralForCausalLM, MIXTRAL),
            "bart": (models.BartForConditionalGeneration, BART)}


def build(family, stacked):
    cls, config = FAMILIES[family]
    return cls(dataclasses.replace(config, scan_layers=stacked), key=jax.random.key(0))


def prompts(n=2, t=5):
    return jnp.asarray(np.random.default_rng(0).integers(2, V, (n, t)), jnp.int32)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_stacked_decoding_gives_the_listed_tokens(family):
    stacked, listed = build(family, True), build(family, False)
    x = prompts()
    np.testing.assert_array_equal(models.generate(stacked, x, max_new_tokens=6),
                                  models.generate(listed, x, max_new_tokens=6))
    if family == "llama":
        np.testing.assert_array_equal(models.beam_search(stacked, x, max_new_tokens=4, num_beams=3),
                                      models.beam_search(listed, x, max_new_tokens=4, num_beams=3))


def _stacks(model, batch):
    """The shapes a per-token copy would be made from: each stacked weight, and the stacked KV cache (batched)."""
    layers = jax.tree.leaves(model.model.layers)
    cache = jax.eval_shape(lambda m: m.init_cache(5 + NEW), model).layers.k.shape
    return [a.shape for a in layers if a.ndim >= 3] + [(batch, *cache)]


@pytest.mark.slow
def test_the_stacked_decoding_loop_copies_no_weights_and_no_cache():
    model, x = build("llama", True), prompts(n=1)
    text = jax.jit(lambda m, i: models.generate(m, i, max_new_tokens=NEW)).lower(model, x).compile().as_text()
    assert repeated_copies(text, _stacks(model, 1), NEW - 1) == []
    beams = jax.jit(lambda m, i: models.beam_search(m, i, max_new_tokens=NEW, num_beams=2))
    weights = _stacks(model, 1)[:-1]  # beam search reorders its cache each token: only weights here
    assert repeated_copies(beams.lower(model, x).compile().as_text(), weights, NEW - 1) == []


@pytest.mark.parametrize("family", ["llama", "bart"])
def test_a_stacked_prompt_runs_as_one_layers_program(family):
    """The prompt's pass (more than one token) scans the stack: its program holds one layer's
    products whatever the depth, where one token at a time runs layer by layer."""
    def products(layers, tokens):
        cls, config = FAMILIES[family]
        depth = {"decoder_layers": layers} if family == "bart" else {"num_hidden_layers": layers}
        model = cls(dataclasses.replace(config, scan_layers=True, **depth), key=jax.random.key(0))
        x = prompts(n=1, t=tokens)[0]
        cache = jax.eval_shape(lambda m: m.prefill(x, jnp.ones(x.shape, bool), 4)[1] if family == "bart"
                               else m.init_cache(tokens + 4), model)  # BART's holds the encoder's keys and values
        return jax.jit(lambda m, c: m.decode(x, c)).lower(model, cache).as_text().count("dot_general")

    assert products(2, 5) == products(4, 5)  # the prompt: a scan
    assert products(4, 1) > products(2, 1)   # one token: layer by layer


def test_repeated_copies_finds_a_stack_sliced_inside_a_loop():
    """What the check reads: layers scanned inside a loop over tokens slice the stack at a loop index."""
    w = jnp.ones((3, 16, 8))

    def tokens(w, x):
        def layer(x, wi):  # wi: (16, 8), x: (8,)
            return jnp.tanh(wi.T @ (wi @ x)), None

        return jax.lax.scan(lambda x, _: (jax.lax.scan(layer, x, w)[0], None), x, None, length=NEW)[0]

    text = jax.jit(tokens).lower(w, jnp.ones(8)).compile().as_text()
    assert ("dynamic-slice", "f32[3,16,8]") in {(op, s) for op, s, _ in repeated_copies(text, [w.shape], NEW - 1)}


@pytest.mark.parametrize("family", ["llama", "bart"])
def test_the_cache_holds_the_compute_dtype(family):
    model = cast_floats(build(family, True), jnp.bfloat16)
    x = prompts(n=1)[0]
    cache = jax.eval_shape(lambda m: m.prefill(x, jnp.ones(x.shape, bool), 4)[1], model)
    kv = [c for c in jax.tree.leaves(cache) if c.ndim >= 3]
    assert kv and {c.dtype for c in kv} == {jnp.dtype(jnp.bfloat16)}


@pytest.mark.parametrize("family", ["llama", pytest.param("mixtral", marks=pytest.mark.slow),
                                    pytest.param("bart", marks=pytest.mark.slow)])
def test_a_gpu_token_loop_reads_each_layers_slices_and_gives_the_same_tokens(family, monkeypatch, request):
    """Traced for a GPU, generate and beam_search slice each stack's layers once, before the token
    loop (XLA:GPU copied stacked slices every token: 1.9-2.9 GiB for the 1B LLaMA,
    `benchmarks.gpu_compile`); the stack stays a stack and `decode_stack` reads layer i from its
    slices: the listed model's tokens. Elsewhere the model is left as it is."""
    from redeqx.models import _layers

    stacked, listed = build(family, True), build(family, False)
    assert _layers.sliced_for_decoding(stacked) is stacked  # this machine's CPU: nothing changes
    monkeypatch.setattr(_layers, "traced_platform", lambda: "gpu")
    jax.clear_caches()  # generate's programs traced for this machine's CPU by earlier tests: trace again
    request.addfinalizer(jax.clear_caches)  # and none traced "for a GPU" is left to later tests
    stack = lambda m: m.model.decoder.layers if family == "bart" else m.model.layers  # noqa: E731
    seen = stack(_layers.sliced_for_decoding(stacked))
    n = _layers.stack_depth(stack(stacked))
    assert _layers.n_layers(seen) == n
    for i in range(n):
        want, got = stack(stacked)[i], _layers.layer_at(seen, i)
        assert jax.tree.structure(got) == jax.tree.structure(want)
        assert all(bool((a == b).all()) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    x = prompts()
    np.testing.assert_array_equal(models.generate(stacked, x, max_new_tokens=5),
                                  models.generate(listed, x, max_new_tokens=5))
    stacked_shapes = {a.shape for a in jax.tree.leaves(stack(stacked)) if a.ndim >= 2}
    loop = _token_loop(jax.make_jaxpr(lambda m: models.generate(m, x, max_new_tokens=5))(stacked).jaxpr, 5)
    assert not stacked_shapes & {v.aval.shape for v in loop.invars}, "the token loop still takes the stack"
    if family == "llama":
        np.testing.assert_array_equal(models.beam_search(stacked, x, max_new_tokens=3, num_beams=3),
                                      models.beam_search(listed, x, max_new_tokens=3, num_beams=3))


def _token_loop(jaxpr, length):
    """The ``lax.scan`` of ``length`` steps in a jaxpr, nested calls included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan" and eqn.params["length"] == length:
            return eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            if (found := _token_loop(sub, length)) is not None:
                return found
    return None


@pytest.mark.parametrize("family", ["llama", "bart"])
def test_the_token_loop_holds_each_layers_cache_as_a_buffer_of_its_own(family):
    """A stacked KV cache is one buffer whose layer axis XLA lays out inside the batch and heads: a
    layer's keys are not one block, so XLA:GPU copied each layer's K and V out of the stack every
    token (1,409 MiB a token at 8 x 4,096 slots for the 1B LLaMA) and libtpu the whole stack
    (30,979 MiB), against none listed (`benchmarks.gpu_compile`'s long_decode, `benchmarks.decode_compile`).
    After the prompt, generate and beam_search split it once: the loop takes each layer's K and V."""
    from redeqx.models._generate import _prefill

    model, x = build(family, True), prompts()
    _, cache = jax.eval_shape(lambda m: _prefill(m, x, jnp.ones(x.shape, bool), 5), model)
    stacks = [a.shape for a in jax.tree.leaves(cache) if a.ndim == 5]  # (batch, layers, slots, heads, head_dim)
    assert stacks
    for run in (lambda m: models.generate(m, x, max_new_tokens=5),
                lambda m: models.beam_search(m, x, max_new_tokens=5, num_beams=2)):
        taken = [v.aval.shape for v in _token_loop(jax.make_jaxpr(run)(model).jaxpr, 5).invars]
        assert not set(stacks) & set(taken), "the token loop still takes a stacked cache"
        for b, n, *per_layer in stacks:
            assert sum(shape[1:] == tuple(per_layer) for shape in taken) >= n  # each layer's own


def test_a_cache_split_by_layer_takes_one_token_at_a_time():
    """A split cache exists only inside generate's token loop; a prompt (several tokens) scans the
    stack, which cannot scan per-layer buffers: a clear error, not a wrong scan."""
    from redeqx.models._layers import caches_by_layer

    model, x = build("llama", True), prompts(n=1)[0]
    cache = caches_by_layer(model.prefill(x, jnp.ones(x.shape, bool), 4)[1])
    logits, _ = model.decode(x[:1], cache)  # one token: layer by layer
    assert logits.shape == (1, V)
    with pytest.raises(ValueError, match="one token at a time; got 2 tokens"):
        model.decode(x[:2], cache)


def test_attention_scores_come_out_of_their_product_with_the_keys_last():
    """The scores' product, in the zoo's attention and in `redeqx.attention`'s blockwise path, is a
    ``dot_general`` whose own output ends with the keys: XLA:GPU then keeps them minor and runs the
    masked softmax as one kernel. Written ``jnp.einsum("tkgd,skd->kgts")``, the product came out
    with the keys before the query heads, and the softmax ran as four kernels over the whole scores
    (a decoding token of the 1B over 8 sequences of 4,096 slots: 3,412 MiB against 3,059,
    `benchmarks.gpu_compile`, RESULTS.md). The zoo's attention keeps that layout, so its gradient
    transposes no scores either (their swap cost a 1,024-token batch a quarter more bytes). A CPU
    runs every layout alike, so it is read off the program."""
    from redeqx.context._blockwise import Span, block_scores
    from redeqx.models._layers import attention

    q, k = jnp.zeros((3, 8, 16), jnp.bfloat16), jnp.zeros((40, 2, 16), jnp.bfloat16)
    zoo = lambda q, k: attention(q, k, k, jnp.ones((3, 40), bool), scale=0.25).astype(jnp.float32).sum()  # noqa: E731
    programs = {"zoo": jax.make_jaxpr(zoo)(q, k),
                "blockwise": jax.make_jaxpr(lambda q, k: block_scores(
                    q, k, jnp.arange(3), jnp.arange(40), jnp.zeros(3, jnp.int32), jnp.zeros(40, jnp.int32),
                    Span(causal=True), 0.25))(q, k)}
    for name, program in programs.items():
        scores = next(e for e in program.eqns if e.primitive.name == "dot_general")
        assert scores.outvars[0].aval.shape[-1] == k.shape[0], (name, scores.outvars[0].aval.shape)
    gradient = jax.make_jaxpr(jax.grad(zoo, argnums=(0, 1)))(q, k)
    moved = [e.invars[0].aval.shape for e in gradient.eqns if e.primitive.name == "transpose"]
    assert not [shape for shape in moved if len(shape) == 4 and shape[-1] == k.shape[0]], moved
