"""``lax.top_k`` along the features a layer splits: a TopK sparse autoencoder keeps the k largest
of its latents. This JAX's partitioner gathers the latents whole to pick them, so the rules keep
the encoder's split (its decoder the row partner) and weigh that gather against the pair whole.
Read as an op that needs the whole dim, top_k kept the encoder whole, and the decoder, its
reconstruction's sum over features read as a head's, split on its output: 1.89x / 1.83x a hand
plan's collective bytes at 2 / 4 shards, more than all whole (128 -> 2048 latents, 256 rows)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import redeqx
from accelerator_count import compiled_train_step, trained_against_one_device

RNG = np.random.default_rng(0)


class SAE(eqx.Module):
    W_enc: jax.Array
    b_enc: jax.Array
    W_dec: jax.Array
    b_dec: jax.Array

    def __init__(self, key, d=32, latents=256):
        k = jax.random.split(key)
        self.W_enc = jax.random.normal(k[0], (d, latents)) / np.sqrt(d)
        self.W_dec = jax.random.normal(k[1], (latents, d)) / np.sqrt(latents)
        self.b_enc, self.b_dec = jnp.zeros(latents), jnp.zeros(d)


def reconstruction(write, k=8):
    """The TopK autoencoder's loss, its latents written back by ``write(pre, values, indices)``."""
    def loss(model, batch, key):
        x = batch["x"]
        pre = (x - model.b_dec[None]) @ model.W_enc + model.b_enc[None]
        values, indices = jax.lax.top_k(pre, k)
        latents = write(pre, jax.nn.relu(values), indices)
        return jnp.mean(jnp.sum((latents @ model.W_dec + model.b_dec[None] - x) ** 2, -1))
    return loss


WRITES = {  # as TopK autoencoders write their latents back
    "rows": lambda pre, v, i: jnp.zeros_like(pre).at[jnp.arange(pre.shape[0])[:, None], i].set(v),
    "vmap": lambda pre, v, i: jax.vmap(lambda p, v, i: jnp.zeros_like(p).at[i].set(v))(pre, v, i),
    "mask": lambda pre, v, i: jnp.where(pre >= v[:, -1:], jax.nn.relu(pre), 0.0),
}
ROWS = {"x": RNG.normal(size=(16, 32)).astype(np.float32)}
HAND = [("W_enc", P(None, "model")), ("b_enc", P("model")), ("W_dec", P("model", None)), (".", P())]


@pytest.mark.parametrize("write", list(WRITES))
def test_the_top_k_latents_keep_the_encoders_split(write):
    model, mesh = SAE(jax.random.key(0)), redeqx.make_mesh(2)
    specs = redeqx.sharding_rules(model, mesh, loss_fn=reconstruction(WRITES[write]), batch=ROWS)
    table = redeqx.explain(model, specs, mesh, loss_fn=reconstruction(WRITES[write]), batch=ROWS)
    assert (specs.W_enc, specs.b_enc, specs.W_dec) == (P(None, "model"), P("model"), P("model", None)), table


def test_it_trains_as_one_device_at_the_hand_plans_bytes(devices):
    model, loss = SAE(jax.random.key(0)), reconstruction(WRITES["vmap"])
    moved, _ = trained_against_one_device(model, loss, ROWS, devices)
    by_hand, *_ = compiled_train_step(model, loss, ROWS, 2, optax.sgd(0.1), overrides=HAND)
    assert moved == by_hand, (moved, by_hand)


def test_a_narrow_autoencoder_over_many_rows_is_kept_whole():
    """Gathering 4,096 rows of 64 latents a step costs more than the pair's gradients and FLOPs
    whole save (a probe at 16 -> 256 latents over 4,096 rows: split, 1.28 MB a step at 2 shards;
    whole, 34 kB)."""
    model, mesh = SAE(jax.random.key(0), 8, 64), redeqx.make_mesh(2)
    rows = {"x": RNG.normal(size=(4096, 8)).astype(np.float32)}
    loss = reconstruction(WRITES["vmap"])
    specs = redeqx.sharding_rules(model, mesh, loss_fn=loss, batch=rows)
    table = redeqx.explain(model, specs, mesh, loss_fn=loss, batch=rows)
    assert (specs.W_enc, specs.W_dec) == (P(), P()), table
    encoder = next(line for line in table.splitlines() if line.startswith("W_enc"))
    assert "less a step than split" in encoder, table  # (the pair weighed, not a rival's split chosen)
