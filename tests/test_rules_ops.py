"""Ops the program reader follows, beyond a layer's products: one weight used twice, a kernel
flipped, any elementwise function, rows written whole, and an FFT, which stops a split.

A tied autoencoder's decoder multiplies by the encoder's matrix transposed (``h @ W.T``, or
``h @ enc.weight`` with an ``eqx.nn.Linear``), and a tied conv autoencoder's ``conv_transpose``
flips the encoder's kernel (``jax.lax.rev``). The decoder contracts the hidden units the encoder's
split gives it, on the dim of ``W`` the encoder splits: it is that split's row partner, so ``W`` is
split once, column and row at the same time, as a hand plan splits it. Before, the decoder's own
output (whole, for the loss) kept every use of ``W`` whole: 2.0x / 3.9x the hand plan's collective
bytes at 2 / 4 shards, every device holding and multiplying all of ``W``. A kernel flipped read as
an unknown op: a depthwise causal conv written with ``jnp.convolve`` (a Hyena- or Mamba-style
mixer) left its whole block replicated, 1.5x / 1.8x the hand plan's bytes
(benchmarks/plans_vs_hand.py). A weight applied twice on the same side (``l(l(x))``) still cannot
split one way for both uses, and says so."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import redeqx
from accelerator_count import compiled_train_step, trained_against_one_device


class TiedAE(eqx.Module):
    """Raw arrays: ``x @ W`` in, ``h @ W.T`` out."""

    w: jax.Array
    b: jax.Array
    c: jax.Array

    def __init__(self, key, d=64, hidden=256):
        self.w = jax.random.normal(key, (d, hidden)) / jnp.sqrt(d)
        self.b, self.c = jnp.zeros(hidden), jnp.zeros(d)

    def __call__(self, x):
        return jax.nn.relu(x @ self.w + self.b) @ self.w.T + self.c


class TiedLinearAE(eqx.Module):
    """An ``eqx.nn.Linear`` encoder whose ``(out, in)`` weight decodes: ``h @ enc.weight``."""

    enc: eqx.nn.Linear
    dec_bias: jax.Array

    def __init__(self, key):
        self.enc, self.dec_bias = eqx.nn.Linear(64, 256, key=key), jnp.zeros(64)

    def __call__(self, x):
        return jax.nn.relu(self.enc(x)) @ self.enc.weight + self.dec_bias


class TiedConvAE(eqx.Module):
    """A conv encoder and the transposed conv of the same kernel (OIHW) decoding."""

    k: jax.Array

    def __init__(self, key):
        self.k = jax.random.normal(key, (256, 64, 3, 3)) * 0.05

    def __call__(self, x):  # (64, H, W)
        h = jax.nn.relu(jax.lax.conv_general_dilated(x[None], self.k, (1, 1), "SAME"))
        return jax.lax.conv_transpose(h, self.k, (1, 1), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW"),
                                      transpose_kernel=True)[0]


class ConvolveMixer(eqx.Module):
    """A projection up, a causal depthwise conv per channel with ``jnp.convolve`` (which flips the
    filter), a projection down into the residual stream, and an LM head."""

    emb: eqx.nn.Embedding
    inp: eqx.nn.Linear
    filt: jax.Array
    out: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 5)
        self.emb, self.inp = eqx.nn.Embedding(64, 128, key=k[0]), eqx.nn.Linear(128, 512, key=k[1])
        self.filt = jax.random.normal(k[2], (512, 4)) * 0.3
        self.out, self.head = eqx.nn.Linear(512, 128, key=k[3]), eqx.nn.Linear(128, 64, key=k[4])

    def __call__(self, tokens):
        x = jax.vmap(self.emb)(tokens)
        h = jax.vmap(self.inp)(x)
        n = h.shape[0]
        h = jax.vmap(lambda c, f: jnp.convolve(c, f)[:n], in_axes=(1, 0), out_axes=1)(h, self.filt)
        return jax.vmap(self.head)(x + jax.vmap(self.out)(jax.nn.silu(h)))


class Twice(eqx.Module):
    l: eqx.nn.Linear

    def __init__(self, key):
        self.l = eqx.nn.Linear(64, 64, key=key)

    def __call__(self, x):
        return self.l(jax.nn.relu(self.l(x)))


def mse(model, batch, key):
    return jnp.mean((jax.vmap(model)(batch["x"]) - batch["x"]) ** 2)


def lm_loss(model, batch, key):
    logits = jax.vmap(model)(batch["t"][:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["t"][:, 1:]).mean()


RNG = np.random.default_rng(0)
VECTORS = {"x": RNG.normal(size=(16, 64)).astype(np.float32)}
IMAGES = {"x": RNG.normal(size=(16, 64, 8, 8)).astype(np.float32)}
TOKENS = {"t": RNG.integers(0, 64, (16, 17))}


def _specs(model, loss, batch, n=2):
    mesh = redeqx.make_mesh(n)
    specs = redeqx.sharding_rules(model, mesh, loss_fn=loss, batch=batch)
    return specs, redeqx.explain(model, specs, mesh, loss_fn=loss, batch=batch)


def _row(table: str, path: str) -> str:
    return next(line for line in table.splitlines() if line.startswith(path + " "))


def test_a_tied_matrix_is_split_once_column_and_row():
    for n in (2, 4):
        specs, table = _specs(TiedAE(jax.random.key(0)), mse, VECTORS, n)
        assert (specs.w, specs.b, specs.c) == (P(None, "model"), P("model"), P()), specs
        assert "column and row parallel, dim 1" in _row(table, "w"), table
    specs, table = _specs(TiedLinearAE(jax.random.key(0)), mse, VECTORS)
    assert (specs.enc.weight, specs.enc.bias, specs.dec_bias) == (P("model", None), P("model"), P()), specs
    assert "column and row parallel, dim 0" in _row(table, "enc.weight"), table


def test_a_kernel_flipped_by_conv_transpose_or_jnp_convolve_is_still_the_weight():
    specs, table = _specs(TiedConvAE(jax.random.key(0)), mse, IMAGES)
    assert specs.k == P("model", None, None, None), table
    specs, table = _specs(ConvolveMixer(jax.random.key(0)), lm_loss, TOKENS)
    assert (specs.inp.weight, specs.filt, specs.out.weight) == (P("model", None), P("model", None),
                                                                P(None, "model")), table


def test_two_uses_that_need_two_splits_stay_whole_and_say_so():
    specs, table = _specs(Twice(jax.random.key(0)), mse, VECTORS)
    assert specs.l.weight == P() and "split on dims 0 and 1" in _row(table, "l.weight"), table
    flipped = Between(lambda h: jnp.flip(jax.nn.relu(h), -1), jax.random.key(0))  # halves would trade devices
    specs, table = _specs(flipped, mse, VECTORS)
    assert specs.up.weight == P() and "jnp.flip reverses its output features" in _row(table, "up.weight"), table


def test_a_tied_autoencoder_trains_as_one_device_at_the_hand_plans_bytes(devices):
    """Against one device; the bytes against the same model with ``W`` whole (the plan before)."""
    model = TiedAE(jax.random.key(0))
    moved, _ = trained_against_one_device(model, mse, VECTORS, devices)
    whole, *_ = compiled_train_step(model, mse, VECTORS, 2, optax.sgd(0.1), overrides=[(".", P())])
    assert moved < 0.55 * whole, (moved, whole)

class Between(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    f: object = eqx.field(static=True)

    def __init__(self, f, key):
        k1, k2 = jax.random.split(key)
        self.up, self.down, self.f = eqx.nn.Linear(64, 256, key=k1), eqx.nn.Linear(256, 64, key=k2), f

    def __call__(self, x):  # (F,), or (T, F) rows
        return jax.vmap(self.down)(self.f(jax.vmap(self.up)(x))) if x.ndim == 2 else self.down(self.f(self.up(x)))


def test_any_elementwise_function_between_a_pair_keeps_it():
    """Hyperbolic and arc functions (a Poincare-ball layer's ``arctanh`` and ``arccosh``), the
    special functions: elementwise, so the pair stays column then row (once unknown ops)."""
    from jax.scipy import special

    for f in (jnp.arcsin, jnp.arccos, jnp.arctan, jnp.sinh, jnp.cosh, jnp.arcsinh, jnp.arccosh, jnp.arctanh,
              special.gammaln, special.digamma, special.i0e, special.i1e):
        specs, table = _specs(Between(f, jax.random.key(0)), mse, VECTORS)
        assert (specs.up.weight, specs.down.weight) == (P("model", None), P(None, "model")), (f, table)


def _fft_conv(h):  # a long convolution over time by FFT (Hyena's), h: (T, F)
    k = jnp.exp(-jnp.arange(h.shape[0], dtype=h.dtype))[:, None]
    n = 2 * h.shape[0]
    return jnp.fft.irfft(jnp.fft.rfft(h, n, axis=0) * jnp.fft.rfft(k, n, axis=0), n, axis=0)[:h.shape[0]]


def test_a_slice_written_whole_keeps_the_pair_and_an_fft_stops_it():
    """``lax.dynamic_update_slice`` of rows (a scatter under ``vmap``, whose indices start the feature
    dim at 0 too) writes each feature on its own device: the pair stays (it was read as a pick of
    the features: replicated, 1.8x / 2.7x the bytes at 2 / 4 shards). An FFT over time is run
    whole by the partitioner, which gathers the features first: split, the pair moved 1.3x / 1.9x
    the bytes of its layers whole, so they stay whole, said in `explain`."""
    def written(h):
        return jax.lax.dynamic_update_slice(h, 2 * h[:1], (0, 0))

    def rows_mse(model, batch, key):  # every row through the model at once: a dynamic_update_slice
        x = batch["x"].reshape(-1, batch["x"].shape[-1])
        return jnp.mean((model(x) - x) ** 2)

    tokens = {"x": np.zeros((8, 16, 64), np.float32)}
    for loss in (mse, rows_mse):
        specs, table = _specs(Between(written, jax.random.key(0)), loss, tokens)
        assert (specs.up.weight, specs.down.weight) == (P("model", None), P(None, "model")), table
    specs, table = _specs(Between(_fft_conv, jax.random.key(0)), mse, tokens)
    assert specs.up.weight == P() and "FFT" in _row(table, "up.weight"), table


class OneHotTiedLM(eqx.Module):
    """Tokens embedded by a one-hot product (``one_hot(t) @ emb``, as TPU code often does), a
    residual MLP, logits against the same table (``x @ emb.T``)."""

    emb: jax.Array
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key, vocab=1024, width=256):
        k = jax.random.split(key, 3)
        self.emb = jax.random.normal(k[0], (vocab, width)) * 0.02
        self.up, self.down = eqx.nn.Linear(width, 4 * width, key=k[1]), eqx.nn.Linear(4 * width, width, key=k[2])

    def __call__(self, tokens):
        x = jax.nn.one_hot(tokens, self.emb.shape[0], dtype=self.emb.dtype) @ self.emb
        return (x + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(x)))) @ self.emb.T


def test_a_one_hot_embedding_is_split_on_its_vocabulary_tied_or_not():
    """A product with a one-hot of the ids (``one_hot(t) @ emb``) is a lookup: split on the dim it
    contracts, priced as a table is (the rows it finds summed over ``model``; a tied head's logits
    come out split). The hand plan (the table on its vocabulary, Megatron's MLP) to the byte;
    before, the table stayed whole: 1.15x / 1.25x its bytes at 2 / 4 shards untied, 1.30x / 1.50x
    tied (benchmarks/plans_vs_hand.py). Tied, the table's two uses could also make it column and row
    parallel on the residual stream (embedding column, MLP row then column, head row: 1.40x /
    2.00x), which the pricing of a weight both column and row (all its outputs summed: the head's
    logits) refuses. A first layer's input made of other data is no table: it stays as it was."""
    tokens = {"t": RNG.integers(0, 1024, (16, 33))}
    for model in (OneHotTiedLM(jax.random.key(0)), OneHotLM(jax.random.key(0))):
        specs, table = _specs(model, lm_loss, tokens)
        assert (specs.emb, specs.up.weight, specs.down.weight) == (P("model", None), P("model", None),
                                                                  P(None, "model")), table
        assert "one-hot embedding, dim 0 (vocab)" in _row(table, "emb"), table
    assert specs.head == P("model", None), table


class OneHotLM(OneHotTiedLM):
    head: jax.Array

    def __init__(self, key):
        super().__init__(key)
        self.head = jax.random.normal(jax.random.fold_in(key, 1), self.emb.shape) * 0.02

    def __call__(self, tokens):
        x = jax.nn.one_hot(tokens, self.emb.shape[0], dtype=self.emb.dtype) @ self.emb
        return (x + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(x)))) @ self.head.T


def test_a_one_hot_embedding_trains_as_one_device(devices):
    _, specs = trained_against_one_device(OneHotTiedLM(jax.random.key(0), 128, 32), lm_loss, {"t": TOKENS["t"]},
                                           devices)
    assert specs.emb == P("model", None), specs
