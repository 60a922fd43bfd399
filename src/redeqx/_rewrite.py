"""A function run through its own traced program, rewritten: `rewritten`.

What the train step does to a ``loss_fn`` it did not write (`redeqx.steps._remat`'s
scans that keep only their products, `redeqx.steps._conv_grads`' grouped
convolutions with an exact weight gradient) is a rewrite of the jaxpr
``loss_fn`` traces to: the function runs once, as a trace, and the step
evaluates the rewritten program in its place. The model's code is untouched.
"""

from __future__ import annotations

import contextlib
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


def twin_rewrite(jaxpr: jex.Jaxpr, half: jex.Jaxpr, replace, enter=lambda eqn: True) -> tuple[jex.Jaxpr, int]:
    """``jaxpr`` with each equation for which ``replace(eqn, twin)`` gives another in its place, and
    how many that was. ``twin`` is the same equation in ``half``: the same program traced on half the
    batch (`with_rows`), whose shapes say which dims carry the rows (`rows_dim`). Where ``replace``
    gives None, the programs the equation calls (a scan's body, a jit's) are rewritten alike, those
    of the equations ``enter`` accepts; a part whose twin has another structure is left as it is."""
    if len(jaxpr.eqns) != len(half.eqns):
        return jaxpr, 0
    eqns, count = [], 0
    for eqn, twin in zip(jaxpr.eqns, half.eqns):
        if eqn.primitive is twin.primitive and (new := replace(eqn, twin)) is not None:
            eqn, count = new, count + 1
        elif eqn.primitive is twin.primitive and enter(eqn):
            params, here = {}, 0
            for k, v in eqn.params.items():
                params[k], n = _twin_param(v, twin.params.get(k), replace, enter)
                here += n
            eqn, count = (eqn.replace(params=params) if here else eqn), count + here
        eqns.append(eqn)
    return jaxpr.replace(eqns=eqns), count


def rewritten_by_rows(fn: Callable, args: tuple, batch_arg: int, rows: int, replace, *, enter=lambda eqn: True,
                      needed=lambda jaxpr: True, retrace_in=None):
    """``fn(*args)`` evaluated as its program with `twin_rewrite`'s ``replace`` applied, the twin
    traced on half of ``args[batch_arg]``'s ``rows``. The program as traced where ``needed(jaxpr)``
    says no, where the rows are not an even number, or where ``fn`` cannot be traced on half of them
    (a function that checks its batch's size): the rewrites that use this make a step cheaper, or
    compile one XLA's partitioner aborts on, and the program as traced is still right. Where the
    rewrite is needed, ``retrace_in`` (a context manager, or None) is one in which both programs are
    traced again: one whose custom rules would otherwise trace their bodies again, unrewritten."""
    first = traced(fn, *args)
    closed, leaves, rebuild = first
    if rows >= 2 and rows % 2 == 0 and needed(closed.jaxpr):
        with retrace_in() if retrace_in is not None else contextlib.nullcontext():
            again = first if retrace_in is None else traced(fn, *args)
            try:
                half = eqx.filter_make_jaxpr(fn)(*with_rows(args, batch_arg, rows, rows // 2))[0]
            except Exception:  # noqa: BLE001 (any error of the user's code on another batch size)
                half = None
        if half is not None:
            jaxpr, count = twin_rewrite(again[0].jaxpr, half.jaxpr, replace, enter)
            if count:  # else the program as first traced
                closed, leaves, rebuild = again
                closed = jex.ClosedJaxpr(jaxpr, closed.consts)
    return rebuild(jex.jaxpr_as_fun(closed)(*leaves))


def _twin_param(value, twin, replace, enter):
    if isinstance(value, jex.ClosedJaxpr) and isinstance(twin, jex.ClosedJaxpr):
        inner, n = twin_rewrite(value.jaxpr, twin.jaxpr, replace, enter)
        return jex.ClosedJaxpr(inner, value.consts), n
    if isinstance(value, jex.Jaxpr) and isinstance(twin, jex.Jaxpr):
        return twin_rewrite(value, twin, replace, enter)
    if isinstance(value, tuple) and isinstance(twin, tuple) and len(value) == len(twin):
        pairs = [_twin_param(v, t, replace, enter) for v, t in zip(value, twin)]
        return tuple(v for v, _ in pairs), sum(n for _, n in pairs)
    return value, 0


def call_in_place(eqn, fn):
    """A ``jit`` call of ``fn`` in ``eqn``'s place: same operands, same results."""
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
    (call,) = jax.make_jaxpr(jax.jit(fn))(*avals).jaxpr.eqns
    return call.replace(invars=list(eqn.invars), outvars=list(eqn.outvars))


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
