"""A function run through its own traced program, rewritten: `rewritten`.

What the train step does to a ``loss_fn`` it did not write (`redeqx.steps._remat`'s
scans that keep only their products, `redeqx.steps._conv_grads`' grouped
convolutions with an exact weight gradient) is a rewrite of the jaxpr
``loss_fn`` traces to: the function runs once, as a trace, and the step
evaluates the rewritten program in its place. The model's code is untouched.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import equinox as eqx
import jax
import jax.extend.core as jex
from jax.extend import source_info_util

Rewrite = Callable[[jex.ClosedJaxpr], jex.ClosedJaxpr]


def rewritten(fn: Callable, *rewrites: Rewrite) -> Callable:
    """``fn``, traced once, evaluated as the program ``rewrites`` (applied in
    order) make of its jaxpr. Non-array arguments are constants; non-array
    results come back as they were."""

    @functools.wraps(fn)
    def run(*args):
        closed, leaves, rebuild = traced(fn, *args)  # fn runs once, here
        for rewrite in rewrites:
            closed = rewrite(closed)
        return rebuild(jex.jaxpr_as_fun(closed)(*leaves))

    return run


def traced(fn: Callable, *args):
    """``fn(*args)`` traced: ``(closed jaxpr, the arguments' array leaves (its inputs), rebuild)``,
    ``rebuild(outputs)`` giving back ``fn``'s result from the program's outputs (non-array results as
    they were)."""
    closed, out_arrays, out_static = eqx.filter_make_jaxpr(fn)(*args)
    leaves = jax.tree.leaves(eqx.filter(args, eqx.is_array))
    return closed, leaves, lambda outs: eqx.combine(jax.tree.unflatten(jax.tree.structure(out_arrays), outs),
                                                    out_static)


def with_rows(args: tuple, batch_arg: int, rows: int, new_rows: int) -> list:
    """``args`` with the batch (``args[batch_arg]``) as abstract arrays of ``new_rows`` rows where it
    has ``rows``: the same program traced on another batch size, to find which values carry it."""
    out = list(args)
    out[batch_arg] = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((new_rows, *x.shape[1:]), x.dtype)
        if eqx.is_array(x) and x.ndim and x.shape[0] == rows else x, args[batch_arg])
    return out


def rows_dim(full: tuple, part: tuple, factor: int) -> int | None | bool:
    """Which dim of a value carries the batch, from its shape traced on the whole batch (``full``)
    and on ``1 / factor`` of it (``part``): that dim; None where the shapes agree (no batch dim);
    False where no single dim shrank ``factor``-fold."""
    if full == part:
        return None
    dims = [d for d, (a, b) in enumerate(zip(full, part)) if a != b]
    if len(full) != len(part) or len(dims) != 1 or full[dims[0]] != factor * part[dims[0]]:
        return False
    return dims[0]


def source_of(eqn):
    """A context in which what is traced carries ``eqn``'s source (its user frames and name
    stack), as JAX's own ``eval_jaxpr`` gives it: a compiled program's metadata then names the
    user's code, not the rewrite's, and a profile can say which function a kernel came from."""
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    return source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack)


def bind(eqn, invals) -> list:
    """``eqn`` applied to ``invals`` as its program would (in its own context and with its source,
    `source_of`): its outputs, a list."""
    with source_of(eqn), eqn.ctx.manager:
        outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
    return outs if eqn.primitive.multiple_results else [outs]


def inner_jaxprs(eqn):
    """Every jaxpr in ``eqn``'s params (a scan's body, a cond's branches, a call's program...)."""
    for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, jex.ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, jex.Jaxpr):
                yield v


CALLS = ("pjit", "jit", "closed_call", "core_call")  # primitives that call a closed jaxpr as it is


def call_body(eqn) -> jex.ClosedJaxpr | None:
    """The program a jitted or named call equation runs, else None."""
    if eqn.primitive.name in CALLS:
        for name in ("jaxpr", "call_jaxpr"):
            if isinstance(eqn.params.get(name), jex.ClosedJaxpr):
                return eqn.params[name]
    return None


def derived_from(jaxpr: jex.Jaxpr, seed) -> set:
    """``seed`` (vars of ``jaxpr``) and every value computed from them alone: from a model's leaves,
    its weights in another dtype, transposed, or with a LoRA update merged in."""
    found = set(seed)
    for eqn in jaxpr.eqns:
        ins = [v for v in eqn.invars if not isinstance(v, jex.Literal)]
        if ins and all(v in found for v in ins):
            found.update(eqn.outvars)
    return found


def inner_seed(inner: jex.Jaxpr, eqn, found: set) -> set:
    """The invars of ``eqn``'s inner program (a call's, a scan's body) that are in ``found`` outside it."""
    return {iv for iv, ov in zip(inner.invars, eqn.invars) if not isinstance(ov, jex.Literal) and ov in found}
