"""Activation layout for users' models: pins at repeated-block boundaries.

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
  (Megatron's sequence parallelism). Inside the block GSPMD gathers the tokens
  for the column-parallel matmuls and reduce-scatters after the row-parallel
  ones: the same bytes as Megatron's all-reduces, and the per-token work
  between blocks done once instead of ``n_model_shards`` times.
- ``"replicated"``: the same points pinned whole on every ``model`` device
  (Megatron without sequence parallelism).
- ``None``: no pins; GSPMD decides alone.

Only 2-D floating activations whose token count ``n_model_shards`` divides
are pinned (a per-example residual stream under ``jax.vmap``); models from
`redeqx.models` are left alone (they pin their own layout).
"""

from __future__ import annotations

import functools
from typing import Literal

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
            f"activation_layout must be one of {LAYOUTS}, got {activation_layout!r}: 'auto' (the default) pins "
            "users' repeated blocks sequence-parallel, None leaves activations to GSPMD."
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


# What "auto" means, decided on measurements (benchmarks/vs_redco.py and the compiled
# programs' own figures, benchmarks/RESULTS.md): on the GPT-style user model GSPMD alone
# already moves Megatron's all-reduces, while sequence pins at block boundaries made it
# gather weights and activations (a third more bytes at n_model_shards=2) and kept remat
# from saving memory. So "auto" leaves users' blocks unpinned until a layout measures better.
AUTO = None


def resolve(activation_layout, n_model: int) -> str | None:
    """The layout a step uses: none on one model shard (nothing to split)."""
    if n_model == 1 or activation_layout is None:
        return None
    return AUTO if activation_layout == "auto" else activation_layout


def apply_layout(model, layout: str | None, n_model: int):
    """``model`` with its repeated blocks pinned as ``layout`` says."""
    if layout is None:
        return model

    def swap(x):
        if not _is_repeated_blocks(x) or type(x[0]).__module__.startswith("redeqx.models"):
            return x
        blocks = [_as(_pinned(type(b), layout, n_model), b) for b in x]
        return type(x)(blocks)

    return jax.tree.map(swap, model, is_leaf=_is_repeated_blocks)
