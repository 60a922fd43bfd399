"""Every family of the zoo with its layers stacked (``scan_layers=True``, a
``lax.scan`` over one layer's arrays with a leading layer axis) against the
same weights listed: the same logits and cached generation, the Megatron
plan with None on the layer axis, Hugging Face checkpoints in and out of
either layout, LoRA, init_model and a train step."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import redeqx
from redeqx import models
from redeqx._trees import is_spec, named_leaves

V = 96
CONFIGS = {
    "llama": (models.LlamaForCausalLM, models.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48,
                                                          num_hidden_layers=3, num_attention_heads=4,
                                                          num_key_value_heads=2)),
    "gpt2": (models.GPT2LMHeadModel, models.GPT2Config(vocab_size=V, n_positions=32, n_embd=32, n_layer=3, n_head=4)),
    "opt": (models.OPTForCausalLM, models.OPTConfig(vocab_size=V, hidden_size=32, num_hidden_layers=3, ffn_dim=48,
                                                    num_attention_heads=4, max_position_embeddings=32)),
    "gptj": (models.GPTJForCausalLM, models.GPTJConfig(vocab_size=V, n_positions=32, n_embd=32, n_layer=3, n_head=4,
                                                       rotary_dim=4)),
    "t5": (models.T5ForConditionalGeneration, models.T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=48, num_layers=3,
                                                              num_heads=4, feed_forward_proj="gated-gelu",
                                                              tie_word_embeddings=False)),
    "bart": (models.BartForConditionalGeneration, models.BartConfig(
        vocab_size=V, d_model=32, encoder_layers=3, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, max_position_embeddings=32)),
}
ENC_DEC = ("t5", "bart")


def build(family, stacked, key=0):
    cls, config = CONFIGS[family]
    return cls(dataclasses.replace(config, scan_layers=stacked), key=jax.random.key(key))


def ids(seed=0, n=4, t=9):
    return jnp.asarray(np.random.default_rng(seed).integers(2, V, (n, t)), jnp.int32)


def forward(model, family, x):
    if family in ENC_DEC:
        return jax.vmap(lambda a, b: model(a, b))(x, x[:, :6])
    return jax.vmap(model)(x)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_a_stacked_family_is_the_listed_one(family, tmp_path):
    listed, stacked = build(family, False), build(family, True)
    x = ids()
    np.testing.assert_allclose(forward(stacked, family, x), forward(listed, family, x), atol=2e-5, rtol=0)

    # the Megatron plan, each stacked leaf as its listed layer's with None on the layer axis
    mesh = redeqx.make_mesh(2)
    l_specs = dict(zip([p for p, _ in named_leaves(listed, is_leaf=lambda v: v is None)],
                       jax.tree.leaves(redeqx.sharding_rules(listed, mesh), is_leaf=is_spec)))
    s_specs = dict(zip([p for p, _ in named_leaves(stacked, is_leaf=lambda v: v is None)],
                       jax.tree.leaves(redeqx.sharding_rules(stacked, mesh), is_leaf=is_spec)))
    stacks = type(stacked).hf_stacks
    for path, spec in s_specs.items():
        stack = next((s for s in stacks if path.startswith(s + ".")), None)
        if spec is None or stack is None:
            continue
        layer = l_specs.get(f"{stack}.1.{path[len(stack) + 1:]}")
        if layer is None:  # T5's bias table sits on the stack when stacked
            continue
        assert spec == (P(None, *layer) if len(layer) else P()), (path, spec, layer)

    # Hugging Face names from either layout, loaded into either layout
    models.save_pretrained(stacked, tmp_path / "from_stacked")
    again = models.from_pretrained(tmp_path / "from_stacked", mesh, scan_layers=False)
    for (path, a), (_, b) in zip(named_leaves(eqx.filter(again, eqx.is_array)),
                                 named_leaves(eqx.filter(listed, eqx.is_array))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=path)
    loaded = models.from_pretrained(tmp_path / "from_stacked", mesh, scan_layers=True)
    assert loaded.config.scan_layers
    for (path, a), (_, b) in zip(named_leaves(eqx.filter(loaded, eqx.is_array)),
                                 named_leaves(eqx.filter(stacked, eqx.is_array))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=path)
        assert a.sharding.spec == (s_specs[path] or P()), path

    # cached generation, sharded with the model
    step = redeqx.make_predict_step(lambda m, b, k: models.generate(m, b["ids"], max_new_tokens=4), mesh,
                                    redeqx.sharding_rules(loaded, mesh))
    batch = {"ids": ids(1, n=8, t=5)}
    np.testing.assert_array_equal(step(loaded, batch, jax.random.key(0)),
                                  models.generate(listed, batch["ids"], max_new_tokens=4))
    if family == "llama":
        np.testing.assert_array_equal(models.beam_search(stacked, batch["ids"], max_new_tokens=3, num_beams=2),
                                      models.beam_search(listed, batch["ids"], max_new_tokens=3, num_beams=2))


def lm_loss(model, batch, key):
    x = batch["ids"]
    logits = jax.vmap(model)(x[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, x[:, 1:]).mean()


def test_stacked_llama_trains_with_lora_init_model_and_checkpoints(tmp_path):
    mesh = redeqx.make_mesh(2)
    cls, config = CONFIGS["llama"]
    stacked_config = dataclasses.replace(config, scan_layers=True)
    model = redeqx.init_model(lambda k: cls(stacked_config, key=k), mesh, key=jax.random.key(0))
    for (path, a), (_, b) in zip(named_leaves(eqx.filter(model, eqx.is_array)),
                                 named_leaves(eqx.filter(build("llama", True), eqx.is_array))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-8, err_msg=path)

    adapted = models.lora(model, r"self_attn\.(q_proj|v_proj)$", rank=2, alpha=4, key=jax.random.key(1))
    assert adapted.model.layers.self_attn.q_proj.lora_a.shape == (3, 2, 32)
    trainable = models.lora_trainable(adapted)
    specs = redeqx.sharding_rules(adapted, mesh)
    assert specs.model.layers.self_attn.q_proj.lora_b == P(None, "model", None)
    optimizer = optax.adam(1e-2)
    state = redeqx.init_state(adapted, optimizer, mesh, specs, key=jax.random.key(2), trainable=trainable)
    step = redeqx.make_train_step(lm_loss, optimizer, mesh, specs, trainable=trainable)
    for i in range(2):
        state, metrics = step(state, {"ids": ids(i, n=8)})
    assert np.isfinite(float(metrics["loss"]))

    merged = models.merge_lora(state.model)
    assert type(merged.model.layers.self_attn.q_proj) is models._layers.Linear
    models.save_pretrained(merged, tmp_path / "merged")

    redeqx.save_checkpoint(tmp_path / "ckpt", state)
    restored = redeqx.restore_checkpoint(tmp_path / "ckpt", eqx.filter_eval_shape(lambda: state), mesh, specs)
    for a, b in zip(jax.tree.leaves(restored.model), jax.tree.leaves(state.model)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
