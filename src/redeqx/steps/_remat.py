"""Rematerialisation: `remat` for a whole loss, `recomputed_call` for one call
inside it (and `checkpoint`, its deprecated public name).

Recomputing a block's activations in the backward pass, instead of keeping
them from the forward pass, trades about one more forward pass of compute for
the activation memory of every block but one. `remat(loss_fn)` does it for
any Equinox model without touching its code: each iteration of every
``jax.lax.scan`` in the loss (a stack of layers) and each block of a list of
repeated blocks is recomputed. `scans_keep_products` is what every train
step does to the scans of a loss by default: they keep only the results of
their non-elementwise operations.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable
from typing import Literal

import equinox as eqx
import jax
import jax.extend.core as jex

from ._cpu import on_cpu, tied_checkpoint
from .._rewrite import inner_jaxprs, rewritten
from .._typing import typechecked, warn_user

Keep = Literal["nothing", "dots"]

# Primitives whose results a scan's backward pass recomputes under
# keep="products": elementwise arithmetic and moves of data, cheap to redo
# from the values they read. Anything else (products, reductions, gathers,
# sorts, collectives, custom kernels, any primitive not named here) is kept.
_RECOMPUTED = frozenset("""
    abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp conj convert_element_type copy cos cosh
    div eq erf erf_inv erfc exp exp2 expm1 floor ge gt imag integer_pow is_finite le log log1p logistic lt max
    min mul ne neg nextafter not or pow real reduce_precision rem round rsqrt select_n shift_left
    shift_right_arithmetic shift_right_logical sign sin sinh sqrt square sub tan tanh xor
    broadcast_in_dim concatenate expand_dims iota pad reshape rev slice squeeze transpose
""".split())


def _products_saveable(prim, *_, **__) -> bool:
    return prim.name not in _RECOMPUTED


_POLICIES = {"nothing": None, "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def _check_keep(keep) -> None:
    if keep not in _POLICIES:
        raise ValueError(
            f"keep={keep!r}: say what the forward pass keeps for the backward pass: 'nothing' (recompute "
            "everything from the block's input) or 'dots' (keep matrix products without batch dims, "
            "jax.checkpoint_policies.dots_with_no_batch_dims_saveable; recompute the rest)."
        )


def recomputed_call(fn: Callable, *, keep: Keep = "nothing") -> Callable:
    """``fn`` whose intermediate values are recomputed in the backward pass:
    only its array inputs (and, with ``keep="dots"``, its matrix products
    without batch dims) are kept from the forward pass. ``fn``'s non-array
    arguments are constants; when ``fn`` is a module its arrays are inputs.

    It is ``jax.checkpoint``; on CPU with ``keep="nothing"`` the
    recomputation is also tied to the incoming gradient, since XLA:CPU would
    otherwise merge it back into the forward pass (`redeqx.steps._cpu`).
    """
    _check_keep(keep)

    @functools.wraps(fn)
    def recomputed(*args, **kwargs):
        if keep == "nothing" and on_cpu() and not _PLAIN.get():
            return tied_checkpoint(fn)(*args, **kwargs)
        call = eqx.filter_checkpoint(lambda f, *a, **k: f(*a, **k), policy=_POLICIES[keep])
        return call(fn, *args, **kwargs)

    return recomputed


_PLAIN = contextvars.ContextVar("plain_checkpoints", default=False)


@contextlib.contextmanager
def plain_checkpoints():
    """Within it `recomputed_call` is ``jax.checkpoint`` on CPU too: for a rewrite that traces a loss
    and evaluates its equations again (`redeqx.steps._fp8`, `redeqx.steps._per_shard`), which sees into
    a ``checkpoint`` and cannot see into the CPU's tied ``custom_vjp`` (whose backward pass would
    recompute the body as it was). On CPU, the step then recomputes nothing (XLA:CPU merges the
    recomputation back)."""
    token = _PLAIN.set(True)
    try:
        yield
    finally:
        _PLAIN.reset(token)


CHECKPOINT_DEPRECATED = (
    "redeqx.checkpoint is deprecated and goes in the next release (a checkpoint in redeqx is one on disk): "
    "use redeqx.remat(loss_fn), which recomputes every layer of a loss, stacked or listed, without touching the "
    "model's code; for one call of your own, eqx.filter_checkpoint(fn)."
)


@typechecked
def checkpoint(fn: Callable, *, keep: Keep = "nothing") -> Callable:
    """Deprecated (it goes in the next release): use `remat` on the loss.
    ``fn`` whose intermediate values are recomputed in the backward pass, as
    before, with a ``DeprecationWarning``.

    **Example:**

    ```python
    train_step = redeqx.make_train_step(redeqx.remat(loss_fn), optimizer, mesh, specs)
    ```
    """
    warn_user(CHECKPOINT_DEPRECATED, DeprecationWarning)
    return recomputed_call(fn, keep=keep)


# ----------------------------------------------------------------------------- blocks in a list


def _is_block(x) -> bool:
    """An Equinox module with at least two weight matrices (a transformer
    block, a residual stage), not a single layer."""
    if not isinstance(x, eqx.Module) or not callable(x):
        return False
    return sum(1 for a in jax.tree.leaves(x) if eqx.is_array(a) and a.ndim >= 2) >= 2


def is_repeated_blocks(x) -> bool:
    """A list or tuple of at least two blocks of one class."""
    return (isinstance(x, (list, tuple)) and len(x) >= 2 and all(_is_block(b) for b in x)
            and len({type(b) for b in x}) == 1)


class Recomputed(eqx.Module):
    """A block as `remat` hands it to the loss: called, it runs the block
    under `recomputed_call`; any other attribute is the block's own."""

    block: eqx.Module
    keep: Keep = eqx.field(static=True)

    def __call__(self, *args, **kwargs):
        return recomputed_call(self.block, keep=self.keep)(*args, **kwargs)

    def __getattr__(self, name):
        if name in ("block", "keep") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.block, name)


def _recomputed_blocks(model, keep: Keep):
    def wrap(x):
        if not is_repeated_blocks(x):
            return x
        return type(x)(Recomputed(b, keep) for b in x)

    return jax.tree.map(wrap, model, is_leaf=is_repeated_blocks)


# ----------------------------------------------------------------------------- scans


def _sub_jaxpr_params(eqn) -> list[str]:
    """The params of ``eqn`` holding a closed jaxpr that `remat` looks into:
    a jitted or named call's body (a scan's is handled apart)."""
    if eqn.primitive.name in ("pjit", "jit", "closed_call", "core_call"):
        return [name for name in ("jaxpr", "call_jaxpr") if isinstance(eqn.params.get(name), jex.ClosedJaxpr)]
    return []


def _checkpoints(jaxpr: jex.Jaxpr) -> bool:
    """Whether ``jaxpr`` runs a ``jax.checkpoint`` anywhere: its author has
    said what its backward pass keeps."""
    return any(eqn.primitive.name in ("remat2", "checkpoint") or any(map(_checkpoints, inner_jaxprs(eqn)))
               for eqn in jaxpr.eqns)


def _avals(closed):
    return [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False)) for a in closed.in_avals]


def _recomputed_scans(closed: jex.ClosedJaxpr, policy, leave_checkpointed: bool) -> tuple[jex.ClosedJaxpr, int]:
    """``closed`` with the body of every scan in it (and in the calls it
    makes) under ``jax.checkpoint``, and how many scans that was; with
    ``leave_checkpointed``, a scan whose body already checkpoints is left
    as it is."""
    eqns, found = [], 0
    for eqn in closed.jaxpr.eqns:
        if eqn.primitive.name == "scan" and not (leave_checkpointed and _checkpoints(eqn.params["jaxpr"].jaxpr)):
            body, inner = _recomputed_scans(eqn.params["jaxpr"], policy, leave_checkpointed)
            run = jax.checkpoint(jex.jaxpr_as_fun(body), policy=policy, prevent_cse=True)
            eqn = eqn.replace(params={**eqn.params, "jaxpr": jax.make_jaxpr(run)(*_avals(body))})
            found += 1 + inner
        else:
            for name in _sub_jaxpr_params(eqn):
                sub, inner = _recomputed_scans(eqn.params[name], policy, leave_checkpointed)
                if inner:
                    eqn = eqn.replace(params={**eqn.params, name: sub})
                    found += inner
        eqns.append(eqn)
    return jex.ClosedJaxpr(closed.jaxpr.replace(eqns=eqns), closed.consts), found


def recompute_scans(fn: Callable, keep: Keep = "nothing") -> Callable:
    """``fn`` (of arrays and constants) with every ``jax.lax.scan`` it runs
    recomputing each iteration in the backward pass: the forward pass keeps
    only each iteration's carry (and its dots, with ``keep="dots"``)."""
    return rewritten(fn, lambda closed: _recomputed_scans(closed, _POLICIES[keep], leave_checkpointed=False)[0])


ScanResiduals = Literal["products", "all"]


def keep_products(closed: jex.ClosedJaxpr) -> jex.ClosedJaxpr:
    """`scans_keep_products` as a rewrite of a traced program."""
    return _recomputed_scans(closed, _products_saveable, leave_checkpointed=True)[0]


def scans_keep_products(fn: Callable) -> Callable:
    """``fn`` whose ``jax.lax.scan`` s keep, for the backward pass, the results
    of their non-elementwise operations (matrix products, reductions,
    gathers, collectives, custom kernels) and recompute the elementwise ones
    (activations, norms' scalings, softmax's exponentials) from them.

    Left alone, JAX's scan keeps every intermediate its body's derivative
    reads: a GELU alone keeps six arrays the size of its input per layer,
    which a compiler fuses away in the same layers unrolled but cannot
    across a loop's iterations. This is what `make_train_step`'s
    ``scan_residuals="products"`` applies to ``loss_fn``; a scan whose body
    already runs ``jax.checkpoint`` (``redeqx.remat``, or the user's own)
    is left as written. Values and gradients do not change.
    """
    return rewritten(fn, keep_products)


# ----------------------------------------------------------------------------- remat


@typechecked
def remat(loss_fn: Callable, *, keep: Keep = "nothing") -> Callable:
    """``loss_fn`` whose model recomputes its layers' activations in the
    backward pass instead of keeping them: the activation memory of one layer
    (plus each layer's input) for about one more forward pass of compute.

    What is recomputed, with no change to the model's code:

    - each iteration of every ``jax.lax.scan`` the loss runs: a stack of
      layers (built with ``eqx.filter_vmap``, run with ``lax.scan``);
    - each element of a list or tuple of at least two modules of one class,
      each holding at least two weight matrices (the blocks of a
      transformer, the units of a ResNet stage): while ``loss_fn`` runs,
      each is wrapped in `Recomputed`, which calls it under `recomputed_call` and
      passes any other attribute through (so ``isinstance`` checks on a
      block see the wrapper).

    ``keep="nothing"`` keeps only each layer's input; ``keep="dots"`` also
    its matrix products without batch dims (JAX's
    ``dots_with_no_batch_dims_saveable``), which spares recomputing them
    for more memory. Paths, specs and checkpoints do not change; the loss
    and gradients are the same.

    **Example:**

    ```python
    train_step = redeqx.make_train_step(redeqx.remat(loss_fn), optimizer, mesh, specs)
    ```
    """
    _check_keep(keep)
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be a function (model, batch, key) -> loss, got {loss_fn!r}.")

    @functools.wraps(loss_fn)
    def rematerialised(model, *args):
        return recompute_scans(loss_fn, keep)(_recomputed_blocks(model, keep), *args)

    return rematerialised
