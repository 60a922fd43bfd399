"""LLaMA-family models against Transformers' PyTorch reference (tiny random
configs built here, saved to a temp dir: no download)."""

import json
import struct
from functools import partial

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import redeqx
from megatron_count import megatron_bytes, step_at_4_shards_vs_one_device, gradient_bytes, near_megatron
from _helpers import hf_checkpoints, next_token_loss, nudged, one_device, random_ids, redeqx_logits, torch_logits
from redeqx.models import LlamaConfig, LlamaForCausalLM, from_pretrained, save_pretrained

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 64
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}


def _hf_config(kind):
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=128)
    if kind == "gqa":  # grouped-query attention, untied head, llama3 rope scaling, attention biases
        return transformers.LlamaConfig(**common, num_key_value_heads=2, rope_scaling=LLAMA3_ROPE,
                                        attention_bias=True, tie_word_embeddings=False)
    if kind == "tied":
        return transformers.LlamaConfig(**common, num_key_value_heads=4, tie_word_embeddings=True)
    if kind == "qwen2":  # q/k/v biases, no o_proj bias
        return transformers.Qwen2Config(**common, num_key_value_heads=2, tie_word_embeddings=False)
    raise ValueError(kind)


def _hf_model(kind):
    torch.manual_seed(0)
    cls = transformers.Qwen2ForCausalLM if kind == "qwen2" else transformers.LlamaForCausalLM
    return nudged(cls(_hf_config(kind)).eval())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return hf_checkpoints(tmp_path_factory, _hf_model, ("gqa", "tied", "qwen2"))


_ids = partial(random_ids, VOCAB)


@pytest.mark.parametrize("kind,scan_layers", [("gqa", False), ("tied", False), ("qwen2", False), ("gqa", True)])
def test_logits_match_transformers(checkpoints, kind, scan_layers):
    d, hf = checkpoints[kind]
    model = from_pretrained(d, one_device(), scan_layers=scan_layers)
    ids = _ids()
    np.testing.assert_allclose(redeqx_logits(model, ids), torch_logits(hf, ids), atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gqa", "tied"])
def test_save_pretrained_round_trip(checkpoints, kind, tmp_path):
    d, hf = checkpoints[kind]
    model = from_pretrained(d, redeqx.make_mesh(2))
    save_pretrained(model, tmp_path)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = _ids(seed=1)
    np.testing.assert_allclose(torch_logits(again, ids), torch_logits(hf, ids), atol=1e-5, rtol=0)
    assert type(again) is type(hf)


@pytest.mark.slow
def test_forward_agrees_across_model_shards(checkpoints):
    d, _ = checkpoints["gqa"]
    ids = _ids(batch=8)
    outs = {n: redeqx_logits(from_pretrained(d, redeqx.make_mesh(n)), ids) for n in (1, 2, 4)}
    np.testing.assert_allclose(outs[2], outs[1], atol=1e-5, rtol=0)
    np.testing.assert_allclose(outs[4], outs[1], atol=1e-5, rtol=0)


def test_loaded_arrays_are_sharded_by_the_rules(checkpoints):
    d, _ = checkpoints["gqa"]
    mesh = redeqx.make_mesh(2)
    model = from_pretrained(d, mesh, scan_layers=False)
    q = model.model.layers[0].self_attn.q_proj.weight
    assert q.sharding.spec == P("model", None)
    assert q.addressable_shards[0].data.shape == (16, 32)


def _rewrite(src, dst, edit):
    """Copy a one-file checkpoint, editing its tensor dict (name -> np array)."""
    raw = (src / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    tensors = {k: np.frombuffer(raw[8 + n + v["data_offsets"][0]: 8 + n + v["data_offsets"][1]], np.float32)
               .reshape(v["shape"]) for k, v in header.items()}
    edit(tensors)
    new, off, body = {}, 0, b""
    for k, a in tensors.items():
        new[k] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
        off += a.nbytes
        body += a.tobytes()
    h = json.dumps(new).encode()
    dst.mkdir()
    (dst / "model.safetensors").write_bytes(struct.pack("<Q", len(h)) + h + body)
    (dst / "config.json").write_text((src / "config.json").read_text())


def test_mismatched_checkpoint_lists_every_problem(checkpoints, tmp_path):
    d, _ = checkpoints["gqa"]

    def edit(t):
        del t["model.layers.1.mlp.up_proj.weight"]
        t["model.layers.0.extra.weight"] = np.zeros((2,), np.float32)
        t["model.norm.weight"] = np.zeros((31,), np.float32)

    _rewrite(d, tmp_path / "bad", edit)
    with pytest.raises(ValueError) as err:
        from_pretrained(tmp_path / "bad", redeqx.make_mesh(1))
    msg = str(err.value)
    assert "missing (1): model.layers.1.mlp.up_proj.weight" in msg
    assert "unexpected (1): model.layers.0.extra.weight" in msg
    assert "model.norm.weight" in msg and "(31,)" in msg


def test_sharded_checkpoint_with_index(checkpoints, tmp_path):
    d, hf = checkpoints["gqa"]
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    model = from_pretrained(tmp_path, redeqx.make_mesh(2))
    ids = _ids()
    np.testing.assert_allclose(redeqx_logits(model, ids), torch_logits(hf, ids), atol=1e-4, rtol=0)
    # and our writer's sharded layout reads back in Transformers
    save_pretrained(model, tmp_path / "ours", max_shard_bytes=20_000)
    assert (tmp_path / "ours" / "model.safetensors.index.json").exists()
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    np.testing.assert_allclose(torch_logits(again, ids), torch_logits(hf, ids), atol=1e-5, rtol=0)


def test_bf16_load_and_compute(checkpoints):
    d, hf = checkpoints["gqa"]
    model = from_pretrained(d, redeqx.make_mesh(2), dtype=jnp.bfloat16)
    assert model.model.layers.mlp.up_proj.weight.dtype == jnp.bfloat16  # stacked, the default
    ids = _ids()
    out = redeqx_logits(model, ids)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(out.astype(np.float32), torch_logits(hf, ids), atol=0.1, rtol=0)


@pytest.mark.slow
def test_decode_with_cache_equals_full_forward(getkey):
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config, key=getkey())
    ids = jnp.asarray(_ids(batch=1, seq=10)[0])
    cache = model.init_cache(16)
    decode = eqx.filter_jit(lambda m, ids, cache: m.decode(ids, cache))  # one program per length, not per op
    first, cache = decode(model, ids[:6], cache)
    rest = []
    for t in range(6, 10):
        logits, cache = decode(model, ids[t:t + 1], cache)
        rest.append(logits)
    np.testing.assert_allclose(jnp.concatenate([first, *rest]), eqx.filter_jit(model)(ids), atol=1e-5, rtol=0)


@pytest.mark.slow
def test_remat_gives_the_same_gradients(getkey):
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4)
    key = getkey()
    plain = LlamaForCausalLM(config, key=key)
    ids = jnp.asarray(_ids())

    def loss(m):
        logits = jax.vmap(m)(ids[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

    g1 = eqx.filter_jit(jax.grad(loss))(plain)
    g2 = eqx.filter_jit(jax.grad(redeqx.remat(loss)))(plain)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_constrain_is_a_no_op_without_a_mesh_and_pins_with_one():
    x = jnp.ones((4, 8))
    assert redeqx.constrain(x, P(None, "model")) is x
    mesh = redeqx.make_mesh(4)
    y = jax.jit(lambda a: redeqx.constrain(a * 2, P(None, "model"), mesh=mesh))(x)
    assert y.sharding.spec == P(None, "model")
    with jax.set_mesh(mesh):
        z = jax.jit(lambda a: jax.vmap(lambda r: redeqx.constrain(r, P("model")))(a))(x)
    assert z.sharding.spec[1] == "model"
    # an axis that does not divide the dim leaves it replicated
    w = jax.jit(lambda a: redeqx.constrain(a, P("model", None), mesh=mesh))(jnp.ones((3, 8)))
    assert w.sharding.spec in (P(), P(None, None), P(None))
    # P.UNCONSTRAINED leaves a dim to the partitioner, not replicated
    free = jax.make_jaxpr(lambda a: redeqx.constrain(a, P(None, P.UNCONSTRAINED), mesh=mesh))(x)
    assert free.eqns[0].params["sharding"].spec == P(None, P.UNCONSTRAINED)


def test_constrain_rejects_bad_specs():
    mesh = redeqx.make_mesh(2)
    with pytest.raises(ValueError, match="axis 'tensor'"):
        redeqx.constrain(jnp.ones((4, 4)), P(None, "tensor"), mesh=mesh)
    with pytest.raises(ValueError, match="3 entries"):
        redeqx.constrain(jnp.ones((4, 4)), P(None, None, "model"), mesh=mesh)
    with pytest.raises(TypeError, match="PartitionSpec"):
        redeqx.constrain(jnp.ones((4, 4)), ("model",), mesh=mesh)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        LlamaConfig(num_attention_heads=4, hidden_size=32, num_key_value_heads=3)
    with pytest.raises(ValueError, match="rope_type='yarn'"):
        LlamaConfig(rope_scaling=(("rope_type", "yarn"),))
    with pytest.raises(FileNotFoundError, match="config.json"):
        from_pretrained("/nonexistent-dir", redeqx.make_mesh(1))


@pytest.mark.slow
def test_train_step_communication_is_megatron_and_matches_one_device(getkey):
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4)
    model = LlamaForCausalLM(config, key=getkey())
    optimizer = optax.sgd(0.1)
    ids = np.random.RandomState(0).randint(0, 256, (8, 17))

    mesh, state4, summary = step_at_4_shards_vs_one_device(model, optimizer, next_token_loss, {"ids": ids})

    grad_bytes = gradient_bytes(state4.model)
    local_batch = ids.shape[0] // mesh.shape["data"]
    analytic = megatron_bytes(config.hidden_size, config.num_hidden_layers, local_batch, ids.shape[1] - 1, grad_bytes)
    near_megatron(summary, analytic, "LLaMA")


def test_mistral_sliding_window_matches_transformers(tmp_path):
    """A window shorter than the sequence: full forward and cached greedy decoding
    both attend only to the last `sliding_window` tokens, as Transformers' Mistral."""
    torch.manual_seed(0)
    config = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                        sliding_window=4, tie_word_embeddings=False)
    config._attn_implementation = "eager"
    hf = transformers.MistralForCausalLM(config).eval()
    hf.save_pretrained(tmp_path)
    model = from_pretrained(tmp_path, one_device())
    assert model.config.use_sliding_window and model.config.sliding_window == 4
    ids = _ids(seq=12)
    np.testing.assert_allclose(redeqx_logits(model, ids), torch_logits(hf, ids), atol=1e-4, rtol=0)
    hf.config.sliding_window = None  # the same weights with full attention: the window really matters
    hf.save_pretrained(tmp_path / "full")
    no_window = from_pretrained(tmp_path / "full", one_device())
    assert no_window._window() is None
    assert np.abs(redeqx_logits(no_window, ids) - redeqx_logits(model, ids)).max() > 1e-3
    hf.config.sliding_window = 4

    from redeqx.models import generate

    prompt = _ids(batch=1, seq=5, seed=3)
    ours = np.asarray(jax.jit(lambda m, p: generate(m, p, max_new_tokens=8))(model, jnp.asarray(prompt)))
    hf.generation_config.eos_token_id = None  # 8 tokens on both sides, EOS or not
    with torch.no_grad():
        theirs = hf.generate(torch.tensor(prompt), max_new_tokens=8, do_sample=False, pad_token_id=0)
    np.testing.assert_array_equal(ours, theirs[:, 5:].numpy())
    save_pretrained(model, tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text())["sliding_window"] == 4
