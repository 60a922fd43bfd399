"""GPT-2 against Transformers' PyTorch reference (tiny random config built and
saved here: no download)."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from accelerator_count import accelerator_collectives
from megatron_count import megatron_bytes, gradient_bytes, near_megatron

import redeqx
from _helpers import hf_checkpoints, next_token_loss, nudged, one_device, random_ids
from _helpers import logits_match_transformers, sharded_state, torch_logits
from redeqx.models import GPT2Config, GPT2LMHeadModel, from_pretrained, save_pretrained

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 64


def _hf_model(kind):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                     bos_token_id=1, eos_token_id=2)
    return nudged(transformers.GPT2LMHeadModel(config).eval(), norms=(".ln_",))


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    return hf_checkpoints(tmp_path_factory, _hf_model, ["gpt2"])["gpt2"]


_ids = partial(random_ids, VOCAB, low=3)


def test_logits_match_transformers_at_1_2_4_model_shards(gpt2):
    d, hf = gpt2
    ids = _ids(batch=8)
    logits_match_transformers(d, hf, ids)


def test_c_attn_is_split_into_oriented_q_k_v(gpt2):
    d, hf = gpt2
    model = from_pretrained(d, one_device(), scan_layers=False)
    c_attn = hf.transformer.h[0].attn.c_attn.weight.detach().numpy()  # (in, 3 * out)
    attn = model.transformer.h[0].attn
    np.testing.assert_array_equal(attn.k_proj.weight, c_attn[:, 32:64].T)
    assert attn.q_proj.weight.shape == (32, 32)


def test_save_pretrained_round_trip(gpt2, tmp_path):
    d, hf = gpt2
    save_pretrained(from_pretrained(d, redeqx.make_mesh(2)), tmp_path)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = _ids(seed=1)
    np.testing.assert_allclose(torch_logits(again, ids), torch_logits(hf, ids), atol=1e-5, rtol=0)


@pytest.mark.slow
def test_train_step_communication_is_megatron(getkey):
    config = GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=4)
    model = GPT2LMHeadModel(config, key=getkey())
    optimizer = optax.sgd(0.1)
    mesh = redeqx.make_mesh(4)
    specs, state = sharded_state(model, optimizer, mesh, key=0)
    ids = np.random.RandomState(0).randint(0, 256, (8, 17))
    batch = jax.device_put({"ids": jnp.asarray(ids)}, NamedSharding(mesh, P("data")))

    summary = accelerator_collectives(redeqx.make_train_step(next_token_loss, optimizer, mesh, specs), state, batch)
    grad_bytes = gradient_bytes(state.model)
    analytic = megatron_bytes(config.n_embd, config.n_layer, 8 // mesh.shape["data"], 16, grad_bytes)
    near_megatron(summary, analytic, "GPT-2")
