"""The API contract: nothing fails silently (a first-day review as a new user)."""

import sys
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import redeqx


class Tokeniser(eqx.Module):
    """A ViT-ish model with replicated leaves of every kind: a class token,
    a learned position table, norms and row-parallel biases."""

    cls_token: jax.Array
    pos: jax.Array
    mlp: eqx.nn.MLP
    norm: eqx.nn.LayerNorm

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.cls_token = jax.random.normal(k1, (1, 16))
        self.pos = jax.random.normal(k2, (5, 16))
        self.mlp = eqx.nn.MLP(16, 4, 32, depth=2, key=k3)
        self.norm = eqx.nn.LayerNorm(16)

    def __call__(self, x):  # (4, 16) -> (4,)
        h = jnp.concatenate([self.cls_token, x]) + self.pos
        h = jax.vmap(self.norm)(h)
        return jax.vmap(self.mlp)(h)[0]


def loss_fn(model, batch, key):
    out = jax.vmap(model)(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(out, batch["y"]).mean()


def make_batch(n=16, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(n, 4, 16)).astype(np.float32), "y": rng.integers(0, 4, n).astype(np.int32)}


def setup(n_model_shards=2, **kw):
    mesh = redeqx.make_mesh(n_model_shards)
    model = Tokeniser(jax.random.key(0))
    specs = redeqx.sharding_rules(model, mesh)
    optimizer = optax.adamw(1e-2)
    return mesh, model, specs, optimizer


# ----------------------------------------------------------------------------- 1. the user's model survives


def test_training_never_deletes_the_users_model():
    mesh, model, specs, optimizer = setup()
    before = jax.vmap(model)(make_batch()["x"])
    state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1))
    step = redeqx.make_train_step(loss_fn, optimizer, mesh, specs)
    for i in range(2):
        state, _ = step(state, make_batch(seed=i))
    assert not any(x.is_deleted() for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    np.testing.assert_array_equal(jax.vmap(model)(make_batch()["x"]), before)  # still runs, unchanged
    assert not np.allclose(jax.vmap(state.model)(make_batch()["x"]), before)  # and the state did train


def test_shard_and_make_step_keep_the_users_arrays():
    mesh = redeqx.make_mesh(2)
    tree = {"w": jnp.ones((8, 4)), "b": jnp.zeros((4,))}
    placed = redeqx.shard(tree, {"w": P("model"), "b": P()}, mesh)
    step = redeqx.make_step(lambda s: (jax.tree.map(lambda x: x + 1, s), None), mesh)
    placed, _ = step(placed)
    assert not any(x.is_deleted() for x in jax.tree.leaves(tree))
    np.testing.assert_array_equal(tree["b"], 0.0)


def test_donate_model_moves_instead_of_copying():
    mesh, model, specs, optimizer = setup()
    state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1), donate_model=True)
    step = redeqx.make_train_step(loss_fn, optimizer, mesh, specs)
    state, metrics = step(state, make_batch())
    assert np.isfinite(float(metrics["loss"]))


# ----------------------------------------------------------------------------- 2. specs is the contract


@pytest.mark.parametrize("bad", [None, "nonsense", 42, [1, 2]])
def test_steps_reject_specs_that_are_not_specs(bad):
    mesh, model, specs, optimizer = setup()
    for make in (lambda: redeqx.make_train_step(loss_fn, optimizer, mesh, bad),
                 lambda: redeqx.make_eval_step(loss_fn, mesh, bad),
                 lambda: redeqx.make_predict_step(loss_fn, mesh, bad)):
        with pytest.raises((TypeError, ValueError), match="sharding_rules"):
            make()


def test_specs_of_another_model_are_an_error_naming_paths():
    mesh, model, specs, optimizer = setup()
    other = redeqx.sharding_rules(eqx.nn.MLP(16, 4, 32, depth=3, key=jax.random.key(0)), mesh)
    state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1))
    step = redeqx.make_train_step(loss_fn, optimizer, mesh, other)
    with pytest.raises(ValueError, match="cls_token"):
        step(state, make_batch())


def test_state_on_another_layout_is_moved_to_specs_not_replicated():
    """A state laid out for model=4 given to a model=2 step comes out laid out
    by the model=2 specs (it used to come out entirely replicated)."""
    mesh4, model, specs4, optimizer = setup(4)
    mesh2 = redeqx.make_mesh(2)
    specs2 = redeqx.sharding_rules(model, mesh2)
    state = redeqx.init_state(model, optimizer, mesh4, specs4, key=jax.random.key(1))
    step = redeqx.make_train_step(loss_fn, optimizer, mesh2, specs2)
    with pytest.warns(UserWarning, match="moved") as record:
        state, _ = step(state, make_batch())
    assert record[0].filename == __file__  # the warning names the user's line
    w = state.model.mlp.layers[0].weight
    assert w.sharding == NamedSharding(mesh2, specs2.mlp.layers[0].weight)
    assert w.sharding.spec == P("model", None)
    assert state.opt_state[0].mu.mlp.layers[0].weight.sharding.spec == P("model", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the step's own output needs no move
        step(state, make_batch(seed=1))


def test_an_eval_loss_comparing_rows_is_warned_about():
    """The eval step runs ``loss_fn`` on each row alone: a loss with in-batch negatives (the rows'
    outputs against each other, as CLIP's) sees no other row and gave 0.0 without a word."""
    mesh, model, specs, _ = setup(2)

    def in_batch_negatives(m, b, key):
        out = jax.vmap(m)(b["x"])
        return optax.softmax_cross_entropy_with_integer_labels(out @ out.T, jnp.arange(out.shape[0])).mean()

    with pytest.warns(UserWarning, match=r"compares rows: on a batch of 4 rows it computes a value of shape \(4, 4\)"):
        got = redeqx.make_eval_step(in_batch_negatives, mesh, specs)(redeqx.shard(model, specs, mesh), make_batch(),
                                                                     jax.random.key(0))
    assert float(got["loss"]) == 0.0  # what it computes: each row alone


def test_eval_and_predict_place_the_model_by_specs():
    mesh4, model, specs4, _ = setup(4)
    mesh2 = redeqx.make_mesh(2)
    specs2 = redeqx.sharding_rules(model, mesh2)
    on4 = redeqx.shard(model, specs4, mesh4)
    eval_step = redeqx.make_eval_step(loss_fn, mesh2, specs2)
    predict_step = redeqx.make_predict_step(lambda m, b, k: jax.vmap(m)(b["x"]), mesh2, specs2)
    batch = make_batch()
    with pytest.warns(UserWarning, match="moved"):
        got = eval_step(on4, batch, jax.random.key(0))
    np.testing.assert_allclose(got["loss"], loss_fn(model, batch, None), rtol=1e-5)
    with pytest.warns(UserWarning, match="moved"):
        preds = predict_step(on4, batch, jax.random.key(0))
    np.testing.assert_allclose(preds, jax.vmap(model)(batch["x"]), rtol=1e-5, atol=1e-6)
    # the lowered program takes the model in the specs' layout
    lowered = predict_step.lower(redeqx.shard(model, specs2, mesh2), batch, jax.random.key(0))
    assert "model" in lowered.as_text()


def test_make_step_state_on_another_mesh_is_an_error():
    mesh4, mesh2 = redeqx.make_mesh(4), redeqx.make_mesh(2)
    tree = redeqx.shard({"w": jnp.ones((8, 4))}, {"w": P("model")}, mesh4)
    step = redeqx.make_step(lambda s: (s, None), mesh2)
    with pytest.raises(ValueError, match=r"lives on the mesh \{data: 2, model: 4\}.*\{data: 4, model: 2\}"):
        step(tree)


# ----------------------------------------------------------------------------- 6. constants


def test_make_step_refuses_to_drop_a_changed_constant():
    mesh = redeqx.make_mesh(2)
    step = redeqx.make_step(lambda s: ({"w": s["w"] * 2, "n": s["n"] + 1}, None), mesh)
    with pytest.raises(TypeError, match=r"'n' from 0 to 1.*jnp.asarray\(0\)"):
        step({"w": jnp.ones(4), "n": 0})
    state = {"w": jnp.ones(4), "n": jnp.asarray(0)}
    for _ in range(3):
        state, _ = step(state)
    assert int(state["n"]) == 3


# ----------------------------------------------------------------------------- 7. wrong losses


@pytest.mark.parametrize("returned,match", [
    (lambda out: jnp.sum(out.argmax(-1) != 0), "dtype int32.*gradient of an integer is zero"),
    (lambda out: {"loss": out.mean()}, "returned a dict as its loss"),
    (lambda out: (out.mean(), {"per_example": out.mean(-1)}), r"aux\['per_example'\] has shape \(16,\)"),
    (lambda out: (out.mean(), {"loss": out.mean()}), "aux keys \\['loss'\\]"),
])
def test_wrong_losses_are_errors_naming_loss_fn(returned, match):
    mesh, model, specs, optimizer = setup()

    def my_loss(model, batch, key):
        return returned(jax.vmap(model)(batch["x"]))

    state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1))
    step = redeqx.make_train_step(my_loss, optimizer, mesh, specs)
    with pytest.raises((TypeError, ValueError), match="my_loss") as info:
        step(state, make_batch())
    assert info.match(match)


def test_an_error_inside_loss_fn_notes_what_the_batch_holds():
    """Float labels into optax's integer-label cross-entropy: optax's error names no key; the note
    says what each of the batch's keys holds."""
    mesh, model, specs, optimizer = setup()

    def my_loss(model, batch, key):
        logits = jax.vmap(model)(batch["x"]).mean(1)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1))
    step = redeqx.make_train_step(my_loss, optimizer, mesh, specs)
    batch = make_batch()
    with pytest.raises(TypeError, match="integer") as info:
        step(state, {**batch, "y": batch["y"].astype(np.float32)})
    notes = "\n".join(getattr(info.value, "__notes__", []))
    if sys.version_info >= (3, 11):  # add_note
        assert "raised inside loss_fn 'my_loss'" in notes and "batch['y']: float32[16]" in notes, notes


def test_loss_fn_without_key_is_named_with_its_fix():
    mesh, model, specs, optimizer = setup()

    def no_key(model, batch):
        return 0.0

    with pytest.raises(TypeError, match=r"loss_fn 'no_key' has the signature \(model, batch\).*loss_fn\(model, batch, key\)"):
        redeqx.make_train_step(no_key, optimizer, mesh, specs)
    with pytest.raises(TypeError, match="no_key"):
        redeqx.make_eval_step(no_key, mesh, specs)


def test_a_torch_like_leaf_is_named():
    mesh = redeqx.make_mesh(2)

    class FakeTensor:
        shape, dtype = (3,), "float32"

        def __array__(self):
            return np.zeros(3)

    with pytest.raises(TypeError, match=r"leaf 'w' is a .*FakeTensor.*jnp.asarray"):
        redeqx.make_step(lambda s: (s, None), mesh)({"w": FakeTensor()})


# ----------------------------------------------------------------------------- meshes and type errors


def test_explicit_meshes_are_accepted():
    """jax.make_mesh gives Explicit axes in this JAX; redeqx works with them."""
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    assert mesh.axis_types == (AxisType.Explicit, AxisType.Explicit)
    model = Tokeniser(jax.random.key(0))
    specs = redeqx.sharding_rules(model, mesh)
    optimizer = optax.adam(1e-2)
    state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1))
    step = redeqx.make_train_step(loss_fn, optimizer, mesh, specs)
    batches = redeqx.batches([{"x": x, "y": y} for x, y in zip(*make_batch().values())],
                             lambda es: {"x": np.stack([e["x"] for e in es]), "y": np.array([e["y"] for e in es])},
                             2, mesh)
    state, metrics = step(state, next(iter(batches)))
    assert np.isfinite(float(metrics["loss"]))


def test_meshes_with_other_axis_names_are_an_error_naming_them():
    mesh = jax.make_mesh((4, 2), ("batch", "tp"))
    model = Tokeniser(jax.random.key(0))
    for call in (lambda: redeqx.sharding_rules(model, mesh), lambda: redeqx.make_step(lambda s: (s, 0), mesh),
                 lambda: redeqx.make_eval_step(loss_fn, mesh, {"w": P()}),
                 lambda: next(iter(redeqx.batches([1, 2], lambda e: np.array(e), 1, mesh)))):
        with pytest.raises(ValueError, match=r"axes \('batch', 'tp'\).*redeqx.make_mesh"):
            call()


def test_type_errors_are_short_and_name_the_argument():
    mesh = redeqx.make_mesh(2)
    data = [{"x": np.zeros(3)}] * 5000
    with pytest.raises(TypeError) as info:
        redeqx.batches(data, lambda e: e, 2.0, mesh)
    message = str(info.value)
    assert len(message) < 300, message
    assert "per_device_batch_size=2.0" in message and "int" in message


# ----------------------------------------------------------------------------- day-one conveniences


def test_predict_step_compute_dtype():
    mesh, model, specs, _ = setup()
    batch = make_batch()
    pred = lambda m, b, k: jax.vmap(m)(b["x"])  # noqa: E731
    full = redeqx.make_predict_step(pred, mesh, specs)(model, batch, jax.random.key(0))
    half = redeqx.make_predict_step(pred, mesh, specs, compute_dtype=jnp.bfloat16)(model, batch, jax.random.key(0))
    assert half.dtype == jnp.bfloat16 and full.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(half, np.float32), full, rtol=0.05, atol=0.05)


def test_save_pretrained_writes_generation_config(tmp_path):
    import json

    from redeqx import models

    config = models.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=4, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    models.save_pretrained(models.LlamaForCausalLM(config, key=jax.random.key(0)), tmp_path)
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"], generation["pad_token_id"]) == (1, 2, 0)
    # GPT-2's config kept no pad_token_id: a checkpoint's was dropped on the way through redeqx
    gpt2 = models.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2, pad_token_id=0)
    models.save_pretrained(models.GPT2LMHeadModel(gpt2, key=jax.random.key(0)), tmp_path / "gpt2")
    assert json.loads((tmp_path / "gpt2" / "config.json").read_text())["pad_token_id"] == 0


def test_predict_step_takes_a_batch_the_data_axis_does_not_divide():
    mesh, model, specs, _ = setup()  # data = 4
    batch = make_batch(n=3)
    preds = redeqx.make_predict_step(lambda m, b, k: jax.vmap(m)(b["x"]), mesh, specs)(model, batch, jax.random.key(0))
    np.testing.assert_allclose(preds, jax.vmap(model)(batch["x"]), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_positions_past_a_learned_table_are_an_error():
    """GPT-2, OPT and BART learn one row per position; a longer sequence read NaN rows (jnp.take's
    fill mode), trained on NaN, and the planner planned it without a word."""
    from redeqx import models

    key = jax.random.key(0)
    gpt2 = models.GPT2LMHeadModel(models.GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2),
                                  key=key)
    opt = models.OPTForCausalLM(models.OPTConfig(vocab_size=32, hidden_size=16, ffn_dim=32, num_hidden_layers=1,
                                                 num_attention_heads=2, max_position_embeddings=8), key=key)
    bart = models.BartForConditionalGeneration(models.BartConfig(
        vocab_size=32, max_position_embeddings=8, d_model=16, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32), key=key)
    ok, long = jnp.zeros((8,), jnp.int32), jnp.zeros((9,), jnp.int32)
    for model, field in ((gpt2, "n_positions=8"), (opt, "max_position_embeddings=8")):
        assert jnp.isfinite(eqx.filter_jit(model)(ok)).all()
        with pytest.raises(ValueError, match=rf"9 positions do not fit .*\({field}\); use sequences of at most 8"):
            model(long)
        with pytest.raises(ValueError, match=rf"{type(model).__name__}.init_cache: 12 positions do not fit"):
            models.generate(model, ok[None, :6], max_new_tokens=6)
    assert jnp.isfinite(eqx.filter_jit(bart)(ok, ok)).all()
    with pytest.raises(ValueError, match=r"BartForConditionalGeneration.encode: 9 positions"):
        bart(long, ok)
    with pytest.raises(ValueError, match=r"decoder_input_ids\): 9 positions"):
        bart(ok, long)


def test_dtype_arguments_are_checked_alike(tmp_path):
    """compute_dtype, with_opt_state_dtype's dtype and a checkpoint's dtype: one check, one kind of error."""
    mesh = redeqx.make_mesh(1, devices=jax.devices()[:1])
    model = eqx.nn.Linear(2, 2, key=jax.random.key(0))
    specs = redeqx.sharding_rules(model, mesh)
    loss = lambda m, b, k: jnp.sum(m(b["x"]))  # noqa: E731
    with pytest.raises(TypeError, match=r"compute_dtype must be a floating dtype such as jnp.bfloat16, or None; "
                                        r"got 'int8'"):
        redeqx.make_eval_step(loss, mesh, specs, compute_dtype="int8")
    with pytest.raises(TypeError, match=r"with_opt_state_dtype\(\): dtype must be a floating dtype .*; got 'oops'"):
        redeqx.with_opt_state_dtype(optax.adam(1e-3), "oops")
    with pytest.raises(TypeError, match=r"dtype must be a floating dtype such as jnp.bfloat16, or None; got 'int8'"):
        redeqx.CheckpointManager(tmp_path, dtype="int8")
    assert redeqx.make_eval_step(loss, mesh, specs, compute_dtype="bfloat16") is not None
