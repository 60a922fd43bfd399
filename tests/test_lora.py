"""LoRA on the zoo: adapters get gradients (the zoo's fused fast path used to
bypass them), train sharded as on one device, and merge back for Hugging Face."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import redeqx
from redeqx import models

# listed layers, to index a layer (tests/test_models_stacked.py trains LoRA on stacked ones)
LLAMA = models.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, scan_layers=False)
GPT2 = models.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4, scan_layers=False)


def lm_loss(model, batch, key):
    tokens = batch["tokens"]
    logits = jax.vmap(model)(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


@eqx.filter_jit
def logits_of(model, tokens):
    return jax.vmap(model)(tokens)


def token_batch(step, n=8, t=12):
    rng = np.random.default_rng(step)
    starts = rng.integers(0, 64, n)
    return {"tokens": ((starts[:, None] + np.arange(t + 1)) % 64).astype(np.int32)}


def train_lora(model, n_model_shards, devices, n_steps=3):
    mesh = redeqx.make_mesh(n_model_shards, devices=devices)
    trainable = models.lora_trainable(model)
    specs = redeqx.sharding_rules(model, mesh)
    optimizer = optax.adam(1e-2)
    state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1), trainable=trainable)
    step = redeqx.make_train_step(lm_loss, optimizer, mesh, specs, trainable=trainable)
    losses, norms = [], []
    for i in range(n_steps):
        state, metrics = step(state, token_batch(i))
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
    return state, np.asarray(losses), norms


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_lora_trains_adapters_only_and_matches_one_device(family, devices):
    if family == "llama":
        base = models.LlamaForCausalLM(LLAMA, key=jax.random.key(0))
        model = models.lora(base, r"self_attn\.(q_proj|v_proj|o_proj)$", rank=4, alpha=8, key=jax.random.key(2))
        adapted = model.model.layers[0].self_attn
        col, row = "q_proj", "o_proj"
    else:
        base = models.GPT2LMHeadModel(GPT2, key=jax.random.key(0))
        model = models.lora(base, r"attn\.(q_proj|v_proj|c_proj)$", rank=4, alpha=8, key=jax.random.key(2))
        adapted = model.transformer.h[0].attn
        col, row = "q_proj", "c_proj"
    assert isinstance(getattr(adapted, col), models.LoRALinear)
    tokens = token_batch(0)["tokens"][:, :-1]
    np.testing.assert_allclose(logits_of(model, tokens), logits_of(base, tokens), atol=1e-6)  # B = 0 at first

    mesh = redeqx.make_mesh(2)
    specs = redeqx.sharding_rules(model, mesh)
    layer = lambda tree: getattr((tree.model.layers[0].self_attn if family == "llama" else tree.transformer.h[0].attn), col)  # noqa: E731
    out = lambda tree: getattr((tree.model.layers[0].self_attn if family == "llama" else tree.transformer.h[0].attn), row)  # noqa: E731
    assert layer(specs).lora_b == P("model", None) and layer(specs).lora_a == P()
    assert out(specs).lora_a == P(None, "model") and out(specs).lora_b == P()

    trainable = models.lora_trainable(model)
    n_trainable = sum(x.size for x in jax.tree.leaves(eqx.filter(model, trainable)))
    assert 0 < n_trainable < sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))) // 10

    ref, ref_losses, ref_norms = train_lora(model, 1, devices[:1])
    state, losses, _ = train_lora(model, 2, devices)
    assert ref_norms[0] > 0  # the adapters get a gradient: the zoo calls them
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    assert not np.allclose(layer(state.model).lora_b, 0.0)  # adapters moved...
    np.testing.assert_array_equal(layer(state.model).weight, layer(model).weight)  # ...the base did not
    for a, b in zip(jax.tree.leaves(eqx.filter(state.model, eqx.is_array)), jax.tree.leaves(eqx.filter(ref.model, eqx.is_array))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)

    merged = models.merge_lora(state.model)
    assert not any(isinstance(x, models.LoRALinear) for x in jax.tree.leaves(merged, is_leaf=lambda x: isinstance(x, models.LoRALinear)))
    assert jax.tree.structure(merged) == jax.tree.structure(base)
    np.testing.assert_allclose(logits_of(merged, tokens), logits_of(state.model, tokens), rtol=1e-4, atol=1e-5)


def test_merged_lora_saves_for_transformers(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    base = models.LlamaForCausalLM(LLAMA, key=jax.random.key(0))
    model = models.lora(base, r"(q_proj|down_proj)$", rank=2, alpha=4, key=jax.random.key(1))
    # move the adapters off zero so the merge matters
    model = jax.tree.map(lambda x: x, model)
    model = eqx.tree_at(lambda m: m.model.layers[0].self_attn.q_proj.lora_b, model,
                        0.1 * jnp.ones_like(model.model.layers[0].self_attn.q_proj.lora_b))
    with pytest.raises(ValueError, match="merge_lora"):
        models.save_pretrained(model, tmp_path / "unmerged")
    models.save_pretrained(models.merge_lora(model), tmp_path / "merged")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    tokens = token_batch(0)["tokens"][:2, :-1]
    with torch.no_grad():
        want = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(jax.vmap(model)(tokens), want, rtol=1e-4, atol=1e-4)


def test_lora_pattern_that_matches_nothing_lists_layers():
    base = models.LlamaForCausalLM(LLAMA, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"matches no linear layer.*q_proj"):
        models.lora(base, r"attention\.query$", rank=2, alpha=4, key=jax.random.key(1))
