"""FFTs, ``top_k`` and grouped convolutions run on each data shard's own rows
(`redeqx.steps._per_shard`): XLA's partitioner all-gathers the whole batch onto every device for
each of them and runs it there. A small model holding all three (a Fourier layer with complex
weights, an MoE-style router, a ``groups=2`` convolution) trains, evaluates and predicts as on
one device, and its compiled steps gather no batch-sized value over ``data``. Convolutions grouped
by example (per-example weight gradients), on which the partitioner aborted the process, compile
and give one device's values in every step maker."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from accelerator_count import compiled_train_step, partitioned_text, reassociated_collectives

import redeqx

ROWS, WIDTH, POINTS, MODES, EXPERTS = 16, 8, 32, 4, 4


class Spectral(eqx.Module):
    """A Fourier neural operator's layer: the lowest ``MODES`` frequencies mixed by complex weights."""

    weights: jax.Array  # (in, out, modes), complex64

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        shape = (WIDTH, WIDTH, MODES)
        self.weights = (jax.random.normal(k1, shape) + 1j * jax.random.normal(k2, shape)) / WIDTH

    def __call__(self, x):  # (C, N) -> (C, N)
        low = jnp.einsum("im,iom->om", jnp.fft.rfft(x)[:, :MODES], self.weights)
        full = jnp.zeros((WIDTH, POINTS // 2 + 1), low.dtype).at[:, :MODES].set(low)
        return jnp.fft.irfft(full, n=POINTS)


class Model(eqx.Module):
    lift: eqx.nn.Conv1d
    spectral: Spectral
    grouped: eqx.nn.Conv1d
    router: eqx.nn.Linear
    experts: jax.Array  # (E, C, C)
    head: eqx.nn.Linear

    def __init__(self, key):
        ks = jax.random.split(key, 6)
        self.lift = eqx.nn.Conv1d(2, WIDTH, 1, key=ks[0])
        self.spectral = Spectral(ks[1])
        self.grouped = eqx.nn.Conv1d(WIDTH, WIDTH, 3, padding=1, groups=2, key=ks[2])
        self.router = eqx.nn.Linear(WIDTH, EXPERTS, key=ks[3])
        self.experts = jax.random.normal(ks[4], (EXPERTS, WIDTH, WIDTH)) / WIDTH
        self.head = eqx.nn.Linear(WIDTH, 1, key=ks[5])

    def __call__(self, x):  # (2, N) -> ()
        x = self.lift(x)
        x = jax.nn.gelu(x + self.spectral(x))
        x = x + self.grouped(x)
        tokens = x.T  # (N, C)
        weights, index = jax.lax.top_k(jax.nn.softmax(jax.vmap(self.router)(tokens)), 2)  # (N, 2) each
        gates = jnp.sum(jax.nn.one_hot(index, EXPERTS) * weights[..., None], axis=1)  # (N, E)
        tokens = tokens + jnp.einsum("ne,nc,ecd->nd", gates, tokens, self.experts)
        return self.head(tokens.mean(0))[0]


def loss_fn(model, batch, key):
    pred = jax.vmap(model)(batch["x"])
    return jnp.mean((pred - batch["y"]) ** 2), {"mean_pred": pred.mean()}


def pred_fn(model, batch, key):
    return jax.vmap(model)(batch["x"])


def data():
    rng = np.random.default_rng(0)
    return {"x": rng.normal(size=(ROWS, 2, POINTS)).astype(np.float32),
            "y": rng.normal(size=(ROWS,)).astype(np.float32)}


def over_data(batch, mesh):
    """``batch`` split over ``data``, as `redeqx.batches` gives it (a `make_step` takes it as it is)."""
    return jax.device_put(batch, NamedSharding(mesh, P("data")))


def batch_gathers(text: str) -> list:
    """The all-gathers of a partitioned program that move a value as large as the global batch."""
    return [c for c in reassociated_collectives(text) if c.kind == "all-gather"
            and any(shape and shape[0] == ROWS for _, shape in c.shapes)]


@pytest.fixture(scope="module")
def model():
    return Model(jax.random.key(0))


def one_device(model, optimizer, devices):
    mesh = redeqx.make_mesh(1, devices=devices[:1])
    specs = redeqx.sharding_rules(model, mesh)
    return mesh, specs, redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1))


@pytest.mark.parametrize("n_model", [2, 1])
def test_fft_top_k_and_grouped_convs_train_as_on_one_device(model, n_model, devices):
    """Two SGD steps at data 4 x model 2 and at data 8 against one device's, every weight (the
    complex ones included); the step gathers no batch over ``data`` (before, each of the three did)."""
    batch, optimizer = data(), optax.sgd(0.05)
    _, _, state, run = compiled_train_step(model, loss_fn, batch, n_model, optimizer, loss_fn=loss_fn, batch=batch)
    assert batch_gathers(run.partitioned) == []
    mesh1, specs1, state1 = one_device(model, optimizer, devices)
    step1 = redeqx.make_train_step(loss_fn, optimizer, mesh1, specs1)
    for _ in range(2):
        state, metrics = run(state, batch)
        state1, metrics1 = step1(state1, batch)
        np.testing.assert_allclose(metrics["loss"], metrics1["loss"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(state.model), jax.tree.leaves(state1.model)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6)


def test_eval_predict_and_make_step_run_them_per_data_shard(model, devices):
    """The eval and predict steps and a `make_step` (whose program differentiates already: the
    backward FFTs and convolutions are rewritten too) equal one device's, gathering no batch."""
    batch, optimizer = data(), optax.sgd(0.05)
    mesh = redeqx.make_mesh(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        specs = redeqx.sharding_rules(model, mesh, loss_fn=loss_fn, batch=batch)
    mesh1, specs1, _ = one_device(model, optimizer, devices)
    placed = redeqx.shard(model, specs, mesh)
    key = jax.random.key(3)

    def grads(model, batch):
        return eqx.filter_grad(lambda m: loss_fn(m, batch, key)[0])(model), {}

    for make, args in ((lambda m, s: redeqx.make_eval_step(loss_fn, m, s), lambda m: (batch, key)),
                       (lambda m, s: redeqx.make_predict_step(pred_fn, m, s), lambda m: (batch, key)),
                       (lambda m, s: redeqx.make_step(grads, m, donate=False), lambda m: (over_data(batch, m),))):
        step, step1 = make(mesh, specs), make(mesh1, specs1)
        assert batch_gathers(partitioned_text(step, placed, *args(mesh))) == []
        for a, b in zip(jax.tree.leaves(step(placed, *args(mesh))), jax.tree.leaves(step1(model, *args(mesh1)))):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_which_operations_run_per_shard_by_platform():
    """FFTs and top_k on every platform; a grouped, not depthwise, convolution on CPUs and GPUs
    (libtpu partitions it itself, and its peak memory rose in a shard_map: benchmarks/per_shard_ops.py)."""
    from redeqx.steps._per_shard import _across

    def eqn(f, *shapes):
        (found,) = [e for e in jax.make_jaxpr(f)(*(jnp.zeros(s) for s in shapes)).jaxpr.eqns
                    if e.primitive.name in ("fft", "top_k", "conv_general_dilated", "jit")]
        return found.params["jaxpr"].eqns[0] if found.primitive.name == "jit" else found

    def conv(groups):
        return eqn(lambda x, w: jax.lax.conv_general_dilated(x, w, (1,), "SAME", feature_group_count=groups),
                   (4, 8, 16), (8, 8 // groups, 3))

    fft, top_k = eqn(jnp.fft.rfft, (4, 8, 16)), eqn(lambda x: jax.lax.top_k(x, 2), (4, 8, 16))
    for platform in ("cpu", "gpu", "tpu"):
        assert _across(fft, platform) == (2,) and _across(top_k, platform) == (2,)
        assert _across(conv(1), platform) is None and _across(conv(8), platform) is None  # plain, depthwise
        assert _across(conv(2), platform) == (None if platform == "tpu" else (1, 2))


def test_top_k_sampling_in_a_predict_step_runs_per_data_shard(devices):
    """`models.generate` as a ``pred_fn``: its sampler's ``top_k`` over each token's logits ran on
    the whole batch on every device, gathering ``(batch, vocab)`` logits every new token. The tokens
    are one device's."""
    from redeqx import models

    config = models.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2)
    model = models.LlamaForCausalLM(config, key=jax.random.key(0))

    def pred_fn(model, batch, key):
        return models.generate(model, batch["ids"], max_new_tokens=3, sampler=models.sample(0.8, top_k=5), key=key)

    batch, key = {"ids": np.random.default_rng(0).integers(0, 128, (ROWS, 6)).astype(np.int32)}, jax.random.key(1)
    tokens = []
    for mesh in (redeqx.make_mesh(2), redeqx.make_mesh(1, devices=devices[:1])):
        specs = redeqx.sharding_rules(model, mesh)
        step, placed = redeqx.make_predict_step(pred_fn, mesh, specs), redeqx.shard(model, specs, mesh)
        if mesh.shape["data"] > 1:
            assert batch_gathers(partitioned_text(step, placed, batch, key)) == []
        tokens.append(np.asarray(step(placed, batch, key)))
    np.testing.assert_array_equal(*tokens)


def test_a_loss_that_checks_its_batch_size_still_runs(model):
    """The rewrite traces ``loss_fn`` on half the batch to find the rows; a loss that refuses any
    other size gets its program as the partitioner has it, not an error."""

    def strict(model, batch, key):
        if batch["x"].shape[0] != ROWS:
            raise ValueError(f"expected {ROWS} rows")
        return loss_fn(model, batch, key)

    mesh = redeqx.make_mesh(2)
    specs = redeqx.sharding_rules(model, mesh)
    state = redeqx.init_state(model, optax.sgd(0.05), mesh, specs, key=jax.random.key(1))
    _, metrics = redeqx.make_train_step(strict, optax.sgd(0.05), mesh, specs)(state, data())
    assert np.isfinite(metrics["loss"])


class ConvNet(eqx.Module):
    """Pointwise, ``groups=2`` and depthwise convolutions, for gradients taken per example."""

    convs: list
    head: eqx.nn.Linear

    def __init__(self, key):
        ks = jax.random.split(key, 4)
        self.convs = [eqx.nn.Conv1d(2, WIDTH, 1, key=ks[0]),
                      eqx.nn.Conv1d(WIDTH, WIDTH, 3, padding=1, groups=2, key=ks[1]),
                      eqx.nn.Conv1d(WIDTH, WIDTH, 3, padding=1, groups=WIDTH, key=ks[2])]
        self.head = eqx.nn.Linear(WIDTH, 1, key=ks[3])

    def __call__(self, x):  # (2, N) -> ()
        for conv in self.convs:
            x = jnp.tanh(conv(x))
        return self.head(x.mean(1))[0]


def example_loss(model, x, y):
    return (model(x) - y) ** 2


def smoothed_loss(model, batch, key):
    """A loss that differentiates inside itself: the eval step runs it per example."""
    mse = lambda m: jnp.mean(jax.vmap(lambda x, y: example_loss(m, x, y))(batch["x"], batch["y"]))
    loss, grads = eqx.filter_value_and_grad(mse)(model)
    return loss + 0.1 * sum(jnp.sum(g ** 2) for g in jax.tree.leaves(grads))


def dp_step(model, batch):
    """DP-SGD's clipped per-example gradients, summed (no noise: compared with one device)."""
    grads = jax.vmap(eqx.filter_grad(example_loss), in_axes=(None, 0, 0))(model, batch["x"], batch["y"])
    norms = jnp.sqrt(sum(jnp.sum(g.reshape(len(g), -1) ** 2, axis=1) for g in jax.tree.leaves(grads)))
    scale = jnp.minimum(1.0, 1.0 / norms)
    return jax.tree.map(lambda g: jnp.tensordot(scale, g, axes=1), grads), {}


def test_a_convolutions_gradient_per_example_compiles_and_is_one_devices(devices):
    """``jax.vmap`` makes a convolution's weight gradient per example one convolution grouped by
    example, which XLA:CPU's and XLA:GPU's partitioner aborted the process compiling (``free():
    invalid pointer``) on a mesh of ``data`` and ``model``: an eval step of a loss that takes a
    gradient inside, and DP-SGD's per-example gradients in a `make_step` (for a 1 x 1 kernel; a wider
    one compiled). Both now equal one device's."""
    model, batch, key = ConvNet(jax.random.key(0)), data(), jax.random.key(3)
    mesh, mesh1 = redeqx.make_mesh(2), redeqx.make_mesh(1, devices=devices[:1])
    specs, specs1 = redeqx.sharding_rules(model, mesh), redeqx.sharding_rules(model, mesh1)
    placed = redeqx.shard(model, specs, mesh)
    got = redeqx.make_eval_step(smoothed_loss, mesh, specs)(placed, batch, key)
    want = redeqx.make_eval_step(smoothed_loss, mesh1, specs1)(model, batch, key)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
    got = redeqx.make_step(dp_step, mesh, donate=False)(placed, over_data(batch, mesh))[0]
    want = redeqx.make_step(dp_step, mesh1, donate=False)(model, batch)[0]
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def scored_loss(model, batch, key):
    """A loss that takes each example's gradient (its norms, a penalty): the train step differentiates
    a per-example weight gradient."""
    grads = jax.vmap(eqx.filter_grad(example_loss), in_axes=(None, 0, 0))(model, batch["x"], batch["y"])
    penalty = sum(jnp.sum(g ** 2) for g in jax.tree.leaves(grads)) / len(batch["x"])
    return jnp.mean((jax.vmap(model)(batch["x"]) - batch["y"]) ** 2) + 0.1 * penalty


@pytest.mark.parametrize("how", ["plain", "accumulate", "shard_mean_loss", "remat"])
def test_a_loss_taking_per_example_gradients_trains_as_on_one_device(how, devices):
    """With ``accumulate`` and ``shard_mean_loss`` the first call's check runs the loss too; under
    `redeqx.remat` on CPU its blocks' recomputation traced them again as written: each aborted the
    compile at data 4 x model 2 until they ran per data shard as the step does."""
    model, batch, optimizer = ConvNet(jax.random.key(0)), data(), optax.sgd(0.01)
    loss = redeqx.remat(scored_loss) if how == "remat" else scored_loss
    options = {"accumulate": {"accumulate": 2}, "shard_mean_loss": {"shard_mean_loss": True}}.get(how, {})
    models = []
    for mesh in (redeqx.make_mesh(2), redeqx.make_mesh(1, devices=devices[:1])):
        specs = redeqx.sharding_rules(model, mesh)
        state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1))
        models.append(redeqx.make_train_step(loss, optimizer, mesh, specs, **options)(state, batch)[0].model)
    for a, b in zip(jax.tree.leaves(models[0]), jax.tree.leaves(models[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
