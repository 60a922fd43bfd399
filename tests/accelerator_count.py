"""Collectives as XLA's GPU and TPU pipelines move them, read on XLA:CPU.

Used by tests and benchmarks to hold a step to the bytes an accelerator would
move; redeqx itself reports the compiled program's own figures
(`redeqx.collective_summary`). Checked against libtpu's own programs
(benchmarks/RESULTS.md, History: "Issue 11's claims on the TPU compiler").
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import optax

import redeqx
from redeqx.planner._hlo import DTYPE_BYTES, Collective, array_shapes, collectives, executions, parse_module, summarise

# XLA's GPU and TPU pipelines run two passes after SPMD partitioning that XLA:CPU's does not
# (xla/service/gpu/gpu_compiler.cc "collective-optimizations" vs xla/service/cpu/cpu_compiler.cc):
# - AllReduceReassociate: add(all-reduce(a), all-reduce(b)) -> all-reduce(add(a, b)). A weight
#   used twice (a tied embedding: lookup and LM head) or one input read by several split
#   matmuls (Q, K and V) gets one all-reduce of its summed gradient instead of one per term;
# - ReduceScatterCreator: all-reduce followed by a dynamic-slice of the result -> reduce-scatter,
#   whose result is the slice (fsdp's gradients, sequence-parallel block outputs).
# And one that XLA:CPU's partitioned program shows and theirs do not:
# - a sum over the batch's devices that is then only summed further (a GroupNorm's affine weight
#   under vmap: broadcast to (C, H, W), its gradient summed over the batch, all-reduced, then
#   over H and W) is all-reduced at the size of the last sum: libtpu's and XLA:GPU's programs
#   all-reduce the (C,) gradient, XLA:CPU's the (C, H, W) one. With it, the GroupNorm nets of
#   benchmarks/plans_vs_hand.py count libtpu's bytes to the byte (19,163,708 at 2 model shards for
#   GroupNorm(32, 256) over 32 x 32 pixels; 23,353,916 before it).
# `accelerator_collectives` reads the program right after SPMD partitioning (before XLA:CPU's
# own passes) and applies these rewrites to the count, so a test on simulated CPU devices can
# hold the step to the bytes a GPU or TPU run would move.
#
# Except for a scatter's term. Checked against libtpu's own programs (a TPU v4 slice described
# by jax.experimental.topologies; benchmarks/RESULTS.md, History: "Issue 11's
# claims on the TPU compiler"): the gradient of an embedding lookup is a scatter-add, and libtpu folds the
# other term into it (scatter(base=all-reduce(head's term), ...)) rather than adding two
# all-reduces, so a tied embedding's gradient is reduced twice there too. An add with a
# scatter's all-reduce is therefore not merged here; with that, this count matches libtpu's to
# 0.01 MiB on the vs_redco user GPT at n_model_shards 1, 2 and 4 (28.30, 86.34, 79.33 MiB).

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<shape>\(.*?\)|[^\s(]+)\s+"
                    r"(?P<op>[a-z\-]+)\((?P<args>[^)]*)\)(?P<rest>.*)$")
_GROUPS_EXPLICIT = re.compile(r"replica_groups=\{(\{[\d,{}\s]*\})\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_PASS_THROUGH = ("bitcast", "reshape", "copy", "convert")


def _replica_groups(rest: str) -> frozenset | None:
    """The device groups of a collective as a set of sorted tuples, whichever
    of HLO's three notations the text uses."""
    if m := _GROUPS_MESH.search(rest):
        axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
        chosen = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(2))]
        ids = np.arange(int(np.prod(sizes))).reshape(sizes)
        rest_axes = [i for i in range(len(sizes)) if i not in chosen]
        groups = ids.transpose(rest_axes + chosen).reshape(-1, int(np.prod([sizes[i] for i in chosen])))
    elif m := _GROUPS_IOTA.search(rest):
        shape = [int(d) for d in m.group(1).split(",")]
        dims = [int(d) for d in m.group(2).split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(p) for p in m.group(3).split(",")])
        groups = ids.reshape(shape)
    elif m := _GROUPS_EXPLICIT.search(rest):
        groups = [[int(d) for d in g.split(",") if d.strip()] for g in re.findall(r"\{([\d,\s]*)\}", m.group(1))]
    else:
        return None
    return frozenset(tuple(sorted(int(d) for d in g)) for g in groups)


def reassociated_collectives(hlo_text: str) -> list[Collective]:
    """The collectives of a partitioned (not yet optimized) HLO module as
    XLA's GPU/TPU pipelines leave them: all-reduces whose results are only
    added together count as one (unless one sums a scatter's result, which
    libtpu keeps apart), one whose result is only summed further counts at
    the size of that sum, and an all-reduce whose only use is a dynamic-slice
    counts as a reduce-scatter of the slice's bytes."""
    instrs, users = {}, {}
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if m is None:
            continue
        operands = re.findall(r"%([\w.\-]+)", m.group("args"))
        instrs[m.group("name")] = (m.group("op"), m.group("shape"), operands, m.group("rest"))
        for o in operands:
            users.setdefault(o, []).append(m.group("name"))

    def nbytes(shape_text):
        return sum(DTYPE_BYTES[d] * int(np.prod(s, dtype=np.int64)) for d, s in array_shapes(shape_text))

    def only_user(name):
        """The single user of ``name``, looking through reshapes and copies."""
        while len(users.get(name, ())) == 1:
            name = users[name][0]
            if instrs[name][0] not in _PASS_THROUGH:
                return name
        return None

    # merged[name]: the set of all-reduces whose sum `name` is (an all-reduce, or an add of such sums)
    merged, groups = {}, {}
    for name, (op, shape, operands, rest) in instrs.items():
        if op == "all-reduce":
            merged[name], groups[name] = frozenset([name]), _replica_groups(rest)

    def sum_of(name):
        """The all-reduce set feeding ``name`` if ``name`` is one, or a pass-through of one."""
        while name in instrs and name not in merged and instrs[name][0] in _PASS_THROUGH:
            name = instrs[name][2][0]
        return name if name in merged else None

    def reduces_scatter(all_reduce):
        """Whether ``all_reduce`` sums a scatter's result (an embedding lookup's gradient)."""
        source = instrs[all_reduce][2][0] if instrs[all_reduce][2] else None
        while source in instrs and instrs[source][0] in _PASS_THROUGH:
            source = instrs[source][2][0]
        return source in instrs and instrs[source][0] == "scatter"

    for name, (op, shape, operands, rest) in instrs.items():
        if op != "add" or len(operands) != 2:
            continue
        a, b = (sum_of(o) for o in operands)
        if a is None or b is None or a == b or groups[a] != groups[b] or groups[a] is None:
            continue
        if only_user(a) != name or only_user(b) != name:
            continue
        if any(reduces_scatter(r) for r in merged[a] | merged[b]):
            continue  # libtpu folds the sum into the scatter instead (see above)
        merged[name], groups[name] = merged[a] | merged[b], groups[a]
        del merged[a], merged[b]

    computations, _, entry = parse_module(hlo_text)
    runs = executions(computations, entry)
    computation_of = {ins.name: name for name, instructions in computations.items() for ins in instructions}

    def sums(name):
        """Whether instruction ``name`` is a reduce whose reduction is an add."""
        op, _, _, rest = instrs[name]
        region = re.search(r"to_apply=%?([\w.\-]+)", rest) if op == "reduce" else None
        body = computations.get(region[1], []) if region else []
        return bool(body) and body[-1].op == "add"

    found = []
    for root, members in merged.items():
        first = next(iter(members))
        kind, shape = "all-reduce", instrs[first][1]
        user = only_user(root)
        while user is not None and sums(user):  # summed further: the sum moves, as GPUs' and TPUs' programs do
            shape, user = instrs[user][1], only_user(user)
        if user is not None and instrs[user][0] == "dynamic-slice":
            kind, shape = "reduce-scatter", instrs[user][1]
        # one inside a loop's body (a scan over stacked layers) runs once per iteration
        found += [Collective(kind, tuple(array_shapes(shape)), nbytes(shape))] * runs.get(computation_of.get(root), 1)
    for c in collectives(hlo_text):
        if c.kind != "all-reduce":
            found.append(c)
    return found


def partitioned_text(fn: Callable, *args, **kwargs) -> str:
    """The HLO text of ``fn`` right after SPMD partitioning, before the
    backend's own passes (compiled once more, with XLA's dump switched on)."""
    return compiled_and_partitioned_text(fn.lower(*args, **kwargs))[1]


def compiled_and_partitioned_text(lowered: jax.stages.Lowered) -> tuple[jax.stages.Compiled, str]:
    """``lowered`` compiled once, with XLA's dump switched on, and the HLO text right after SPMD
    partitioning (see `partitioned_text`): the executable runs the program whose bytes are read,
    so a test that also runs the step need not compile it again."""
    import glob
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        compiled = lowered.compile({"xla_dump_to": d, "xla_dump_hlo_pass_re": "spmd-partitioning"})
        files = glob.glob(os.path.join(d, "*after_spmd-partitioning*.txt"))
        if not files:
            text = compiled.as_text()
            if re.search(r"num_partitions=([2-9]|\d\d)", text):
                raise RuntimeError("XLA wrote no HLO after 'spmd-partitioning' (has the pass been renamed?)")
            return compiled, text  # one device: nothing to partition, no collectives
        return compiled, max((Path(f).read_text() for f in files), key=len)  # each file closed once read


def accelerator_collectives(fn: Callable, *args, **kwargs) -> dict[str, dict[str, int]]:
    """``{kind: {"count", "bytes"}}`` of ``fn``'s collectives as XLA's GPU and
    TPU pipelines move them (see `reassociated_collectives`), read on any backend."""
    return summarise(reassociated_collectives(partitioned_text(fn, *args, **kwargs)))


def step_bytes(model, loss, data, n: int, **rules):
    """The collective bytes an accelerator moves in one SGD train step of ``model`` on
    ``make_mesh(n)`` under ``sharding_rules(model, mesh, **rules)`` (warnings silenced), and those specs."""
    mesh = redeqx.make_mesh(n)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        specs = redeqx.sharding_rules(model, mesh, **rules)
    optimizer = optax.sgd(0.1)
    state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1))
    step = redeqx.make_train_step(loss, optimizer, mesh, specs)
    return sum(v["bytes"] for v in accelerator_collectives(step, state, data).values()), specs


def compiled_train_step(model, loss, data, n: int, optimizer, *, devices=None, **rules):
    """The train step of ``model`` on ``make_mesh(n, devices=devices)`` under ``sharding_rules(model,
    mesh, **rules)`` (warnings silenced), compiled once to serve both a bytes check and a run:
    ``(bytes an accelerator moves in it, specs, initial state, run)``, where ``run(state, batch) ->
    (state, metrics)`` runs that executable as the step's own call would (the batch placed on the
    mesh, the state's array leaves donated). On one device the bytes are 0."""
    from redeqx._trees import CONCRETE_ARRAYS
    from redeqx.data._batch import place_batch

    mesh = redeqx.make_mesh(n, devices=devices)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        specs = redeqx.sharding_rules(model, mesh, **rules)
    state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1))
    step = redeqx.make_train_step(loss, optimizer, mesh, specs)
    compiled, text = compiled_and_partitioned_text(step.lower(state, data))
    moved = sum(v["bytes"] for v in summarise(reassociated_collectives(text)).values())

    def run(state, batch):
        leaves, treedef = jax.tree.flatten(state)
        is_array = [isinstance(x, CONCRETE_ARRAYS) for x in leaves]
        new, metrics = compiled([x for x, a in zip(leaves, is_array) if a], (place_batch(batch, mesh),))
        new = iter(new)
        return jax.tree.unflatten(treedef, [next(new) if a else x for x, a in zip(leaves, is_array)]), metrics

    run.partitioned = text  # the program after SPMD partitioning, for tests that read more than its bytes
    return moved, specs, state, run


def trained_against_one_device(model, loss, batch, devices):
    """Two SGD steps at 2 shards and on one device (Adam's updates would hide a gradient scaled by
    the model axis): each step's gradient norm and the weights after, equal. Returns the split
    step's collective bytes and specs."""
    runs = {}
    for n, devs in ((2, None), (1, devices[:1])):
        moved, specs, state, run = compiled_train_step(model, loss, batch, n, optax.sgd(0.1), devices=devs,
                                                       loss_fn=loss, batch=batch)
        norms = []
        for _ in range(2):
            state, metrics = run(state, batch)
            norms.append(float(metrics["grad_norm"]))
        runs[n] = (moved, specs, state, norms)
    np.testing.assert_allclose(runs[2][3], runs[1][3], rtol=1e-5)
    arrays = lambda m: jax.tree.leaves(eqx.filter(m, eqx.is_array))  # noqa: E731  (not an MLP's activation)
    assert arrays(runs[2][2].model)
    for a, b in zip(arrays(runs[2][2].model), arrays(runs[1][2].model), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    return runs[2][:2]
