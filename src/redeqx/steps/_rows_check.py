"""`make_eval_step` computes each example's loss alone (``loss_fn`` on a batch
of one row, vmapped) and averages them, so a mean is exact however the last
batch was padded. A loss comparing rows (in-batch negatives, a contrastive
loss: each row's logits against every other row's) sees no other row there:
CLIP's loss of a batch of one is 0, and the eval step reported 0.0 without a
word. `compares_rows` finds such a loss from its program, traced (not
compiled) on two batch sizes: a value whose shape grows other than linearly
with the rows (a ``(B, B)`` similarity matrix) compares them. The eval step's
first call warns (`rows_check`).
"""

from __future__ import annotations

import equinox as eqx
import jax

from ._loss import call_loss, fn_name
from .._rewrite import inner_jaxprs, rows_dim, with_rows
from .._typing import warn_user


def _shapes(jaxpr):
    """Every value's shape in ``jaxpr`` and in the programs its equations call, in order."""
    for eqn in jaxpr.eqns:
        yield from (tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape"))
        for inner in inner_jaxprs(eqn):
            yield from _shapes(inner)


def compares_rows(loss_fn, model, batch, key, model_state) -> tuple[int, ...] | None:
    """The shape (on 4 rows) of a value of ``loss_fn``'s program that grows other than linearly with
    the batch's rows, else None (also where the two traces differ in structure: nothing is said)."""
    rows = jax.tree.leaves(batch)[0].shape[0] if jax.tree.leaves(batch) else 0

    def traced(n):
        args = with_rows((eqx.nn.inference_mode(model, True), batch, key, model_state), 1, rows, n)
        return eqx.filter_make_jaxpr(lambda m, b, k, s: call_loss(loss_fn, m, b, k, s)[0])(*args)[0].jaxpr

    try:
        four, two = list(_shapes(traced(4))), list(_shapes(traced(2)))
    except Exception:  # a loss that cannot run on 2 or 4 rows: the step's own call says what is wrong
        return None
    if len(four) != len(two):
        return None
    return next((a for a, b in zip(four, two) if rows_dim(a, b, 2) is False), None)


def rows_check(loss_fn):
    """The eval step's first-call check: warn when ``loss_fn`` compares rows."""

    def check(model, batch, key, model_state=None):
        shape = compares_rows(loss_fn, model, batch, key, model_state)
        if shape is None:
            return
        warn_user(
            f"make_eval_step computes each example's loss on its own (loss_fn on a batch of one row) and averages "
            f"them, but loss_fn {fn_name(loss_fn)!r} compares rows: on a batch of 4 rows it computes a value of "
            f"shape {shape}, which grows other than linearly with the rows (in-batch negatives, a contrastive "
            "loss). Alone, a row has nothing to compare with (CLIP's loss is then 0), so the eval step's metrics "
            "are not this loss's. Evaluate it over whole batches with your own step: redeqx.make_step(fn, mesh), "
            "fn computing the loss of the batch it is given.")

    return check

