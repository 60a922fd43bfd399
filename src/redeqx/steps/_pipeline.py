"""Pipeline stages: the stacked layers' ``lax.scan`` run as a GPipe pipeline over the ``stage`` axis.

On a mesh with ``n_pipeline_stages = S`` (`redeqx.make_mesh`), a stack of
``L`` layers has its layer axis split over ``stage`` (`redeqx.sharding_rules`):
stage ``s`` holds layers ``[s L / S, (s + 1) L / S)``. `pipelined_layer_scans`
is what the train and eval steps do to the function they differentiate or
evaluate: it traces it, finds each ``lax.scan`` whose sliced operands include
a model leaf (the stack), and evaluates the program with that scan replaced
by `pipeline`:

- the batch is cut into ``M`` microbatches, each data shard's rows in ``M``
  consecutive runs (microbatch ``j`` is run ``j`` of every shard): no row
  moves between data shards;
- tick ``t`` of ``M + S - 1``: stage ``s`` runs its layers on microbatch
  ``t - s`` and hands the result to stage ``s + 1`` (one collective permute
  of one microbatch's activations); stage 0 reads its microbatch from the
  scan's input, the last stage writes its result out;
- the last stage's results are dealt out, microbatch ``j`` to stage
  ``j // (M / S)``, so what follows the stack (the head, the loss) runs on
  ``1 / S`` of the batch on each stage rather than all of it on every one.

Which operands carry the batch is found by tracing the function a second
time on one microbatch's rows: the dim that shrinks ``M`` times is the batch
dim. The stages run under one ``shard_map``, manual over ``stage`` and (when
no weight is split over it, i.e. without ``fsdp``) over ``data``: each
device runs its data shard's rows, and the weights' gradients are summed
over ``data`` once, after the backward ticks, not once a tick. The layers'
program is traced a third time there, on a data shard's microbatch, so that
it is typed for the mesh it runs in (a mixture-of-experts layer, say, then
splits its tokens over no manual axis). Everything before and after the
stack runs as written. The backward pass is JAX's derivative of this
forward (the same ticks in reverse), so gradients are those of the
unpipelined program. ``S = 1``: the function itself, untouched.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import equinox as eqx
import jax
import jax.extend.core as jex
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from ..data import batch_size
from ..mesh import DATA, MODEL, STAGE
from .._rewrite import bind, call_body, derived_from, inner_seed, rows_dim, traced, with_rows
from .._trees import leaves_with_specs
from .._typing import warn_user

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


def pipelined_layer_scans(fn: Callable, mesh: Mesh, microbatches: int | None, *, batch_arg: int = 1,
                          weights_over_data: bool = False, specs=None) -> Callable:
    """``fn(model, ..., batch, ...)`` with each stacked-layer scan it runs pipelined over
    ``stage`` in ``microbatches`` (see the module's text); ``fn`` itself without stages.
    ``batch_arg``: which argument holds the batch (its leaves' leading dim is the rows);
    ``weights_over_data``: some weight is split over ``data`` (fsdp), which then stays the
    partitioner's inside the stages; ``specs``: the model's, checked to split each stacked
    layer's leaves over ``stage`` (a warning names those they do not)."""
    s = n_stages(mesh)
    if s == 1 or microbatches is None:
        return fn

    @functools.wraps(fn)
    def run(*args):
        closed, leaves, rebuild = traced(fn, *args)
        rows = batch_size(args[batch_arg])
        m, n_data = microbatches, mesh.shape[DATA]
        if rows % (m * n_data):
            raise PipelineError(
                f"microbatches={m}{' (the default when none is given: 4 x n_pipeline_stages)' if m == 4 * s else ''} "
                f"does not cut the {rows} rows it is given (a micro-batch's under accumulate=k) into microbatches the "
                f"{n_data}-way data "
                f"axis splits: the rows must be a multiple of microbatches x data = {m * n_data} (rows per data "
                f"shard, {rows / n_data:g}, a multiple of microbatches). Pick microbatches among "
                f"{[d for d in range(s, rows // n_data + 1) if (rows // n_data) % d == 0][:8] or 'none'}, or "
                "a batch of a multiple of that many rows.")
        manual = {STAGE} | ({DATA} if n_data > 1 and not weights_over_data else set())

        closed_mb = eqx.filter_make_jaxpr(fn)(*with_rows(args, batch_arg, rows, rows // m))[0]
        local = with_rows(args, batch_arg, rows, rows // (m * n_data) if DATA in manual else rows // m)

        def traced_here(path):  # the stack's body, traced where it runs (inside the stages' shard_map)
            jaxpr = eqx.filter_make_jaxpr(fn)(*jax.tree.map(_abstract, local, is_leaf=eqx.is_array))[0].jaxpr
            for i in path[:-1]:
                jaxpr = call_body(jaxpr.eqns[i]).jaxpr
            eqn = jaxpr.eqns[path[-1]] if path[-1] < len(jaxpr.eqns) else None
            if eqn is None or eqn.primitive.name != "scan":
                raise PipelineError(
                    f"{_name(fn)} traces to another program inside the pipeline's stages than outside them, so "
                    "its stacked layers cannot be found there: keep the program's structure independent of the "
                    "mesh axes in context.")
            return eqn.params["jaxpr"]

        model_leaves = len(jax.tree.leaves(eqx.filter(args[0], eqx.is_array)))
        runner = _Runner(mesh, s, m, fn, manual, traced_here)
        outs = runner.eval(closed.jaxpr, closed.consts, leaves, closed_mb.jaxpr,
                           {v: i for i, v in enumerate(closed.jaxpr.invars[:model_leaves])}, ())
        if specs is not None:
            _check_staged(leaves_with_specs(args[0], specs), runner.sliced, s)
        if runner.found == 0:
            raise PipelineError(
                f"the mesh has n_pipeline_stages={s}, but {_name(fn)} runs no jax.lax.scan over stacked layers for "
                "the stages to split: stack the repeated layers on a leading axis (eqx.filter_vmap over their "
                "constructor) and run them with jax.lax.scan, as the zoo's models do (scan_layers=True), or make "
                "the mesh without n_pipeline_stages.")
        return rebuild(outs)

    return run


def _check_staged(named, sliced: set[int], s: int) -> None:
    """A warning naming the stacked leaves the pipeline slices whose spec does not split their layer
    axis over ``stage``: each stage would hold every layer, and every step move them."""
    whole = [f"{path} {spec}" for i, (path, _, spec) in enumerate(named)
             if i in sliced and not (len(spec) and STAGE in _axes(spec[0]))]
    if whole:
        warn_user(
            f"pipeline stages: {len(whole)} stacked leaves the stages' layers read are not split over 'stage' "
            f"({', '.join(whole[:4])}{'...' if len(whole) > 4 else ''}): every stage holds every layer "
            "and each step moves them. Build the specs with redeqx.sharding_rules(model, mesh, loss_fn=loss_fn, "
            "batch=batch) on this mesh (the program shows the stack), or put 'stage' first in their specs.")


def _axes(entry) -> tuple:
    return () if entry is None else entry if isinstance(entry, tuple) else (entry,)


def _abstract(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype) if eqx.is_array(x) else x


def _name(fn) -> str:
    return f"loss_fn {getattr(fn, '__name__', type(fn).__name__)!r}"


def _stack_scan(eqn, weights) -> bool:
    """A ``scan`` slicing a model's weights: a stack of layers."""
    if eqn.primitive.name != "scan":
        return False
    first_x = eqn.params["num_consts"] + eqn.params["num_carry"]
    return any(not isinstance(v, jex.Literal) and v in weights for v in eqn.invars[first_x:])


def _holds_stack(jaxpr, model_vars) -> bool:
    weights = derived_from(jaxpr, model_vars)
    for eqn in jaxpr.eqns:
        if _stack_scan(eqn, weights):
            return True
        inner = call_body(eqn)
        if inner is not None and _holds_stack(inner.jaxpr, inner_seed(inner.jaxpr, eqn, weights)):
            return True
    return False


_SAME = ("convert_element_type", "copy", "copy_p", "reduce_precision")  # a weight by another dtype


def _sources(jaxpr, model_vars: dict) -> dict:
    """``model_vars`` (var -> model leaf) and the values that are a leaf in another dtype."""
    found = dict(model_vars)
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _SAME and not isinstance(eqn.invars[0], jex.Literal) and eqn.invars[0] in found:
            found[eqn.outvars[0]] = found[eqn.invars[0]]
    return found


class _Runner:
    """Evaluates a jaxpr equation by equation, running stacked-layer scans as `pipeline_scan`."""

    def __init__(self, mesh: Mesh, s: int, m: int, fn, manual: set, traced_here):
        self.mesh, self.s, self.m, self.fn, self.manual, self.traced_here = mesh, s, m, fn, manual, traced_here
        self.found = 0
        self.sliced: set[int] = set()  # the model leaves (flat index) the pipelined scans slice

    def eval(self, jaxpr, consts, args, jaxpr_mb, model_vars, path: tuple):
        env = {}

        def read(v):
            return v.val if isinstance(v, jex.Literal) else env[v]

        for v, x in zip(jaxpr.constvars, consts):
            env[v] = x
        for v, x in zip(jaxpr.invars, args):
            env[v] = x
        weights, sources = derived_from(jaxpr, model_vars), _sources(jaxpr, model_vars)
        if len(jaxpr.eqns) != len(jaxpr_mb.eqns):
            raise PipelineError(
                f"{_name(self.fn)} traces to a different program on one microbatch's rows than on the whole "
                "batch, so the pipeline cannot tell which values carry the batch: keep the program's structure "
                "independent of the batch size (no Python branches on it).")
        for i, (eqn, eqn_mb) in enumerate(zip(jaxpr.eqns, jaxpr_mb.eqns)):
            invals = [read(v) for v in eqn.invars]
            inner = call_body(eqn)
            if _stack_scan(eqn, weights):
                self.found += 1
                first_x = eqn.params["num_consts"] + eqn.params["num_carry"]
                self.sliced |= {sources[v] for v in eqn.invars[first_x:] if not isinstance(v, jex.Literal)
                                and v in sources}
                outs = pipeline_scan(eqn, eqn_mb, invals, self, path + (i,))
            elif inner is not None and _holds_stack(inner.jaxpr, inner_seed(inner.jaxpr, eqn, weights)):
                inner_vars = {iv: sources.get(ov, -1) for iv, ov in zip(inner.jaxpr.invars, eqn.invars)
                              if not isinstance(ov, jex.Literal) and ov in weights}
                outs = self.eval(inner.jaxpr, inner.consts, invals, call_body(eqn_mb).jaxpr, inner_vars, path + (i,))
            else:
                outs = bind(eqn, invals)
            for v, x in zip(eqn.outvars, outs):
                if not isinstance(v, jex.DropVar):
                    env[v] = x
        return [read(v) for v in jaxpr.outvars]


def _batch_dim(full, micro, m: int, what: str, fn) -> int | None:
    """The dim of ``full`` that is ``m`` times that of ``micro`` (None: no batch dim)."""
    d = rows_dim(full, micro, m)
    if d is False:
        raise PipelineError(
            f"{_name(fn)}'s stacked-layer scan has {what} of shape {full} on the whole batch but {micro} on one "
            f"of {m} microbatches: the pipeline needs each value the layers see to carry the batch on one dim "
            "(or not at all).")
    return d


def _to_micro(x, dim: int, m: int, n_data: int):
    """(..., B, ...) at ``dim`` -> (M, ..., B / M, ...): each data shard's rows cut in ``M`` runs,
    microbatch ``j`` holding run ``j`` of every shard (so the ``B / M`` dim splits over ``data`` as
    ``B`` did)."""
    shape = x.shape
    x = x.reshape(*shape[:dim], n_data, m, shape[dim] // (n_data * m), *shape[dim + 1:])
    x = jnp.moveaxis(x, dim + 1, 0)
    return x.reshape(m, *shape[:dim], shape[dim] // m, *shape[dim + 1:])


def _from_micro(x, dim: int, n_data: int):
    """`_to_micro` undone: (M, ..., B / M, ...) -> (..., B, ...)."""
    m, shape = x.shape[0], x.shape[1:]
    x = x.reshape(m, *shape[:dim], n_data, shape[dim] // n_data, *shape[dim + 1:])
    x = jnp.moveaxis(x, 0, dim + 1)
    return x.reshape(*shape[:dim], shape[dim] * m, *shape[dim + 1:])


def _spec(ndim: int, stage: int | None = None, data: int | None = None) -> P:
    """A spec of ``ndim`` entries naming ``stage`` and ``data`` at those dims (None: not named)."""
    entries: list = [None] * ndim
    for axis, d in ((STAGE, stage), (DATA, data)):
        if d is not None:
            entries[d] = axis
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def pipeline_scan(eqn, eqn_mb, invals, runner: _Runner, path: tuple) -> list:
    """The outputs of scan ``eqn`` on ``invals``, computed as a GPipe pipeline over ``stage``."""
    return _Pipeline(eqn, eqn_mb, runner, path).run(invals)


def _unbatched(x):
    """A value of every microbatch without the batch's rows (``(M, ...)``): a float's mean (e.g. a
    loss summed over the layers), else the first's (e.g. a layer counter)."""
    return x.mean(0).astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.inexact) else x[0]


class _Pipeline:
    """One stacked-layer scan run as a pipeline: the batch dims of its operands, their microbatched
    and staged forms, the stages' ``shard_map`` and its specs, the outputs put back together."""

    def __init__(self, eqn, eqn_mb, runner: _Runner, path: tuple):
        self.runner, self.path, self.mesh, self.s, self.m = runner, path, runner.mesh, runner.s, runner.m
        fn, p = runner.fn, eqn.params
        self.length, self.n_consts, self.n_carry, self.reverse = p["length"], p["num_consts"], p["num_carry"], p["reverse"]
        if self.length % self.s:
            n = self.mesh.devices.size
            fits = [d for d in range(2, self.length + 1) if self.length % d == 0 and n % d == 0]
            raise PipelineError(
                f"{_name(fn)} scans a stack of {self.length} layers, which n_pipeline_stages={self.s} does not "
                "divide: " + (f"pick n_pipeline_stages among {fits} (they divide the layers and the {n} devices), or "
                              if fits else "") + "give the model a layer count that the stages divide.")
        self.n_data, self.data = self.mesh.shape[DATA], DATA if DATA in runner.manual else None
        self.n_model = dict(self.mesh.shape).get(MODEL, 1)
        dims = [_batch_dim(tuple(v.aval.shape), tuple(w.aval.shape), self.m, "an input", fn)
                for v, w in zip(eqn.invars, eqn_mb.invars)]
        out_dims = [_batch_dim(tuple(v.aval.shape), tuple(w.aval.shape), self.m, "an output", fn)
                    for v, w in zip(eqn.outvars, eqn_mb.outvars)]
        nc, nk = self.n_consts, self.n_carry
        self.c_dims, self.k_dims, self.x_dims = dims[:nc], dims[nc:nc + nk], dims[nc + nk:]
        self.y_dims, self.y_ndims = out_dims[nk:], [1 + len(v.aval.shape) for v in eqn.outvars[nk:]]
        if any(d == 0 for d in self.x_dims):
            raise PipelineError(f"{_name(fn)}'s stacked-layer scan slices the batch's rows as its layers: not a stack.")
        if any(d != od for d, od in zip(self.k_dims, out_dims[:nk])):
            raise PipelineError(f"{_name(fn)}'s stacked-layer scan moves the batch dim of its carry.")
        self.per_stage = self.length // self.s
        unroll = p.get("unroll", 1)
        self.unroll = self.per_stage if unroll is True else max(1, min(int(unroll), self.per_stage))
        # microbatches each stage sends in and takes out; None: all of them on every stage
        self.share = self.m // self.s if self.m % self.s == 0 else None

    def _micro(self, x, d):
        return _to_micro(x, d, self.m, self.n_data) if d is not None else x

    def run(self, invals) -> list:
        nc, nk = self.n_consts, self.n_carry
        consts, carry, xs = invals[:nc], invals[nc:nc + nk], invals[nc + nk:]
        if self.reverse:
            xs = [jnp.flip(x, 0) for x in xs]
        # every carry per microbatch (one without a batch dim, e.g. a layer counter, copied to each)
        carry_mb = [self._micro(x, d) if d is not None else jnp.broadcast_to(x, (self.m, *x.shape))
                    for x, d in zip(carry, self.k_dims)]
        consts_mb = [self._micro(x, d) for x, d in zip(consts, self.c_dims)]
        xs_staged = []
        for x, d in zip(xs, self.x_dims):  # (L, ...) -> ([M], S, L / S, ...)
            x, lead = self._micro(x, d), int(d is not None)
            xs_staged.append(x.reshape(*x.shape[:lead], self.s, self.per_stage, *x.shape[1 + lead:]))
        c_specs, k_specs, x_specs, y_specs = self._specs(consts_mb, carry_mb, xs_staged)
        # A float input not split over some manual axis enters with a leading dim over it (one copy per
        # device, as it already is): its gradient is then summed over that axis by the partitioner, after
        # the stages, not by the stages' own psum (whose bfloat16 reduction XLA:CPU fails to compile)
        consts_in, c_extra, c_specs = _spread(consts_mb, c_specs, self.runner.manual, self.mesh)
        xs_in, x_extra, x_specs = _spread(xs_staged, x_specs, self.runner.manual, self.mesh)

        def entered(consts_in, carry_mb, xs_in):
            return self._stages(_unspread(consts_in, c_extra), carry_mb, _unspread(xs_in, x_extra))

        outs, ys = jax.shard_map(entered, mesh=self.mesh, in_specs=(c_specs, k_specs, x_specs),
                                 out_specs=(k_specs, y_specs), axis_names=frozenset(self.runner.manual),
                                 check_vma=False)(consts_in, carry_mb, xs_in)
        final = [_from_micro(o, d, self.n_data) if d is not None else _unbatched(o) for o, d in zip(outs, self.k_dims)]
        stacked = []
        for y, d in zip(ys, self.y_dims):  # (M, L, ...): each stage's L / S layers side by side
            y = _from_micro(y, d, self.n_data) if d is not None else _unbatched(y)
            stacked.append(jnp.flip(y, 0) if self.reverse else y)
        return final + stacked

    def _specs(self, consts_mb, carry_mb, xs_staged):
        """The stages' in and out specs: microbatches over ``stage`` (when each stage takes a share),
        rows over ``data``, layers over ``stage``; only ``stage`` named when ``data`` is not manual."""
        dealt = 0 if self.share is not None else None
        c_specs = [_spec(x.ndim, data=d + 1) if d is not None else P() for x, d in zip(consts_mb, self.c_dims)]
        k_specs = [_spec(x.ndim, stage=dealt, data=None if d is None else d + 1) for x, d in zip(carry_mb, self.k_dims)]
        x_specs = [_spec(x.ndim, stage=1, data=d + 2) if d is not None else P(STAGE)
                   for x, d in zip(xs_staged, self.x_dims)]
        y_specs = [_spec(n, stage=1, data=None if d is None else d + 1) for n, d in zip(self.y_ndims, self.y_dims)]
        groups = (c_specs, k_specs, x_specs, y_specs)
        if self.data is None:  # data is the partitioner's: name only stage
            groups = tuple([P(*[e if e == STAGE else None for e in sp]) for sp in group] for group in groups)
        return groups

    def _stages(self, consts_mb, carry_mb, xs_staged):
        """The ``shard_map`` body: this stage's ``M + S - 1`` ticks over its layers."""
        s, m, nk = self.s, self.m, self.n_carry
        me = jax.lax.axis_index(STAGE)
        body = self.runner.traced_here(self.path)
        if self.share is not None:  # each stage holds its share of the microbatches: all to stage 0
            carry_mb = [_collect(c, me, s, self.n_model) for c in carry_mb]
        local = [x[:, 0] if d is not None else x[0] for x, d in zip(xs_staged, self.x_dims)]
        layers = self._layers(jex.jaxpr_as_fun(body), consts_mb, local)

        def tick(loop, t):
            state, outs, ys = loop
            j = t - me
            valid, jc = (j >= 0) & (j < m), jnp.clip(j, 0, m - 1)
            new, y = layers([jnp.where(me == 0, c[jc], h) for c, h in zip(carry_mb, state)], jc)
            last = valid & (me == s - 1)
            outs = [o.at[jc].set(jnp.where(last, h, o[jc])) for o, h in zip(outs, new)]
            ys = [b.at[jc].set(jnp.where(valid, v, b[jc])) for b, v in zip(ys, y)]
            handed = [_send(h, [(i, i + 1) for i in range(s - 1)], self.n_model) for h in new]
            return (handed, outs, ys), None

        ys0 = [jnp.zeros((m, self.per_stage, *a.shape), a.dtype) for a in body.out_avals[nk:]]
        loop0 = ([jnp.zeros_like(c[0]) for c in carry_mb], [jnp.zeros_like(c) for c in carry_mb], ys0)
        (_, outs, ys), _ = jax.lax.scan(tick, loop0, jnp.arange(m + s - 1))
        if self.share is not None:
            outs = [_deal(o, me, s, self.n_model) for o in outs]
        else:
            outs = [jax.lax.psum(jnp.where(me == s - 1, o, jnp.zeros_like(o)), STAGE) for o in outs]
        if self.data is not None:  # a value without the batch's rows, from one data shard's: their mean
            outs = [o if d is not None else jax.lax.pmean(o, DATA) for o, d in zip(outs, self.k_dims)]
            ys = [y if d is not None else jax.lax.pmean(y, DATA) for y, d in zip(ys, self.y_dims)]
        return outs, ys

    def _layers(self, layer_fn, consts_mb, local):
        """``(state, j) -> (new state, per-layer outputs)``: this stage's layers on microbatch ``j``."""
        nk = self.n_carry

        def layers(state, j):
            cs = [c[j] if d is not None else c for c, d in zip(consts_mb, self.c_dims)]
            xj = [x[j] if d is not None else x for x, d in zip(local, self.x_dims)]

            def one(c, x):
                out = layer_fn(*cs, *c, *x)
                return list(out[:nk]), list(out[nk:])

            return jax.lax.scan(one, state, xj, length=self.per_stage, unroll=self.unroll)

        return layers


def _spread(values, specs, manual: set, mesh: Mesh):
    """Each floating value with a leading dim over each manual axis its spec does not name (a
    broadcast: each device's piece is the value itself); ``(values, added dims, specs)``."""
    out, extra, out_specs = [], [], []
    for x, spec in zip(values, specs):
        missing = [a for a in (STAGE, DATA) if a in manual and not any(a in _axes(e) for e in spec)]
        if not missing or not jnp.issubdtype(x.dtype, jnp.inexact):
            out.append(x), extra.append(0), out_specs.append(spec)
            continue
        sizes = tuple(mesh.shape[a] for a in missing)
        out.append(jnp.broadcast_to(x, (*sizes, *x.shape)))
        extra.append(len(missing))
        out_specs.append(P(*missing, *spec))
    return out, extra, out_specs


def _unspread(values, extra):
    return [x[(0,) * n] if n else x for x, n in zip(values, extra)]


def _send(x, perm, n_model: int):
    """``x`` sent between stages by ``perm`` (a collective permute over ``stage``). A value every
    device of a ``model`` group holds whole (the residual stream, as Megatron lays it out) is sent
    ``1 / n_model`` by each (split over ``model`` on its last dim that divides, free) and gathered
    again after (within the stage: its fast links), so the link between stages carries it once."""
    dims = [d for d in range(x.ndim - 1, -1, -1) if x.shape[d] % n_model == 0 and x.shape[d] >= n_model]
    if n_model == 1 or not dims:
        return jax.lax.ppermute(x, STAGE, perm)
    split, whole = [P.UNCONSTRAINED] * x.ndim, [P.UNCONSTRAINED] * x.ndim
    split[dims[0]], whole[dims[0]] = MODEL, None
    x = jax.lax.with_sharding_constraint(x, P(*whole))  # as the layers left it: the split stays out of them
    sent = jax.lax.ppermute(jax.lax.with_sharding_constraint(x, P(*split)), STAGE, perm)
    return jax.lax.with_sharding_constraint(sent, P(*whole))


def _deal(outs, me, s: int, n_model: int):
    """The last stage's ``(M, ...)`` results, microbatches ``[k M / S, (k + 1) M / S)`` sent to
    stage ``k``: each stage's share, ``(M / S, ...)``."""
    pieces = outs.reshape(s, outs.shape[0] // s, *outs.shape[1:])
    mine = jnp.where(me == s - 1, pieces[s - 1], jnp.zeros_like(pieces[0]))
    for k in range(s - 1):
        mine = mine + _send(pieces[k], [(s - 1, k)], n_model)
    return mine


def _collect(mine, me, s: int, n_model: int):
    """`_deal` undone: each stage's ``(M / S, ...)`` share, all ``M`` on stage 0 (zeros elsewhere)."""
    pieces = [jnp.where(me == 0, mine, jnp.zeros_like(mine))]
    pieces += [_send(mine, [(k, 0)], n_model) for k in range(1, s)]
    return jnp.concatenate(pieces, 0)
