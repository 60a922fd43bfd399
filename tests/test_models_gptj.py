"""GPT-J against Transformers' PyTorch reference (a tiny random config built
and saved here: no download), and GPT-J-6B's shapes built abstractly."""

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from megatron_count import step_at_4_shards_vs_one_device, gradient_bytes, near_megatron

import redeqx
from redeqx.models import GPTJConfig, GPTJForCausalLM, from_pretrained, save_pretrained
from redeqx.models._pretrained import _skeleton
from _helpers import hf_checkpoints, hf_shapes, next_token_loss, nudged, one_device, random_ids
from _helpers import logits_match_transformers, torch_logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 100
# head_dim 8, of which the rotary embedding turns the first 4: both parts are exercised
SIZES = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64, bos_token_id=1,
             eos_token_id=2)


def _hf_model(kind):
    torch.manual_seed(0)
    return nudged(transformers.GPTJForCausalLM(transformers.GPTJConfig(**SIZES)).eval(), norms=(".ln_",),  # logits ~1
                  scale=lambda name, p: 10 if ("wte" in name or "lm_head" in name or "q_proj" in name) else 1)


@pytest.fixture(scope="module")
def gptj(tmp_path_factory):
    return hf_checkpoints(tmp_path_factory, _hf_model, ["gptj"])["gptj"]


_ids = partial(random_ids, VOCAB, low=3)


def test_logits_match_transformers_at_1_2_4_model_shards(gptj):
    d, hf = gptj
    ids = _ids(batch=8)
    assert np.abs(logits_match_transformers(d, hf, ids)).max() > 1


def test_rotary_turns_only_the_first_rotary_dim_features_in_pairs():
    from redeqx.models._gptj import rotary_every_two

    x = np.random.RandomState(0).randn(3, 2, 8).astype(np.float32)
    out = np.asarray(jax.jit(rotary_every_two, static_argnums=2)(x, jnp.arange(3), 4))
    np.testing.assert_array_equal(out[..., 4:], x[..., 4:])  # passes through
    np.testing.assert_array_equal(out[0], x[0])  # position 0: no turn
    # position 2, pair (2, 3) turns by 2 * 10000 ** (-2 / 4) radians
    a = 2 * 10000 ** -0.5
    np.testing.assert_allclose(out[2, :, 2], x[2, :, 2] * np.cos(a) - x[2, :, 3] * np.sin(a), atol=1e-6)
    np.testing.assert_allclose(out[2, :, 3], x[2, :, 3] * np.cos(a) + x[2, :, 2] * np.sin(a), atol=1e-6)


def test_save_pretrained_round_trip(gptj, tmp_path):
    d, hf = gptj
    save_pretrained(from_pretrained(d, redeqx.make_mesh(2)), tmp_path)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(again) is transformers.GPTJForCausalLM
    ids = _ids(seed=1)
    np.testing.assert_allclose(torch_logits(again, ids), torch_logits(hf, ids), atol=1e-5, rtol=0)


def megatron_parallel_block_bytes(hidden: int, n_layers: int, local_batch: int, seq: int, grad_bytes: int) -> int:
    """Per-device collective bytes of one training step of Megatron-LM's plan
    for GPT-J's parallel block (as GPT-NeoX runs it): the block's attention
    and MLP outputs are added before their one all-reduce, and the input
    gradients of Q/K/V and fc_in before theirs, so 1 activation all-reduce per
    layer forward and 1 backward, where `megatron_bytes` counts 2 and 2; plus
    the vocab-split embedding (forward) and LM head (backward), the three
    cross-entropy reductions and the data-parallel gradient all-reduce."""
    act = local_batch * seq * hidden * 4
    return (1 + n_layers) * act + (n_layers + 1) * act + 3 * local_batch * seq * 4 + grad_bytes


@pytest.mark.slow
def test_train_step_communication_is_megatron_and_matches_one_device(gptj):
    d, _ = gptj
    model = from_pretrained(d, one_device())
    optimizer = optax.sgd(0.1)
    ids = _ids(batch=8, seq=17)

    # the fused column- and row-parallel matmuls train exactly like one device
    mesh, state4, summary = step_at_4_shards_vs_one_device(model, optimizer, next_token_loss, {"ids": ids})
    grad_bytes = gradient_bytes(state4.model)
    c = model.config
    analytic = megatron_parallel_block_bytes(c.n_embd, c.n_layer, 8 // mesh.shape["data"], 16, grad_bytes)
    near_megatron(summary, analytic, "GPT-J")


def test_gptj_6b_shapes_equal_transformers():
    hf_config = transformers.GPTJConfig()  # GPT-J-6B's sizes
    with torch.device("meta"):  # shapes only, nothing allocated
        hf = transformers.AutoModelForCausalLM.from_config(hf_config)
    config = dataclasses.replace(GPTJConfig.from_hf(hf_config.to_dict()), scan_layers=False)  # per-layer names
    model = _skeleton(GPTJForCausalLM, config, None)  # eqx.filter_eval_shape
    assert hf_shapes(model) == {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    assert sum(p.numel() for p in hf.parameters()) == sum(x.size for x in jax.tree.leaves(model)) == 6_050_882_784


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="rotary_dim"):
        GPTJConfig(n_embd=32, n_head=4, rotary_dim=12)
    with pytest.raises(ValueError, match="n_head=5"):
        GPTJConfig(n_embd=32, n_head=5)
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        GPTJConfig.from_hf({**SIZES, "tie_word_embeddings": True})
