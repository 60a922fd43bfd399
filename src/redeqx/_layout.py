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
from ._remat import _as, _is_repeated_blocks, _with_call

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

    return _with_call(cls, __call__)


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


_NORMS = (eqx.nn.LayerNorm, eqx.nn.RMSNorm)


@functools.lru_cache(maxsize=None)
def _recomputed(cls):
    """A subclass of norm class ``cls`` (same fields, paths and specs) whose
    plain call ``norm(x)`` is recomputed in the backward pass from its input
    (`jax.checkpoint`): the same function and the same gradient formula, but
    nothing of its inside is kept from the forward pass to the backward.

    Why: under ``jax.vmap`` (how an Equinox norm meets a batch) the per-token
    statistics and the norm's weight are broadcast to the activation's full
    shape, and autodiff keeps what the backward reads: the normalised input,
    the broadcasts and the output. XLA:CPU, from about 8192 tokens per device
    on, computes the norms' reductions in YNNPACK fusions that take those
    broadcasts materialised, so they are kept at full size: on the GPT-style
    user model of benchmarks/vs_redco.py at n_model_shards=4, 0.70 GiB of the
    1.44 GiB alive at the step's peak (Flax's LayerNorm in redco's program:
    0.09 GiB). Recomputing keeps only the input, which the residual stream
    holds anyway. Measured there (benchmarks/RESULTS.md): temporaries per
    device 0.94/1.12/1.47 -> 0.87/0.98/1.19 GiB at K=1/2/4, and at K=4 a
    step of 12.4-12.5 s instead of 14.6-16.0, since XLA:CPU allocates the
    temporaries afresh at every call and the kernel zero-fills each page on
    first touch (38 % of the worker's CPU samples were in the kernel, mostly
    page faults, against 18 % in redco's).
    ``prevent_cse`` (the default) keeps XLA from merging the recomputation
    back into the forward pass's values; without it nothing is saved.
    Only on `RECOMPUTE_NORMS_ON` (XLA:CPU): libtpu keeps no broadcasts, and
    there the recomputation only added temporaries."""
    base_call = cls.__call__

    def __call__(self, x, *args, key=None, **kwargs):  # Equinox's norms ignore `key`
        if args or kwargs:  # a state passed: Equinox's own call, unchanged
            return base_call(self, x, *args, key=key, **kwargs)
        return jax.checkpoint(base_call)(self, x)

    return _with_call(cls, __call__)


def _recomputed_norms(model):
    """Every layer of class exactly `eqx.nn.LayerNorm` or `eqx.nn.RMSNorm`
    computed as `_recomputed` says (a subclass is the user's own, called as it is)."""
    exact = lambda x: type(x) in _NORMS  # noqa: E731
    return jax.tree.map(lambda x: _as(_recomputed(type(x)), x) if exact(x) else x, model, is_leaf=exact)


# The platforms whose steps recompute the norms: where that was measured to pay. On XLA:CPU it
# took the vs_redco GPT's temporaries from 0.94/1.12/1.47 to 0.87/0.98/1.19 GiB at K=1/2/4; libtpu,
# which never materialises the norms' broadcasts, compiled the same steps with 1/7/38 % more
# temporaries and 4-9 % more bytes accessed (benchmarks/tpu_programs.py). XLA:GPU also fuses
# broadcasts into their consumers, so it is left out until measured there.
RECOMPUTE_NORMS_ON = frozenset({"cpu"})


def as_computed(model, platform: str):
    """``model`` as every step on ``platform`` computes it, whatever the
    layout: exact `eqx.nn.Linear` layers as `_RowsLinear`, and on
    `RECOMPUTE_NORMS_ON` exact Equinox norms recomputed in the backward pass
    (`_recomputed`). The same function, to float rounding."""
    model = _rows_linears(model)
    return _recomputed_norms(model) if platform in RECOMPUTE_NORMS_ON else model


def apply_layout(model, layout: str | None, mesh):
    """``model`` as a step on ``mesh`` computes it (`as_computed`), its
    repeated blocks pinned as ``layout`` says."""
    model = as_computed(model, mesh.devices.flat[0].platform)
    n_model = mesh.shape[MODEL]
    if layout is None:
        return model

    def swap(x):
        if not _is_repeated_blocks(x) or type(x[0]).__module__.startswith("redeqx.models"):
            return x
        blocks = [_as(_pinned(type(b), layout, n_model), b) for b in x]
        return type(x)(blocks)

    return jax.tree.map(swap, model, is_leaf=_is_repeated_blocks)
