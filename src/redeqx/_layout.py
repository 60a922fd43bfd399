"""How a step computes a user's model: activation pins at repeated-block
boundaries (``activation_layout``), and each exact `eqx.nn.Linear` computed as
``x @ W.T`` (`_RowsLinear`, the same function in the order XLA:CPU needs no
transposed copies for).

The sharding rules place parameters; GSPMD then lays out activations, and on
its own it keeps a transformer's residual stream whole on every ``model``
device, so the norms, residual adds and their backward run ``n_model_shards``
times over, and it sometimes gathers where Megatron would reduce. The zoo's
models pin their activations by hand (`redeqx.constrain`); a user's model gets
the same effect from this module, with no change to its code:

- ``"sequence"``: at the input and output of every block of a repeated stack
  (a list or tuple of two or more same-class modules holding two or more
  weight matrices, e.g. transformer layers), the per-example activation
  ``(tokens, features)`` is split over ``model`` on the token axis
  (as in Megatron's sequence parallelism), so the per-token work between
  blocks is done once instead of ``n_model_shards`` times. Inside the block
  GSPMD chooses whether to gather the tokens or the weights: on the measured
  GPT-style models it gathered every weight (see ``AUTO`` below).
- ``"replicated"``: the same points pinned whole on every ``model`` device
  (Megatron without sequence parallelism).
- ``None``: no pins; GSPMD decides alone. ``"auto"`` (the default) is this:
  see the measurements above ``AUTO`` below.

Only 2-D floating activations whose token count ``n_model_shards`` divides
are pinned (a per-example residual stream under ``jax.vmap``); models from
`redeqx.models` are left alone (they pin their own layout).
"""

from __future__ import annotations

import functools
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ._constrain import constrain
from ._mesh import MODEL
from ._remat import _as, _is_repeated_blocks

Layout = Literal["auto", "sequence", "replicated"] | None
LAYOUTS = ("auto", "sequence", "replicated", None)


def check_layout(activation_layout) -> None:
    if activation_layout not in LAYOUTS:
        raise ValueError(
            f"activation_layout must be one of {LAYOUTS}, got {activation_layout!r}: 'auto' (the default) and "
            "None leave activations to GSPMD, 'sequence' splits users' repeated blocks' inputs and outputs over "
            "'model' on the token axis, 'replicated' keeps them whole on every 'model' device."
        )


def _pin(x, spec: P, n_model: int):
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating) and x.ndim == 2 and x.shape[0] % n_model == 0:
        return constrain(x, spec)
    return x


@functools.lru_cache(maxsize=None)
def _pinned(cls, layout: str, n_model: int):
    """A subclass of block class ``cls`` (same fields, paths and specs) whose
    call pins its first argument and the output of the same shape."""
    spec = P(MODEL, None) if layout == "sequence" else P()

    def __call__(self, x, *args, **kwargs):
        x = _pin(x, spec, n_model)
        out = cls.__call__(self, x, *args, **kwargs)
        if isinstance(out, tuple) and out and getattr(out[0], "shape", None) == getattr(x, "shape", ()):
            return (_pin(out[0], spec, n_model), *out[1:])
        if getattr(out, "shape", None) == getattr(x, "shape", ()):
            return _pin(out, spec, n_model)
        return out

    return type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                        "__qualname__": cls.__qualname__})


# What "auto" means, decided on measurements (benchmarks/layout.py, the compiled programs' own
# figures; benchmarks/RESULTS.md) on the GPT-style user model of tests/user_gpt.py at 16-64
# sequences per data shard:
# - no pins: GSPMD alone moves the Megatron plan's bytes as XLA:GPU/TPU move them, but for the
#   tied embedding's gradient, reduced twice (1.02x at K=2, 1.01x at K=4, tests/test_collectives.py;
#   libtpu's own programs agree), and remat keeps its savings;
# - "sequence" pins make XLA:CPU steps 3-23 % faster, but GSPMD gets there by all-gathering
#   every weight of the block and computing each device's tokens with whole weights, not by
#   Megatron's sequence parallelism: 1.05-1.22x the Megatron bytes on an accelerator, whole
#   weights alive on every device (what n_model_shards exists to avoid in a large model), and
#   under redeqx.remat twice the temporaries (209 -> 406 MiB at K=2, 141 -> 404 MiB at K=4).
#   Pinning the column-parallel outputs as well (true Megatron-SP) made GSPMD add all-to-alls:
#   3.7x the bytes. So "auto" leaves users' blocks to GSPMD; "sequence" stays a choice.
AUTO = None


def resolve(activation_layout, n_model: int) -> str | None:
    """The layout a step uses: none on one model shard (nothing to split)."""
    if n_model == 1 or activation_layout is None:
        return None
    return AUTO if activation_layout == "auto" else activation_layout


class _RowsLinear(eqx.nn.Linear):
    """`eqx.nn.Linear` computing ``x @ W.T`` rather than ``W @ x``: the same
    function, fields, paths and specs. Under ``jax.vmap`` (how Equinox layers
    meet a batch) ``W @ x`` becomes ``dot_general(W, x)``, laid out
    ``(out, batch, tokens)``, then a transpose to ``(batch, tokens, out)``;
    XLA:CPU materialises that transpose and the ones of its backward (a
    transposed copy of every activation a linear layer reads or writes), while
    ``x @ W.T`` comes out of the dot in the order the model uses. Measured on
    the GPT-style user model (benchmarks/RESULTS.md): steps 1.17x (K=1) and
    1.24x (K=4) faster, the same collectives. Results agree to float rounding."""

    def __call__(self, x, *, key=None):
        if self.in_features == "scalar" or jnp.ndim(x) != 1:
            # anything but one example's feature vector (a scalar layer, a feature-major
            # (in, k) matrix that W @ x accepts) is Equinox's own call, unchanged
            return super().__call__(x, key=key)
        x = x @ self.weight.T
        if self.bias is not None:
            x = x + self.bias
        if self.out_features == "scalar":
            x = jnp.squeeze(x)
        return x


def _rows_linears(model):
    """Every layer of class exactly `eqx.nn.Linear` computed as `_RowsLinear`
    (a subclass, e.g. a LoRA layer, is the user's own and is called as it is)."""
    exact = lambda x: type(x) is eqx.nn.Linear  # noqa: E731
    return jax.tree.map(lambda x: _as(_RowsLinear, x) if exact(x) else x, model, is_leaf=exact)


def apply_layout(model, layout: str | None, n_model: int):
    """``model`` as a step computes it: its `eqx.nn.Linear` layers as
    `_RowsLinear` and its repeated blocks pinned as ``layout`` says."""
    model = _rows_linears(model)
    if layout is None:
        return model

    def swap(x):
        if not _is_repeated_blocks(x) or type(x[0]).__module__.startswith("redeqx.models"):
            return x
        blocks = [_as(_pinned(type(b), layout, n_model), b) for b in x]
        return type(x)(blocks)

    return jax.tree.map(swap, model, is_leaf=_is_repeated_blocks)
