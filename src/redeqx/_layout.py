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
- ``"auto"`` (the default): ``"sequence"``, except on blocks that
  `redeqx.remat` or `redeqx.checkpoint` rematerialises, which stay unpinned.

Only 2-D floating activations whose token count ``n_model_shards`` divides
are pinned (a per-example residual stream under ``jax.vmap``); models from
`redeqx.models` are left alone (they pin their own layout).

Why "auto" is that (benchmarks/layout.py, benchmarks/RESULTS.md, the GPT-style
user model of tests/user_gpt.py, 16-64 sequences per data shard):
- without remat, sequence pins made the step 9 % (K=2) and 23 % (K=4) faster
  in wall and CPU time, cut the compiled step's temporaries by 12 % and 26 %,
  and moved fewer bytes; counted as XLA:GPU/TPU move them
  (`redeqx._hlo.accelerator_collectives`) they stay within 1.22x the
  Megatron plan's bytes (tests/test_collectives.py);
- under `redeqx.remat` the same pins about doubled the temporaries (209 -> 406
  MiB at K=2, 141 -> 404 MiB at K=4): GSPMD lays out the recomputed block
  around the pinned tokens and keeps more of it alive, undoing what remat is
  for. Rematerialised blocks therefore keep GSPMD's own layout under "auto";
  an explicit ``"sequence"`` still pins them.
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
            "users' repeated blocks sequence-parallel unless they are rematerialised, None leaves activations "
            "to GSPMD."
        )


def _pin(x, spec: P, n_model: int):
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating) and x.ndim == 2 and x.shape[0] % n_model == 0:
        return constrain(x, spec)
    return x


@functools.lru_cache(maxsize=None)
def _pinned(cls, layout: str, n_model: int):
    """A subclass of block class ``cls`` (same fields, paths and specs) whose
    call pins its first argument and the output of the same shape.
    ``_pinned_as`` records ``(cls, layout, n_model)`` for `redeqx.remat`."""
    spec = P() if layout == "replicated" else P(MODEL, None)

    def __call__(self, x, *args, **kwargs):
        x = _pin(x, spec, n_model)
        out = cls.__call__(self, x, *args, **kwargs)
        if isinstance(out, tuple) and out and getattr(out[0], "shape", None) == getattr(x, "shape", ()):
            return (_pin(out[0], spec, n_model), *out[1:])
        if getattr(out, "shape", None) == getattr(x, "shape", ()):
            return _pin(out, spec, n_model)
        return out

    return type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                        "__qualname__": cls.__qualname__, "_pinned_as": (cls, layout, n_model)})


def resolve(activation_layout, n_model: int) -> str | None:
    """The layout a step uses: none on one model shard (nothing to split)."""
    if n_model == 1:
        return None
    return activation_layout


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
