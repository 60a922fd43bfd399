"""Mixtral's expert stacks under the current sharding rules: on the expert axis
when n_model_shards divides the expert count (the router whole), on the
experts' hidden units when not; either way the same logits and the same three
training steps (load-balancing loss included) as one device, with fsdp too.
Plain SGD, not Adam: Adam's normalised steps hide a gradient off by a constant
factor (a data-shard sum counted 4 times went unseen under Adam)."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import redeqx
from redeqx.models import MixtralConfig, MixtralForCausalLM

VOCAB = 64


def _model(n_experts=8, scan_layers=True):
    config = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                           num_attention_heads=8, num_key_value_heads=8, num_local_experts=n_experts,
                           num_experts_per_tok=2, router_aux_loss_coef=0.01, scan_layers=scan_layers)
    model = MixtralForCausalLM(config, key=jax.random.key(0))
    # routers that decide (the default init's logits are all near 0)
    return jax.tree_util.tree_map_with_path(
        lambda p, x: x * 50 if "gate" in jax.tree_util.keystr(p) and "experts" not in jax.tree_util.keystr(p) else x,
        model)


def loss_fn(model, batch, key):
    ids = batch["input_ids"]
    logits, stats = jax.vmap(model.with_aux)(ids[:, :-1])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()
    aux = stats.load_balancing_loss()
    return ce + model.config.router_aux_loss_coef * aux + 1e-3 * stats.z_loss(), {"aux_loss": aux}


BATCH = {"input_ids": np.random.RandomState(0).randint(0, VOCAB, (16, 9)).astype(np.int32)}


def _run(model, n_model, devices=None, fsdp=False, n_steps=3, compute_dtype=None):
    mesh = redeqx.make_mesh(n_model, devices=devices)
    specs = redeqx.sharding_rules(model, mesh, fsdp=fsdp)
    optimizer = optax.sgd(0.5)
    state = redeqx.init_state(jax.tree.map(lambda x: jnp.array(x, copy=True), model), optimizer, mesh, specs,
                              key=jax.random.key(1))
    batch = jax.device_put({k: jnp.asarray(v) for k, v in BATCH.items()}, NamedSharding(mesh, P("data")))
    logits = jax.jit(jax.vmap(state.model))(batch["input_ids"])
    step = redeqx.make_train_step(loss_fn, optimizer, mesh, specs, compute_dtype=compute_dtype)
    losses = []
    for _ in range(n_steps):
        state, metrics = step(state, batch)
        losses.append((float(metrics["loss"]), float(metrics["aux_loss"])))
    return np.asarray(logits), np.asarray(losses), state.model, specs


@pytest.fixture(scope="module")
def one_device():
    return {n: _run(_model(n), 1, jax.devices()[:1]) for n in (8, 6)}


@pytest.mark.slow
@pytest.mark.parametrize("n_model,fsdp", [(1, False), (2, False), (4, False), (8, False), (2, True), (4, True)])
def test_expert_parallel_matches_one_device(one_device, n_model, fsdp, monkeypatch):
    """8 experts: each stack split on E over n_model_shards, trained 3 steps like one device.
    With fsdp the stacks (small here: fsdp's size floor lowered for the test) are split over
    data too, on a dim the model axis leaves free."""
    if fsdp:
        monkeypatch.setattr("redeqx.sharding._specs.FSDP_MIN_SIZE", 1024)
    logits, losses, model, specs = _run(_model(8), n_model, fsdp=fsdp)
    want_logits, want_losses, want_model, _ = one_device[8]
    np.testing.assert_allclose(logits, want_logits, atol=1e-5, rtol=0)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert want_losses[0, 1] > 1.05  # a routing far enough from balanced that the aux loss is live
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(want_model)):
        np.testing.assert_allclose(a, b, atol=1e-5)
    block = specs.model.layers.block_sparse_moe
    if n_model > 1:
        assert block.experts.gate_proj[:2] == (None, "model") and block.experts.down_proj[:2] == (None, "model")
    if fsdp:
        assert "data" in tuple(block.experts.gate_proj) and "data" in tuple(block.experts.down_proj)
    assert block.gate.weight in (P(), P(None, None, None)) or "model" not in tuple(block.gate.weight)


def test_tensor_parallel_experts_when_the_count_does_not_divide(one_device):
    """6 experts over 4 shards: the experts' hidden units split instead (the rules' fallback), same steps."""
    logits, losses, model, specs = _run(_model(6), 4)
    want_logits, want_losses, want_model, _ = one_device[6]
    np.testing.assert_allclose(logits, want_logits, atol=1e-5, rtol=0)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(want_model)):
        np.testing.assert_allclose(a, b, atol=1e-5)
    e = specs.model.layers.block_sparse_moe.experts
    assert e.gate_proj == e.up_proj == P(None, None, "model", None) and e.down_proj == P(None, None, None, "model")


@pytest.mark.parametrize("n_model", [2, 4, 8])
def test_explain_says_expert_parallel(n_model):
    model = _model(8, scan_layers=False)
    mesh = redeqx.make_mesh(n_model)
    table = redeqx.explain(model, redeqx.sharding_rules(model, mesh), mesh, reasons="full")
    rows = {r.split()[0]: r for r in table.splitlines()
            if r.strip()}
    for name in ("gate_proj", "up_proj", "down_proj"):
        row = rows[f"model.layers.0.block_sparse_moe.experts.{name}"]
        assert f"expert stack: dim 0, experts 8 -> {8 // n_model} per device (expert parallel)" in row
    assert "MoE router: replicated" in rows["model.layers.0.block_sparse_moe.gate.weight"]


@pytest.mark.slow
def test_bfloat16_steps_follow_float32(one_device):
    """bfloat16 compute at n_model_shards=2 (the weights' gradients summed over data in float32:
    XLA:CPU aborts on that all-reduce in bfloat16) stays within bfloat16's error of float32."""
    _, losses, _, _ = _run(_model(8), 2, compute_dtype=jnp.bfloat16, n_steps=2)
    np.testing.assert_allclose(losses[:, 0], one_device[8][1][:2, 0], rtol=2e-2)


def test_a_step_sums_one_output_per_moe_layer_over_model():
    """At data=2, model=4 the step's collectives hold no gathered expert stack and no grouped
    intermediate: each device multiplies its own experts' rows, and the block's (tokens x hidden)
    output is what crosses model (plus the data shards' sum of the stacks' gradients)."""
    model = _model(8)
    mesh = redeqx.make_mesh(4)
    specs = redeqx.sharding_rules(model, mesh)
    optimizer = optax.sgd(0.5)
    state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1))
    batch = jax.device_put({k: jnp.asarray(v) for k, v in BATCH.items()}, NamedSharding(mesh, P("data")))
    hlo = redeqx.make_train_step(loss_fn, optimizer, mesh, specs).lower(state, batch).compile().as_text()
    moved = [line for line in hlo.splitlines() if re.search(r"= \S+ (all-gather|all-reduce|all-to-all)\(", line)
             or re.search(r"= \(.*\) all-reduce\(", line)]
    rows = 16 // 2 * 8 * 2  # a data shard's sequences x tokens x k
    assert not [m for m in moved if f"[{rows}," in m]  # no grouped rows or intermediates
    assert not [m for m in moved if "all-gather" in m and ",24,32]" in m]  # no expert stack gathered
    assert [m for m in moved if "f32[8,8,32]" in m and "{{0,1,2,3},{4,5,6,7}}" in m]  # the outputs, over model


@pytest.mark.parametrize("n_model", [4, 8])
def test_expert_parallel_bytes_within_the_all_to_all_plan(n_model):
    """The step's collectives, as a GPU or TPU moves them, against an expert-parallel plan that
    sends each token to its k experts' devices and back by all-to-all (2 x tokens x k x hidden
    floats per MoE layer each way) plus the attention's Megatron bytes and the data-parallel
    gradient sum: within 1.2x (redeqx moves less: its tokens are already on every device of a
    model group, so one all-reduce of tokens x hidden per MoE layer each way stands in for the
    all-to-alls, as a dense Megatron MLP's does)."""
    from accelerator_count import accelerator_collectives

    model, mesh = _model(8), redeqx.make_mesh(n_model)
    specs = redeqx.sharding_rules(model, mesh)
    optimizer = optax.sgd(0.5)
    state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1))
    batch = jax.device_put({k: jnp.asarray(v) for k, v in BATCH.items()}, NamedSharding(mesh, P("data")))
    moved = sum(v["bytes"] for v in accelerator_collectives(
        redeqx.make_train_step(loss_fn, optimizer, mesh, specs), state, batch).values())
    grad_bytes = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state.model))
    b, t, h, layers, k = 16 // mesh.shape["data"], 8, 32, 2, 2
    act = b * t * h * 4
    attention = 2 * (1 + layers) * act + 3 * b * t * 4  # embedding, attention outputs / LM head, QKV; the loss
    all_to_all = layers * 2 * (2 * b * t * k * h * 4)  # dispatch and combine, forward and backward
    analytic = attention + all_to_all + grad_bytes
    assert moved <= 1.2 * analytic, (moved, analytic)
    assert moved >= attention + layers * 2 * act  # the MoE outputs' sums are there


@pytest.mark.slow
def test_sharded_decoding_matches_one_device():
    """generate and beam_search in a predict step at n_model_shards=2 (the batch over data, the
    experts over model, a left-padded prompt) give one device's tokens."""
    from redeqx.models import beam_search, generate

    prompts = {"input_ids": np.random.RandomState(1).randint(0, VOCAB, (8, 5)).astype(np.int32),
               "attention_mask": np.ones((8, 5), bool)}
    prompts["attention_mask"][0, :2] = False

    def pred_fn(model, batch, key):
        kw = dict(attention_mask=batch["attention_mask"])
        return (generate(model, batch["input_ids"], max_new_tokens=5, **kw),
                beam_search(model, batch["input_ids"], max_new_tokens=3, num_beams=2, **kw))

    def tokens(n_model, devices=None):
        mesh = redeqx.make_mesh(n_model, devices=devices)
        specs = redeqx.sharding_rules(_model(8), mesh)
        model = redeqx.shard(_model(8), specs, mesh)
        batch = jax.device_put({k: jnp.asarray(v) for k, v in prompts.items()}, NamedSharding(mesh, P("data")))
        return [np.asarray(t) for t in redeqx.make_predict_step(pred_fn, mesh, specs)(model, batch, jax.random.key(0))]

    for got, want in zip(tokens(2), tokens(1, jax.devices()[:1])):
        np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_lora_on_the_attention_and_the_experts(tmp_path):
    """LoRA on q/v and on the experts (a pair of adapters per expert and stack): the model is
    unchanged at first, 3 adapter-only steps at 4 model shards match one device, the base
    weights stay frozen, and merge_lora folds the adapters back for save_pretrained."""
    from redeqx.models import LoRAExperts, from_pretrained, lora, lora_trainable, merge_lora, save_pretrained

    base = _model(8)
    model = lora(base, r"self_attn\.(q_proj|v_proj)$|experts$", rank=4, alpha=8, key=jax.random.key(2))
    experts = model.model.layers.block_sparse_moe.experts
    assert isinstance(experts, LoRAExperts) and experts.gate_proj_lora.lora_a.shape == (2, 8, 4, 32)
    ids = jnp.asarray(BATCH["input_ids"][:2])
    logits = eqx.filter_jit(lambda m: jax.vmap(m)(ids))  # one compile per model structure and sharding
    # to rounding: the base model multiplies Q, K and V as one product, the adapted one each alone
    np.testing.assert_allclose(logits(model), logits(base), rtol=0, atol=1e-6)
    trainable = lora_trainable(model)

    def train(n_model, devices=None):
        mesh = redeqx.make_mesh(n_model, devices=devices)
        specs = redeqx.sharding_rules(model, mesh)
        optimizer = optax.sgd(0.5)
        state = redeqx.init_state(jax.tree.map(lambda x: jnp.array(x, copy=True), model), optimizer, mesh, specs,
                                  key=jax.random.key(1), trainable=trainable)
        batch = jax.device_put({k: jnp.asarray(v) for k, v in BATCH.items()}, NamedSharding(mesh, P("data")))
        step = redeqx.make_train_step(loss_fn, optimizer, mesh, specs, trainable=trainable)
        losses = []
        for _ in range(3):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        return np.asarray(losses), state.model

    losses, trained = train(4)
    want_losses, want = train(1, jax.devices()[:1])
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, atol=1e-5)
    moved = trained.model.layers.block_sparse_moe.experts
    assert float(jnp.abs(moved.down_proj_lora.lora_b).max()) > 0
    np.testing.assert_array_equal(moved.gate_proj, experts.gate_proj)
    merged = merge_lora(trained)
    np.testing.assert_allclose(logits(merged), logits(trained), atol=1e-5)
    save_pretrained(merged, tmp_path)
    again = from_pretrained(tmp_path, redeqx.make_mesh(1, devices=jax.devices()[:1]))
    np.testing.assert_allclose(logits(again), logits(merged), atol=1e-6)


def test_checkpoint_saved_at_2_shards_restores_at_4(tmp_path):
    """A train state saved with the experts over 2 shards comes back over 4, values unchanged."""
    model = _model(8)
    mesh2, mesh4 = redeqx.make_mesh(2), redeqx.make_mesh(4)
    specs2, specs4 = redeqx.sharding_rules(model, mesh2), redeqx.sharding_rules(model, mesh4)
    state = redeqx.init_state(model, optax.adam(1e-3), mesh2, specs2, key=jax.random.key(1))
    redeqx.save_checkpoint(tmp_path / "ckpt", state)
    like = redeqx.init_state(_model(8), optax.adam(1e-3), mesh4, specs4, key=jax.random.key(5))
    back = redeqx.restore_checkpoint(tmp_path / "ckpt", like, mesh4, specs4)
    for a, b in zip(jax.tree.leaves(back.model), jax.tree.leaves(state.model)):
        np.testing.assert_array_equal(a, b)
    stack = back.model.model.layers.block_sparse_moe.experts.gate_proj
    assert stack.sharding.spec == P(None, "model", None, None) and stack.addressable_shards[0].data.shape[1] == 2


@pytest.mark.slow
def test_fewer_rows_than_experts_train_as_one_device_does(monkeypatch):
    """A batch small enough that each device holds fewer expert rows than experts takes the
    grouped matmul's gathered path (`_grouped._gathered`), split over model or not: every
    gradient equals one device's, and one device's equals ragged_dot's."""
    from redeqx.models import _grouped

    model, choose, paths = _model(32), _grouped.choose, []
    monkeypatch.setattr(_grouped, "choose", lambda *a, **k: paths.append(choose(*a, **k)[0]) or choose(*a, **k))
    batch = {"input_ids": np.random.RandomState(0).randint(0, VOCAB, (4, 2)).astype(np.int32)}

    def gradients(n_model, devices=None):
        mesh = redeqx.make_mesh(n_model, devices=devices)
        specs = redeqx.sharding_rules(model, mesh)
        state = redeqx.init_state(jax.tree.map(lambda x: jnp.array(x, copy=True), model), optax.sgd(1.0), mesh, specs,
                                  key=jax.random.key(1))
        before = [np.asarray(x) for x in jax.tree.leaves(eqx.filter(state.model, eqx.is_array))]
        step = redeqx.make_train_step(loss_fn, optax.sgd(1.0), mesh, specs)
        placed = jax.device_put({k: jnp.asarray(v) for k, v in batch.items()}, NamedSharding(mesh, P("data")))
        state, _ = step(state, placed)
        return [b - np.asarray(a) for b, a in zip(before, jax.tree.leaves(eqx.filter(state.model, eqx.is_array)))]

    one = gradients(1, jax.devices()[:1])
    assert set(paths) == {_grouped.GATHERED}
    for n_model in (2, 4):
        for got, want in zip(gradients(n_model), one):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5 * np.abs(want).max())
    monkeypatch.setattr(_grouped, "choose", lambda *a, **k: (
        (_grouped.RAGGED_DOT, "") if choose(*a, **k)[0] == _grouped.GATHERED else choose(*a, **k)))
    for got, want in zip(gradients(1, jax.devices()[:1]), one):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5 * np.abs(want).max())
