"""The zoo's decoder families split over a 'context' axis train as on one device: their
options with code of their own (each family's tiny config splits in test_family_contract.py,
LLaMA's training in test_context.py)."""

import equinox as eqx
import jax
import numpy as np
import pytest

import redeqx
from families import FAMILIES
from redeqx import models
from redeqx.planner._hlo import estimated_flops
from test_context import SEQ_KEYS, _collate, _examples, _like_one_device, _mesh, _token_mean, llama_loss

V, H = 64, 32  # vocabulary and width of every tiny model here; _examples' ids are below V

# a step over a split sequence warns when it reads places as positions (_context_checks): never for the zoo
pytestmark = pytest.mark.filterwarnings("error:redeqx. the step")


def _llama(**kw):
    return models.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **kw)


def _moe_common(**kw):
    return dict(vocab_size=V, hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, **kw)


# Options with code of their own: OPT's post-LN variant with projected embeddings, LLaMA's biases,
# tied head and listed layers, Qwen2's q/k/v biases, and a mixture of experts with a dense layer among
# the sparse ones; the families' own tiny configs are tests/families.py's.
CASES = {
    "gpt2": FAMILIES["gpt2"].build,
    "opt_350m_like": lambda: models.OPTForCausalLM(
        models.OPTConfig(vocab_size=V, hidden_size=H, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
                         max_position_embeddings=32, do_layer_norm_before=False, word_embed_proj_dim=16,
                         tie_word_embeddings=False, scan_layers=False), key=jax.random.key(0)),
    "llama_biases_tied_listed": lambda: models.LlamaForCausalLM(
        _llama(attention_bias=True, mlp_bias=True, tie_word_embeddings=True, scan_layers=False),
        key=jax.random.key(0)),
    "qwen2": lambda: models.LlamaForCausalLM(_llama(qkv_bias=True, model_type="qwen2"), key=jax.random.key(0)),
    "qwen3_moe_mixed": lambda: models.Qwen3MoeForCausalLM(
        models.Qwen3MoeConfig(**_moe_common(), intermediate_size=40, moe_intermediate_size=24, head_dim=8,
                              num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=(1,),
                              scan_layers=False),
        key=jax.random.key(0)),
}
MOE = ("mixtral", "qwen3_moe_mixed")


def moe_loss(model, batch, key):
    """Cross-entropy plus the routers' load-balancing loss, as a mixture-of-experts model trains."""
    logits, stats = jax.vmap(lambda i, m: model.with_aux(i, attention_mask=m))(batch["input_ids"],
                                                                               batch["attention_mask"])
    return _token_mean(logits, batch) + 0.1 * stats.load_balancing_loss()


# one of each code path (learned positions, OPT's offset table and post-LN, MoE with_aux
# and dense layers mixed); every family's gradient is compared with one device's below, on four context shards
TRAINED = ["gpt2", "opt_350m_like", "qwen3_moe_mixed"]


@pytest.mark.parametrize("family", TRAINED)
def test_family_trains_like_one_device_split_over_context(devices, family):
    """Three AdamW steps on a (data, context, model) = (2, 2, 2) mesh, the batch padded on both sides."""
    _like_one_device(CASES[family], moe_loss if family in MOE else llama_loss, (2, 2, 2))


def gradient_and_flops(make, loss_fn, mesh, seq_keys):
    """The loss's gradient on ``mesh`` (padded batch), and the matrix-product FLOPs per device of its
    compiled program. The elementwise ops are left out of the count: the split attention's block
    bookkeeping adds some, which at these tiny sizes is not small."""
    model = make()
    params, static = eqx.partition(redeqx.shard(model, redeqx.sharding_rules(model, mesh), mesh), eqx.is_array)
    batch = next(redeqx.batches(_examples(t=32), _collate, 4 // mesh.shape["data"], mesh, seq_keys=seq_keys))
    grad = jax.jit(jax.grad(lambda p, b: loss_fn(eqx.combine(p, static), b, None)))
    with jax.set_mesh(mesh):
        compiled = grad.lower(params, batch).compile()
        return compiled(params, batch), estimated_flops(compiled.as_text(), ops=("dot",))


_ONE_DEVICE = {}  # reference name -> one device's gradient and FLOPs


def assert_split_like_one_device(make, loss_fn, mesh, reference=None):
    """The gradient on ``mesh``, the sequence split over its 'context' axis, is one device's;
    returns the matrix-product FLOPs per device of both: ``(split, one)``. One device's is
    computed once per ``reference`` name (given where cases differ only in what a split changes)."""
    if reference not in _ONE_DEVICE:
        _ONE_DEVICE[reference] = gradient_and_flops(make, loss_fn, redeqx.make_mesh(1, devices=jax.devices()[:1]), None)
    want, one = _ONE_DEVICE[reference]
    if reference is None:
        del _ONE_DEVICE[None]
    got, split = gradient_and_flops(make, loss_fn, mesh, SEQ_KEYS)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    return split, one


@pytest.mark.parametrize("family", [name for name in CASES if name != "gpt2"])
def test_option_splits_like_one_device(devices, family):
    """On (data, context, model) = (1, 4, 1), the gradient is one device's (the work per device: the contract)."""
    assert_split_like_one_device(CASES[family], moe_loss if family in MOE else llama_loss, _mesh(1, 4, 1))

WINDOWED = {  # a sliding window of 5 tokens over chunks of 4 (8 tokens to a shard): the shards' pair tables differ
    "mistral_ring": lambda: models.LlamaForCausalLM(
        _llama(model_type="mistral", use_sliding_window=True, sliding_window=5, context_attention="ring"),
        key=jax.random.key(0)),
    "mistral_gather": lambda: models.LlamaForCausalLM(
        _llama(model_type="mistral", use_sliding_window=True, sliding_window=5), key=jax.random.key(0)),
    "mixtral": lambda: models.MixtralForCausalLM(
        models.MixtralConfig(**_moe_common(), intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                             sliding_window=5), key=jax.random.key(0)),
}


@pytest.mark.parametrize("family", list(WINDOWED))
def test_sliding_window_splits_like_one_device(devices, family):
    """The gradient of a sliding-window model on (data, context, model) = (1, 4, 2), padded on both
    sides, is one device's."""
    # Mistral's ring and gather differ only in how a context axis splits attention, which one device has not
    # (there redeqx.attention runs the same plain attention): one reference for both
    assert_split_like_one_device(WINDOWED[family], moe_loss if family in MOE else llama_loss, _mesh(1, 4, 2),
                                 reference="mistral" if family.startswith("mistral") else None)


def seq2seq_loss(model, batch, key):
    logits = jax.vmap(lambda i, m, d: model(i, d, attention_mask=m))(
        batch["input_ids"], batch["attention_mask"], batch["labels"])
    return _token_mean(logits, batch)


def test_every_decoder_config_takes_the_ring(devices):
    """``context_attention`` on every decoder-only config: checked, and the ring is what runs."""
    configs = [type(family.config) for family in FAMILIES.values() if family.kind != "seq2seq"]
    for config in configs:
        with pytest.raises(ValueError, match=rf"{config.__name__}.context_attention='rings': choose one of"):
            config(context_attention="rings")
    model = models.GPT2LMHeadModel(
        models.GPT2Config(vocab_size=V, n_positions=32, n_embd=H, n_layer=1, n_head=4, context_attention="ring"),
        key=jax.random.key(0))
    mesh = _mesh(1, 4, 1)
    params, static = eqx.partition(redeqx.shard(model, redeqx.sharding_rules(model, mesh), mesh), eqx.is_array)
    batch = next(redeqx.batches(_examples(), _collate, 4, mesh, seq_keys=SEQ_KEYS))
    grad = jax.jit(jax.grad(lambda p, b: llama_loss(eqx.combine(p, static), b, None)))
    with jax.set_mesh(mesh):
        text = redeqx.collective_summary(grad.lower(params, batch).compile().as_text())
    assert "collective-permute" in text, text
