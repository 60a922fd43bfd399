"""Read the collectives out of a compiled XLA program."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import numpy as np

_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1,
}
# "%name = <shape> <op>(" where <shape> is "f32[4,8]{1,0}" or a tuple "(f32[4]{0}, f32[2]{0})"
_LINE = re.compile(r"=\s*(?P<shape>\(.*?\)|\S+)\s+(?P<op>[a-z\-]+)\(")
_ARRAY = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...]  # (dtype, shape) of each result array
    bytes: int


def _arrays(shape_text: str) -> list[tuple[str, tuple[int, ...]]]:
    out = []
    for dtype, dims in _ARRAY.findall(shape_text):
        if dtype in _DTYPE_BYTES:
            out.append((dtype, tuple(int(d) for d in dims.split(",") if d)))
    return out


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective in an HLO module's text, with the per-device bytes of
    its result. Asynchronous pairs count once (at ``-start``; for an
    all-gather-start the result is the last array of its tuple)."""
    found = []
    for line in hlo_text.splitlines():
        m = _LINE.search(line)
        if m is None:
            continue
        op = m.group("op")
        if op.endswith("-done"):
            continue
        kind = op[: -len("-start")] if op.endswith("-start") else op
        if kind not in _KINDS:
            continue
        arrays = _arrays(m.group("shape"))
        if op.endswith("-start") and kind in ("all-gather", "collective-permute", "all-to-all") and len(arrays) > 1:
            arrays = arrays[len(arrays) // 2:]
        nbytes = sum(_DTYPE_BYTES[d] * int(np.prod(s, dtype=np.int64)) for d, s in arrays)
        found.append(Collective(kind, tuple(arrays), nbytes))
    return found


def collective_summary(fn_or_text: Callable | str, *args, **kwargs) -> dict[str, dict[str, int]]:
    """``{kind: {"count": n, "bytes": b}}`` for a compiled program.

    Pass the HLO text of a compiled program, or a jitted function (``jax.jit``
    or a redeqx step) with example arguments: it is lowered and compiled for
    them (nothing runs). Bytes are per device, summed over calls of that kind.

    **Example:**

    ```python
    print(redeqx.collective_summary(train_step, state, batch))
    # {'all-reduce': {'count': 6, 'bytes': 81920}}
    ```
    """
    text = fn_or_text if isinstance(fn_or_text, str) else compiled_text(fn_or_text, *args, **kwargs)
    return _summarise(collectives(text))


def _summarise(found: list[Collective]) -> dict[str, dict[str, int]]:
    summary: dict[str, dict[str, int]] = {}
    for c in found:
        entry = summary.setdefault(c.kind, {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += c.bytes
    return summary


def compiled_text(fn: Callable, *args, **kwargs) -> str:
    """The optimized HLO text of ``fn`` compiled for these arguments."""
    lower = getattr(fn, "lower", None)
    if lower is None:
        raise TypeError(
            f"{fn!r} cannot be lowered: pass a jax.jit-ed function or a step made by redeqx (make_step, "
            "make_train_step), or the HLO text itself."
        )
    return lower(*args, **kwargs).compile().as_text()


# ----------------------------------------------------------------------------- as an accelerator's XLA moves them
#
# XLA's GPU and TPU pipelines run two passes after SPMD partitioning that XLA:CPU's does not
# (xla/service/gpu/gpu_compiler.cc "collective-optimizations" vs xla/service/cpu/cpu_compiler.cc):
# - AllReduceReassociate: add(all-reduce(a), all-reduce(b)) -> all-reduce(add(a, b)). A weight
#   used twice (a tied embedding: lookup and LM head) or one input read by several split
#   matmuls (Q, K and V) gets one all-reduce of its summed gradient instead of one per term;
# - ReduceScatterCreator: all-reduce followed by a dynamic-slice of the result -> reduce-scatter,
#   whose result is the slice (fsdp's gradients, sequence-parallel block outputs).
# `accelerator_collectives` reads the program right after SPMD partitioning (before XLA:CPU's
# own passes) and applies both rewrites to the count, so a test on simulated CPU devices can
# hold the step to the bytes a GPU or TPU run would move.
#
# Except for a scatter's term. Checked against libtpu's own programs (a TPU v4 slice described
# by jax.experimental.topologies; benchmarks/RESULTS.md, "Issue 11's CPU-artefact claims on
# the TPU compiler"): the gradient of an embedding lookup is a scatter-add, and libtpu folds the
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
    libtpu keeps apart), and an all-reduce whose only use is a dynamic-slice
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
        return sum(_DTYPE_BYTES[d] * int(np.prod(s, dtype=np.int64)) for d, s in _arrays(shape_text))

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

    found = []
    for root, members in merged.items():
        first = next(iter(members))
        kind, size = "all-reduce", nbytes(instrs[first][1])
        user = only_user(root)
        if user is not None and instrs[user][0] == "dynamic-slice":
            kind, size = "reduce-scatter", nbytes(instrs[user][1])
        found.append(Collective(kind, tuple(_arrays(instrs[first][1])), size))
    for c in collectives(hlo_text):
        if c.kind != "all-reduce":
            found.append(c)
    return found


def partitioned_text(fn: Callable, *args, **kwargs) -> str:
    """The HLO text of ``fn`` right after SPMD partitioning, before the
    backend's own passes (compiled once more, with XLA's dump switched on)."""
    import glob
    import os
    import tempfile

    lowered = fn.lower(*args, **kwargs)
    with tempfile.TemporaryDirectory() as d:
        lowered.compile({"xla_dump_to": d, "xla_dump_hlo_pass_re": "spmd-partitioning"})
        files = glob.glob(os.path.join(d, "*after_spmd-partitioning*.txt"))
        if not files:
            raise RuntimeError("XLA wrote no HLO after 'spmd-partitioning' (has the pass been renamed?)")
        return max((open(f).read() for f in files), key=len)


def accelerator_collectives(fn: Callable, *args, **kwargs) -> dict[str, dict[str, int]]:
    """``{kind: {"count", "bytes"}}`` of ``fn``'s collectives as XLA's GPU and
    TPU pipelines move them (see `reassociated_collectives`), read on any backend."""
    return _summarise(reassociated_collectives(partitioned_text(fn, *args, **kwargs)))
