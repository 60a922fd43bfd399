"""Pipeline stages: the stacked layers' ``lax.scan`` run as a GPipe pipeline over the ``stage`` axis.

On a mesh with ``n_pipeline_stages = S`` (`redeqx.make_mesh`), a stack of
``L`` layers has its layer axis split over ``stage`` (`redeqx.sharding_rules`):
stage ``s`` holds layers ``[s L / S, (s + 1) L / S)``. `pipelined_layer_scans`
is what the train and eval steps do to the function they differentiate or
evaluate: it traces it, finds each ``lax.scan`` whose sliced operands include
a model leaf (the stack), and evaluates the program with that scan replaced
by `pipeline`:

- the batch is cut into ``M`` microbatches (rows ``j, j + M, j + 2M, ...``,
  as ``accumulate`` cuts it: each data shard keeps its own rows);
- tick ``t`` of ``M + S - 1``: stage ``s`` runs its layers on microbatch
  ``t - s`` and hands the result to stage ``s + 1`` (one collective permute
  of one microbatch's activations); stage 0 reads its microbatch from the
  scan's input, the last stage writes its result out;
- the last stage's results are dealt out, microbatch ``j`` to stage
  ``j // (M / S)``, so what follows the stack (the head, the loss) runs on
  ``1 / S`` of the batch on each stage rather than all of it on every one.

Which operands carry the batch is found by tracing the function a second
time on one microbatch's rows: the dim that shrinks ``M`` times is the batch
dim. Everything before and after the stack runs as written. The backward
pass is JAX's derivative of this forward (the same ticks in reverse), so
gradients are those of the unpipelined program. ``S = 1``: the function
itself, untouched.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import equinox as eqx
import jax
import jax.extend.core as jex
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ..data import batch_size
from ..mesh import DATA, STAGE

_CALLS = ("pjit", "jit", "closed_call", "core_call")


def n_stages(mesh: Mesh) -> int:
    return dict(mesh.shape).get(STAGE, 1)


def check_microbatches(microbatches, mesh: Mesh) -> int | None:
    """``microbatches`` as the steps take it: None (no stages, or ``4 S``) or an int ``>= S``."""
    s = n_stages(mesh)
    if microbatches is None:
        return None if s == 1 else 4 * s
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches must be a positive int, got {microbatches!r}.")
    if s == 1:
        if microbatches != 1:
            raise ValueError(
                f"microbatches={microbatches} on a mesh without pipeline stages: microbatches feed the stages of "
                "redeqx.make_mesh(..., n_pipeline_stages=S). For micro-batches run one after another (less "
                "activation memory), pass accumulate= instead.")
        return None
    if microbatches < s:
        raise ValueError(
            f"microbatches={microbatches} is below n_pipeline_stages={s}: with fewer microbatches than stages some "
            f"stage never works. Pass microbatches >= {s}; {4 * s} (the default) idles each stage "
            f"{(s - 1) / (5 * s - 1):.0%} of the step, more microbatches less.")
    return microbatches


class PipelineError(ValueError):
    """A program, batch or stack the pipeline cannot run as asked, and what to change."""


def pipelined_layer_scans(fn: Callable, mesh: Mesh, microbatches: int | None, *, batch_arg: int = 1) -> Callable:
    """``fn(model, ..., batch, ...)`` with each stacked-layer scan it runs pipelined over
    ``stage`` in ``microbatches`` (see the module's text); ``fn`` itself without stages.
    ``batch_arg``: which argument holds the batch (its leaves' leading dim is the rows)."""
    s = n_stages(mesh)
    if s == 1 or microbatches is None:
        return fn

    @functools.wraps(fn)
    def run(*args):
        closed, out_arrays, out_static = eqx.filter_make_jaxpr(fn)(*args)
        rows = batch_size(args[batch_arg])
        m = microbatches
        if rows % m:
            raise PipelineError(
                f"microbatches={m} does not divide the batch's {rows} rows: pick microbatches among "
                f"{[d for d in range(s, rows + 1) if rows % d == 0][:8]}, or a batch of a multiple of {m} rows.")
        n_data = mesh.shape[DATA]
        if (rows // m) % n_data:
            raise PipelineError(
                f"microbatches={m} cuts the batch's {rows} rows into microbatches of {rows // m}, which the "
                f"{n_data}-way data axis does not split: make rows per data shard ({rows // n_data}) a multiple "
                f"of microbatches.")
        micro = list(args)
        micro[batch_arg] = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((rows // m, *x.shape[1:]), x.dtype)
            if eqx.is_array(x) and x.ndim and x.shape[0] == rows else x, args[batch_arg])
        closed_mb = eqx.filter_make_jaxpr(fn)(*micro)[0]
        model_leaves = len(jax.tree.leaves(eqx.filter(args[0], eqx.is_array)))
        model_vars = set(closed.jaxpr.invars[:model_leaves])
        runner = _Runner(mesh, s, m, fn)
        leaves = jax.tree.leaves(eqx.filter(args, eqx.is_array))
        outs = runner.eval(closed.jaxpr, closed.consts, leaves, closed_mb.jaxpr, model_vars)
        if runner.found == 0:
            raise PipelineError(
                f"the mesh has n_pipeline_stages={s}, but {_name(fn)} runs no jax.lax.scan over stacked layers for "
                "the stages to split: stack the repeated layers on a leading axis (eqx.filter_vmap over their "
                "constructor) and run them with jax.lax.scan, as the zoo's models do (scan_layers=True), or make "
                "the mesh without n_pipeline_stages.")
        return eqx.combine(jax.tree.unflatten(jax.tree.structure(out_arrays), outs), out_static)

    return run


def _name(fn) -> str:
    return f"loss_fn {getattr(fn, '__name__', type(fn).__name__)!r}"


class _Runner:
    """Evaluates a jaxpr equation by equation, running stacked-layer scans as `pipeline`."""

    def __init__(self, mesh: Mesh, s: int, m: int, fn):
        self.mesh, self.s, self.m, self.fn, self.found = mesh, s, m, fn, 0

    def _stack_scan(self, eqn, model_vars) -> bool:
        if eqn.primitive.name != "scan":
            return False
        first_x = eqn.params["num_consts"] + eqn.params["num_carry"]
        return any(not isinstance(v, jex.Literal) and v in model_vars for v in eqn.invars[first_x:])

    @staticmethod
    def _weights(jaxpr, model_vars) -> set:
        """``model_vars`` and every value computed from them alone (a cast to the compute dtype, a
        LoRA update merged into its weight): what a stack's scan may slice."""
        found = set(model_vars)
        for eqn in jaxpr.eqns:
            ins = [v for v in eqn.invars if not isinstance(v, jex.Literal)]
            if ins and all(v in found for v in ins):
                found.update(eqn.outvars)
        return found

    def _holds_stack(self, jaxpr, model_vars) -> bool:
        model_vars = self._weights(jaxpr, model_vars)
        for eqn in jaxpr.eqns:
            if self._stack_scan(eqn, model_vars):
                return True
            inner = self._call_body(eqn)
            if inner is not None:
                inner_vars = {iv for iv, ov in zip(inner.jaxpr.invars, eqn.invars)
                              if not isinstance(ov, jex.Literal) and ov in model_vars}
                if self._holds_stack(inner.jaxpr, inner_vars):
                    return True
        return False

    @staticmethod
    def _call_body(eqn):
        if eqn.primitive.name in _CALLS:
            for name in ("jaxpr", "call_jaxpr"):
                if isinstance(eqn.params.get(name), jex.ClosedJaxpr):
                    return eqn.params[name]
        return None

    def eval(self, jaxpr, consts, args, jaxpr_mb, model_vars):
        env = {}

        def read(v):
            return v.val if isinstance(v, jex.Literal) else env[v]

        for v, x in zip(jaxpr.constvars, consts):
            env[v] = x
        for v, x in zip(jaxpr.invars, args):
            env[v] = x
        model_vars = self._weights(jaxpr, model_vars)
        if len(jaxpr.eqns) != len(jaxpr_mb.eqns):
            raise PipelineError(
                f"{_name(self.fn)} traces to a different program on one microbatch's rows than on the whole "
                "batch, so the pipeline cannot tell which values carry the batch: keep the program's structure "
                "independent of the batch size (no Python branches on it).")
        for eqn, eqn_mb in zip(jaxpr.eqns, jaxpr_mb.eqns):
            invals = [read(v) for v in eqn.invars]
            inner = self._call_body(eqn)
            if self._stack_scan(eqn, model_vars):
                self.found += 1
                outs = pipeline_scan(eqn, eqn_mb, invals, self.mesh, self.s, self.m, self.fn)
            elif inner is not None and self._holds_stack(
                    inner.jaxpr, {iv for iv, ov in zip(inner.jaxpr.invars, eqn.invars)
                                  if not isinstance(ov, jex.Literal) and ov in model_vars}):
                inner_mb = self._call_body(eqn_mb)
                inner_vars = {iv for iv, ov in zip(inner.jaxpr.invars, eqn.invars)
                              if not isinstance(ov, jex.Literal) and ov in model_vars}
                outs = self.eval(inner.jaxpr, inner.consts, invals, inner_mb.jaxpr, inner_vars)
            else:
                with eqn.ctx.manager:
                    outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
                if not eqn.primitive.multiple_results:
                    outs = [outs]
            for v, x in zip(eqn.outvars, outs):
                if not isinstance(v, jex.DropVar):
                    env[v] = x
        return [read(v) for v in jaxpr.outvars]


def _batch_dim(full, micro, m: int, what: str, fn) -> int | None:
    """The dim of ``full`` that is ``m`` times that of ``micro`` (None: no batch dim)."""
    if full == micro:
        return None
    dims = [d for d, (a, b) in enumerate(zip(full, micro)) if a != b]
    if len(full) != len(micro) or len(dims) != 1 or full[dims[0]] != m * micro[dims[0]]:
        raise PipelineError(
            f"{_name(fn)}'s stacked-layer scan has {what} of shape {full} on the whole batch but {micro} on one "
            f"of {m} microbatches: the pipeline needs each value the layers see to carry the batch on one dim "
            "(or not at all).")
    return dims[0]


def _to_micro(x, dim: int, m: int):
    """(..., B, ...) at ``dim`` -> (M, ..., B / M, ...): microbatch j holds rows j, j + M, ..."""
    shape = x.shape
    x = x.reshape(*shape[:dim], shape[dim] // m, m, *shape[dim + 1:])
    return jnp.moveaxis(x, dim + 1, 0)


def _from_micro(x, dim: int):
    """`_to_micro` undone: (M, ..., B / M, ...) -> (..., B, ...)."""
    m = x.shape[0]
    x = jnp.moveaxis(x, 0, dim + 1)
    return x.reshape(*x.shape[:dim], x.shape[dim] * m, *x.shape[dim + 2:])


def pipeline_scan(eqn, eqn_mb, invals, mesh: Mesh, s: int, m: int, fn) -> list:
    """The outputs of scan ``eqn`` on ``invals``, computed as a GPipe pipeline over ``stage``."""
    p = eqn.params
    length, n_consts, n_carry = p["length"], p["num_consts"], p["num_carry"]
    if length % s:
        raise PipelineError(
            f"{_name(fn)} scans a stack of {length} layers, which n_pipeline_stages={s} does not divide: pick "
            f"n_pipeline_stages among {[d for d in range(1, length + 1) if length % d == 0 and d > 1]}, or a "
            "layer count the stages divide.")
    body = eqn_mb.params["jaxpr"]  # traced on one microbatch's rows: the shapes each stage runs
    shapes = [tuple(v.aval.shape) for v in eqn.invars]
    shapes_mb = [tuple(v.aval.shape) for v in eqn_mb.invars]
    dims = [_batch_dim(a, b, m, f"an input", fn) for a, b in zip(shapes, shapes_mb)]
    out_dims = [_batch_dim(tuple(v.aval.shape), tuple(w.aval.shape), m, "an output", fn)
                for v, w in zip(eqn.outvars, eqn_mb.outvars)]
    consts, carry, xs = invals[:n_consts], invals[n_consts:n_consts + n_carry], invals[n_consts + n_carry:]
    c_dims, k_dims, x_dims = dims[:n_consts], dims[n_consts:n_consts + n_carry], dims[n_consts + n_carry:]
    if any(d == 0 for d in x_dims):
        raise PipelineError(f"{_name(fn)}'s stacked-layer scan slices the batch's rows as its layers: not a stack.")
    for d, od in zip(k_dims, out_dims[:n_carry]):
        if d != od:
            raise PipelineError(f"{_name(fn)}'s stacked-layer scan moves the batch dim of its carry ({d} -> {od}).")
    if p["reverse"]:
        xs = [jnp.flip(x, 0) for x in xs]
    # every carry per microbatch (one without a batch dim, e.g. a layer counter, copied to each)
    carry_mb = [_to_micro(x, d, m) if d is not None else jnp.broadcast_to(x, (m, *x.shape))
                for x, d in zip(carry, k_dims)]
    consts_mb = [_to_micro(x, d, m) if d is not None else x for x, d in zip(consts, c_dims)]
    per_stage = length // s
    xs_staged = [(_to_micro(x, d, m) if d is not None else x) for x, d in zip(xs, x_dims)]
    xs_staged = [x.reshape(*x.shape[:int(d is not None)], s, per_stage, *x.shape[1 + int(d is not None):])
                 for x, d in zip(xs_staged, x_dims)]
    unroll = p.get("unroll", 1)
    unroll = per_stage if unroll is True else max(1, min(int(unroll), per_stage))
    layer_fn = lambda *a: jex.jaxpr_as_fun(_in_this_mesh(body))(*a)  # noqa: E731
    ticks = m + s - 1
    deal = m % s == 0  # the last stage's results dealt out, M / S microbatches to each stage

    def stages(consts_mb, carry_mb, xs_staged):
        me = jax.lax.axis_index(STAGE)
        local = [x[:, 0] if d is not None else x[0] for x, d in zip(xs_staged, x_dims)]

        def layers(state, j):
            cs = [c[j] if d is not None else c for c, d in zip(consts_mb, c_dims)]
            xj = [x[j] if d is not None else x for x, d in zip(local, x_dims)]

            def one(c, x):
                out = layer_fn(*cs, *c, *x)
                return list(out[:n_carry]), list(out[n_carry:])

            return jax.lax.scan(one, state, xj, length=per_stage, unroll=unroll)

        def tick(loop, t):
            state, outs, ys = loop
            j = t - me
            valid = (j >= 0) & (j < m)
            jc = jnp.clip(j, 0, m - 1)
            state = [jnp.where(me == 0, c[jc], h) for c, h in zip(carry_mb, state)]
            new, y = layers(state, jc)
            last = valid & (me == s - 1)
            outs = [o.at[jc].set(jnp.where(last, h, o[jc])) for o, h in zip(outs, new)]
            ys = [b.at[jc].set(jnp.where(valid, v, b[jc])) for b, v in zip(ys, y)]
            handed = [jax.lax.ppermute(h, STAGE, [(i, i + 1) for i in range(s - 1)]) for h in new]
            return (handed, outs, ys), None

        state0 = [jnp.zeros_like(c[0]) for c in carry_mb]
        outs0 = [jnp.zeros_like(c) for c in carry_mb]
        y_avals = body.out_avals[n_carry:]
        ys0 = [jnp.zeros((m, per_stage, *a.shape), a.dtype) for a in y_avals]
        (_, outs, ys), _ = jax.lax.scan(tick, (state0, outs0, ys0), jnp.arange(ticks))
        if deal:
            outs = [_deal(o, me, s) for o in outs]
        else:
            outs = [jax.lax.psum(jnp.where(me == s - 1, o, jnp.zeros_like(o)), STAGE) for o in outs]
        return outs, ys

    x_specs = [P(None, STAGE) if d is not None else P(STAGE) for d in x_dims]
    out_spec = P(STAGE) if deal else P()
    run = jax.shard_map(stages, mesh=mesh, in_specs=(P(), P(), x_specs),
                        out_specs=([out_spec] * n_carry, [P(None, STAGE)] * len(body.out_avals[n_carry:])),
                        axis_names=frozenset({STAGE}), check_vma=False)
    outs, ys = run(consts_mb, carry_mb, xs_staged)
    final = []
    for o, d, x in zip(outs, k_dims, carry):
        if d is not None:
            final.append(_from_micro(o, d))
        elif jnp.issubdtype(o.dtype, jnp.inexact):
            final.append(o.mean(0).astype(o.dtype))  # e.g. a loss summed over the layers: each microbatch's, averaged
        else:
            final.append(o[0])
    stacked = []
    for y, d in zip(ys, out_dims[n_carry:]):
        if d is not None:  # (M, L, ...): each stage's L / S layers side by side
            y = _from_micro(y, d)
        elif jnp.issubdtype(y.dtype, jnp.inexact):
            y = y.mean(0).astype(y.dtype)
        else:
            y = y[0]
        stacked.append(jnp.flip(y, 0) if p["reverse"] else y)
    return final + stacked


def _deal(outs, me, s: int):
    """The last stage's ``(M, ...)`` results, microbatches ``[k M / S, (k + 1) M / S)`` sent to
    stage ``k``: each stage's share, ``(M / S, ...)``."""
    pieces = outs.reshape(s, outs.shape[0] // s, *outs.shape[1:])
    mine = jnp.where(me == s - 1, pieces[s - 1], jnp.zeros_like(pieces[0]))
    for k in range(s - 1):
        mine = mine + jax.lax.ppermute(pieces[k], STAGE, [(s - 1, k)])
    return mine


def _in_this_mesh(closed: jex.ClosedJaxpr) -> jex.ClosedJaxpr:
    """``closed``, traced outside the stages' ``shard_map``, as a program of the mesh in context now
    (inside it, with ``stage`` manual): every value's type, equation's context and param naming a mesh
    (an out sharding, a call's context mesh) names this one, in it and in its inner programs. JAX
    checks that the mesh a value was typed on is the one in context; the program is otherwise the same."""
    from jax._src import mesh as mesh_lib

    here = mesh_lib.get_abstract_mesh()
    return _Transplant(here).closed(closed)


class _Transplant:
    def __init__(self, here):
        from jax._src import core, mesh as mesh_lib

        self.here, self.core, self.mesh_lib = here, core, mesh_lib

    def _ours(self, mesh) -> bool:
        return isinstance(mesh, self.mesh_lib.AbstractMesh) and mesh.axis_names == self.here.axis_names

    def aval(self, aval):
        sharding = getattr(aval, "sharding", None)
        if isinstance(sharding, NamedSharding) and self._ours(sharding.mesh):
            return aval.update(sharding=NamedSharding(self.here, sharding.spec, memory_kind=sharding.memory_kind))
        return aval

    def param(self, value):
        if isinstance(value, jex.ClosedJaxpr):
            return self.closed(value)
        if isinstance(value, jex.Jaxpr):
            return self.jaxpr(value)
        if self._ours(value):
            return self.here
        if isinstance(value, NamedSharding) and self._ours(value.mesh):
            return NamedSharding(self.here, value.spec, memory_kind=value.memory_kind)
        if isinstance(value, tuple):
            return tuple(self.param(v) for v in value)
        return value

    def closed(self, closed: jex.ClosedJaxpr) -> jex.ClosedJaxpr:
        return jex.ClosedJaxpr(self.jaxpr(closed.jaxpr), closed.consts)

    def jaxpr(self, jaxpr: jex.Jaxpr) -> jex.Jaxpr:
        core = self.core
        new: dict = {}

        def var(v):
            if isinstance(v, jex.Literal):
                return jex.Literal(v.val, self.aval(v.aval))
            if isinstance(v, jex.DropVar):
                return jex.DropVar(self.aval(v.aval))
            if v not in new:
                new[v] = jex.Var(self.aval(v.aval))
            return new[v]

        constvars, invars = [var(v) for v in jaxpr.constvars], [var(v) for v in jaxpr.invars]
        eqns = []
        for eqn in jaxpr.eqns:
            c = eqn.ctx
            ctx = core.JaxprEqnContext._create(c.compute_type, c.threefry_partitionable, self.here,
                                               c.remove_size_one_mesh_axis, c.xla_metadata)
            eqns.append(eqn.replace(invars=[var(v) for v in eqn.invars], outvars=[var(v) for v in eqn.outvars],
                                    params={k: self.param(v) for k, v in eqn.params.items()}, ctx=ctx))
        return jaxpr.replace(constvars=constvars, invars=invars, outvars=[var(v) for v in jaxpr.outvars], eqns=eqns)
