"""Read the collectives out of a compiled XLA program."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import numpy as np

from .._typing import typechecked

_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
DTYPE_BYTES = {
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
    # the devices (indices into the mesh's devices, flat) that take part together: each group of a
    # reduction or gather, each (source, target) pair of a permute; None: every device
    groups: tuple[tuple[int, ...], ...] | None = None


_PAIRS = re.compile(r"source_target_pairs=\{(?P<body>[0-9,{}]*)\}")
_LISTED = re.compile(r"replica_groups=\{(?P<body>[0-9,{}]*)\}")
_IOTA = re.compile(r"replica_groups=\[(?P<shape>[0-9,]+)\]<=\[(?P<dims>[0-9,]+)\](?:T\((?P<perm>[0-9,]+)\))?")
_MESH = re.compile(r"replica_groups=mesh\[(?P<axes>[^\]]*)\](?:,\s*device_ids=\((?P<ids>[^)]*\)?)\))?\s*"
                   r"\{(?P<over>[^}]*)\}")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    return ids.transpose(perm) if perm else ids


def collective_groups(attributes: str) -> tuple[tuple[int, ...], ...] | None:
    """The device groups an HLO collective's attributes name (its ``source_target_pairs``, or
    ``replica_groups`` listed, as an iota, or over named axes of a mesh); None for every device."""
    if (m := _PAIRS.search(attributes)) is not None:
        return tuple(tuple(_ints(g)) for g in re.findall(r"\{([0-9,]*)\}", m.group("body")))
    if (m := _IOTA.search(attributes)) is not None:
        shape = _ints(m.group("shape"))
        ids = _iota(_ints(m.group("dims")), _ints(m.group("perm")) if m.group("perm") else None)
        return tuple(tuple(int(x) for x in row) for row in ids.reshape(shape))
    if (m := _MESH.search(attributes)) is not None:
        axes = re.findall(r"'([^']+)'=(\d+)", m.group("axes"))
        names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
        ids = np.arange(int(np.prod(sizes)))
        if m.group("ids"):
            if (t := re.match(r"\[([0-9,]+)\](?:T\(([0-9,]+)\))?", m.group("ids"))) is not None:
                ids = _iota(_ints(t.group(1)), _ints(t.group(2)) if t.group(2) else None).reshape(-1)
            else:
                ids = np.asarray(_ints(m.group("ids").strip("()")))
        ids = ids.reshape(sizes)
        over = [names.index(a) for a in re.findall(r"'([^']+)'", m.group("over"))]
        rest = [d for d in range(len(sizes)) if d not in over]
        grouped = ids.transpose(rest + over).reshape(-1, int(np.prod([sizes[d] for d in over])) if over else 1)
        return tuple(tuple(int(x) for x in row) for row in grouped)
    if (m := _LISTED.search(attributes)) is not None:
        groups = tuple(tuple(_ints(g)) for g in re.findall(r"\{([0-9,]*)\}", m.group("body")))
        return groups or None
    return None


def array_shapes(shape_text: str) -> list[tuple[str, tuple[int, ...]]]:
    out = []
    for dtype, dims in _ARRAY.findall(shape_text):
        if dtype in DTYPE_BYTES:
            out.append((dtype, tuple(int(d) for d in dims.split(",") if d)))
    return out


# "%name = <shape> op(%a, %b), attributes" (ROOT first in a computation's last line)
# a shape: "f32[4,8]{1,0}", with a TPU layout "f32[4,8]{1,0:T(8,128)}", or a tuple of them
_SHAPE = r"\((?:[^()]|\([^()]*\))*\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?"
_INSTRUCTION = re.compile(rf"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>{_SHAPE})\s+"
                          r"(?P<op>[a-z\-]+)\((?P<args>[^)]*)\)(?P<rest>.*)$")
_HEADER = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*(?:\((?P<params>.*)\)\s*->.*)?\{\s*$")
_PARAM = re.compile(rf"([\w.\-]+):\s*({_SHAPE})")
# computations an instruction runs: once per run of it, or (a while loop's) once per iteration
_CALLED = re.compile(r"\b(calls|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_CALLED_MANY = re.compile(r"\b(branch_computations|called_computations)=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    op: str
    shape: str
    operands: tuple[str, ...]
    attributes: str
    literal: str = ""  # what a constant holds


def parse_module(hlo_text: str) -> tuple[dict[str, list[Instruction]], dict[str, dict[str, str]], str | None]:
    """``(computations, parameter shapes, entry)`` of an HLO module's text:
    each computation's instructions in order, and its parameters' shapes."""
    computations: dict[str, list[Instruction]] = {}
    params: dict[str, dict[str, str]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        if (h := _HEADER.match(line)) is not None:
            current = h.group("name")
            computations[current], params[current] = [], dict(_PARAM.findall(h.group("params") or ""))
            if h.group("entry"):
                entry = current
        elif current is not None and (m := _INSTRUCTION.match(line)) is not None:
            # a long tuple's operands carry comments ("/*index=5*/%x"): not operands
            operands = tuple(re.findall(r"%?([\w.\-]+)", re.sub(r"/\*.*?\*/", "", m.group("args"))))
            literal = m.group("args") if m.group("op") == "constant" else ""
            computations[current].append(Instruction(m.group("name"), m.group("op"), m.group("shape"), operands,
                                                     m.group("rest"), literal))
    return computations, params, entry


def _trip_count(ins: Instruction, computations: dict[str, list[Instruction]],
                caller: list[Instruction] | None = None) -> int:
    """How many times a while loop runs: XLA's ``known_trip_count`` (XLA:CPU
    writes it), else read from the loop: its condition compares a counter
    with a bound (``counter < N``), its body adds a constant step to that
    counter, and the loop's initial tuple (in ``caller``, the computation
    running it) starts it at a constant: ``ceil((N - start) / step)``, with
    start 0 and step 1 where they cannot be read (a ``lax.scan`` as written;
    libtpu's rewrites step by 2 or more); else 1. Both the compiled text
    (``%name``) and the lowered one (``name``) read."""
    m = _TRIP_COUNT.search(ins.attributes)
    if m:
        return int(m.group(1))
    m = re.search(r"\bcondition=%?([\w.\-]+)", ins.attributes)
    condition = computations.get(m.group(1), []) if m else []
    constants = {c.name: c.literal for c in condition if c.op == "constant" and re.fullmatch(r"-?\d+", c.literal)}
    # inside a shard_map, Shardy's lowered text wraps each operand in a "Sharding" custom-call
    wrapped = {c.name: c.operands[0] for c in condition
               if c.op == "custom-call" and 'custom_call_target="Sharding"' in c.attributes and len(c.operands) == 1}
    unwrap = lambda name: wrapped.get(name, name)  # noqa: E731
    compares = [c for c in condition if c.op == "compare" and "direction=LT" in c.attributes and len(c.operands) == 2
                and unwrap(c.operands[1]) in constants]
    if len(compares) != 1 or (bound := int(constants[unwrap(compares[0].operands[1])])) <= 0:
        return 1
    start, step = 0, 1
    index = _tuple_index(condition, unwrap(compares[0].operands[0]))
    m = re.search(r"\bbody=%?([\w.\-]+)", ins.attributes)
    body = computations.get(m.group(1), []) if m else []
    if index is not None and body:
        step = _constant_step(body, index) or 1
        if caller is not None and ins.operands:
            start = _constant_element(caller, ins.operands[0], index) or 0
    return max(-(-(bound - start) // step), 0) if step > 0 else 1


def _tuple_index(computation: list[Instruction], name: str) -> int | None:
    """The index ``name`` reads from the computation's tuple parameter
    (``get-tuple-element(param), index=i``, through copies), or None."""
    x = _through_copies({i.name: i for i in computation}, name)
    if x is None or x.op != "get-tuple-element":
        return None
    m = re.search(r"\bindex=(\d+)", x.attributes)
    return int(m.group(1)) if m else None


def _through_copies(by_name: dict[str, Instruction], name: str) -> Instruction | None:
    """The instruction ``name`` is a copy, conversion or bitcast of (itself if none)."""
    x = by_name.get(name)
    while x is not None and x.op in ("copy", "convert", "bitcast") and x.operands:
        x = by_name.get(x.operands[0])
    return x


def _constant_literal(by_name: dict[str, Instruction], name: str) -> int | None:
    x = _through_copies(by_name, name)
    return int(x.literal) if x is not None and x.op == "constant" and re.fullmatch(r"-?\d+", x.literal) else None


def _constant_step(body: list[Instruction], index: int) -> int | None:
    """What the loop body adds to tuple element ``index`` each iteration,
    when its ROOT tuple holds ``element + constant``."""
    by_name = {i.name: i for i in body}
    root = body[-1] if body else None
    if root is None or root.op != "tuple" or index >= len(root.operands):
        return None
    add = by_name.get(root.operands[index])
    if add is None or add.op != "add" or len(add.operands) != 2:
        return None
    for counter, other in (add.operands, add.operands[::-1]):
        if _tuple_index(body, counter) == index:
            return _constant_literal(by_name, other)
    return None


def _constant_element(caller: list[Instruction], name: str, index: int) -> int | None:
    """Element ``index`` of the tuple ``name`` builds in ``caller``, when it is
    a constant."""
    by_name = {i.name: i for i in caller}
    tup = by_name.get(name)
    if tup is None or tup.op != "tuple" or index >= len(tup.operands):
        return None
    return _constant_literal(by_name, tup.operands[index])


def _callees(ins: Instruction, computations: dict[str, list[Instruction]],
             caller: list[Instruction] | None = None) -> list[tuple[str, int]]:
    """``(computation, runs per run of ins)`` for what ``ins`` calls (not the
    scalar functions a reduce or an all-reduce applies); ``caller`` is the
    computation ``ins`` is in."""
    trips = _trip_count(ins, computations, caller) if ins.op == "while" else 1
    out = [(name, trips if kind in ("body", "condition") else 1) for kind, name in _CALLED.findall(ins.attributes)]
    if ins.op == "call":  # a called computation (in lowered text), not a reduction's scalar function
        out += [(name, 1) for name in re.findall(r"\bto_apply=%?([\w.\-]+)", ins.attributes)]
    for _, names in _CALLED_MANY.findall(ins.attributes):
        out += [(name, 1) for name in re.findall(r"%?([\w.\-]+)", names)]
    return out


def executions(computations: dict[str, list[Instruction]], entry: str | None, *, loops: bool = True) -> dict[str, int]:
    """How many times each computation runs in one run of ``entry``: a while
    loop's body (and condition) once per iteration, by the trip count XLA
    knows (``loops=False``: once, as XLA's own cost analysis counts it)."""
    if entry is None:
        return {name: 1 for name in computations}
    order, seen = [], set()

    def visit(name):  # callers before callees
        if name in seen or name not in computations:
            return
        seen.add(name)
        for ins in computations[name]:
            for callee, _ in _callees(ins, computations):
                visit(callee)
        order.append(name)

    visit(entry)
    times = dict.fromkeys(order, 0)
    times[entry] = 1
    for name in reversed(order):
        for ins in computations[name]:
            for callee, trips in _callees(ins, computations, computations[name]):
                if callee in times:
                    times[callee] += times[name] * (trips if loops else 1)
    return times


def _elements(shape_text: str) -> int:
    return sum(int(np.prod(s, dtype=np.int64)) for _, s in array_shapes(shape_text))


_KERNEL_COST = re.compile(r'"cost_estimate":\{"flops":"?(\d+)')
_ELEMENTWISE = {"add", "subtract", "multiply", "divide", "maximum", "minimum", "negate", "abs", "compare", "select",
                "and", "or", "xor", "not", "clamp", "remainder", "power", "sign", "floor", "ceil", "round-nearest-even"}


def _flops(ins: Instruction, shapes: dict[str, str]) -> float:
    """An estimate of ``ins``'s own FLOPs, weighted as XLA's cost analysis
    weighs them: 2 per multiply-add of a dot or convolution, one per element
    of an elementwise or reduce op."""
    out = _elements(ins.shape)
    if ins.op == "dot":
        lhs = array_shapes(shapes.get(ins.operands[0], ""))
        m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attributes)
        if not lhs or m is None:
            return 0.0
        contracted = [lhs[0][1][int(d)] for d in m.group(1).split(",") if d]
        return 2.0 * out * float(np.prod(contracted))
    if ins.op == "convolution":
        return _convolution_flops(ins, shapes, out)
    if ins.op in _ELEMENTWISE:
        return float(out)
    if ins.op == "custom-call" and (m := _KERNEL_COST.search(ins.attributes)):
        return float(m.group(1))  # a Pallas kernel's own estimate (megablox's grouped matmuls on a TPU)
    if ins.op in ("reduce", "reduce-window") and ins.operands:
        return float(_elements(shapes.get(ins.operands[0], "")))
    return 0.0


_WINDOW = re.compile(r"window=\{([^}]*)\}")


def _window(attributes: str, n: int) -> dict[str, list]:
    """A convolution's window, per spatial dim: size, stride, padding (low,
    high), lhs and rhs dilation (XLA's defaults where the text leaves them)."""
    fields = dict(f.split("=", 1) for f in _WINDOW.search(attributes).group(1).split()) if "window={" in attributes else {}
    ints = lambda key, default: [int(v) for v in fields[key].split("x")] if key in fields else [default] * n  # noqa: E731
    pads = [tuple(int(v) for v in p.split("_")) for p in fields["pad"].split("x")] if "pad" in fields else [(0, 0)] * n
    return dict(size=ints("size", 1), stride=ints("stride", 1), pad=pads, lhs_dilate=ints("lhs_dilate", 1),
                rhs_dilate=ints("rhs_dilate", 1))


def _taps(n_in: int, n_out: int, size: int, stride: int, pad_lo: int, lhs_dilate: int, rhs_dilate: int) -> int:
    """Multiply-adds along one spatial dim, summed over its outputs: the
    window taps that land on an input element (not padding, not a hole of
    ``lhs_dilate``)."""
    o = np.arange(n_out)[:, None] * stride + np.arange(size)[None, :] * rhs_dilate - pad_lo
    return int(np.sum((o >= 0) & (o <= (n_in - 1) * lhs_dilate) & (o % lhs_dilate == 0)))


def _convolution_flops(ins: Instruction, shapes: dict[str, str], out: int) -> float:
    """2 per multiply-add a convolution does: each output element's input
    features times the window taps it reads, counting only taps on real input.
    libtpu writes a batched matmul as a convolution whose window (dilated so
    that one tap lands) stands for a batch dim: counted by its window size
    that would be several times the work done."""
    if len(ins.operands) < 2:
        return 0.0
    lhs, rhs = (array_shapes(shapes.get(o, "")) for o in ins.operands[:2])
    m = re.search(r"dim_labels=([^_]*)_([^-]*)->(\S+)", ins.attributes)
    outs = array_shapes(ins.shape)
    if not lhs or not rhs or not outs or m is None or "i" not in m.group(2):
        return 0.0
    lhs_labels, rhs_labels, out_labels = m.group(1), m.group(2), m.group(3).rstrip(",")
    spatial = [c for c in lhs_labels if c.isdigit()]
    w = _window(ins.attributes, len(spatial))
    per_output, taps = float(out), 1.0
    for j, dim in enumerate(spatial):
        n_in, n_out = lhs[0][1][lhs_labels.index(dim)], outs[0][1][out_labels.index(dim)]
        per_output /= max(n_out, 1)
        taps *= _taps(n_in, n_out, w["size"][j], w["stride"][j], w["pad"][j][0], w["lhs_dilate"][j], w["rhs_dilate"][j])
    return 2.0 * per_output * taps * rhs[0][1][rhs_labels.index("i")]


def _loop_counts(hlo_text: str, ops: tuple[str, ...] | None = None) -> tuple[float, float]:
    """`_flops` summed over the program (over its ops named in ``ops`` only,
    when given) with each loop body counted once per iteration, and with each
    counted once (as XLA's cost analysis does)."""
    computations, params, entry = parse_module(hlo_text)
    own = {}
    for name, instructions in computations.items():
        shapes = dict(params.get(name, {}))
        shapes.update({ins.name: ins.shape for ins in instructions})
        own[name] = sum(_flops(ins, shapes) for ins in instructions if ops is None or ins.op in ops)
    with_loops, once = executions(computations, entry), executions(computations, entry, loops=False)
    return sum(own[c] * n for c, n in with_loops.items()), sum(own[c] * n for c, n in once.items())


def loop_factor(hlo_text: str) -> float:
    """How many times more FLOPs one run of the program does than XLA's own
    cost analysis counts, which counts a while loop's body once: the ratio of
    an estimate with each body counted once per iteration to the same
    estimate with each counted once (1.0 for a program without loops)."""
    with_loops, counted = _loop_counts(hlo_text)
    return 1.0 if counted == 0 else with_loops / counted


def estimated_flops(hlo_text: str, ops: tuple[str, ...] | None = None) -> float:
    """One run's FLOPs as `_flops` estimates them (dots and convolutions 2 per
    multiply-add, elementwise ops and reductions 1 per element), each loop body
    counted once per iteration; read from a program before the compiler's
    passes, it counts every op as written (no common subexpression merged).
    ``ops`` (e.g. ``("dot",)``): count only those HLO ops."""
    return _loop_counts(hlo_text, ops)[0]


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective that one run of an HLO module executes, with the
    per-device bytes of its result: one inside a while loop's body as many
    times as the loop runs. Asynchronous pairs count once (at ``-start``; for
    an all-gather-start the result is the last array of its tuple)."""
    computations, _, entry = parse_module(hlo_text)
    times = executions(computations, entry)
    found = []
    for name, instructions in computations.items():
        for ins in instructions:
            op = ins.op
            if op.endswith("-done"):
                continue
            kind = op[: -len("-start")] if op.endswith("-start") else op
            if kind not in _KINDS:
                continue
            arrays = array_shapes(ins.shape)
            if op == "collective-permute-start":  # libtpu's tuple ends in two u32[] context scalars
                arrays = [a for a in arrays if a != ("u32", ())] or arrays
            if op.endswith("-start") and kind in ("all-gather", "collective-permute", "all-to-all") and len(arrays) > 1:
                arrays = arrays[len(arrays) // 2:]
            nbytes = sum(DTYPE_BYTES[d] * int(np.prod(s, dtype=np.int64)) for d, s in arrays)
            found += [Collective(kind, tuple(arrays), nbytes, collective_groups(ins.attributes))] * times.get(name, 1)
    return found


@typechecked
def collective_summary(fn_or_text: Callable | str, *args, **kwargs) -> dict[str, dict[str, int]]:
    """``{kind: {"count": n, "bytes": b}}`` for a compiled program.

    Pass the HLO text of a compiled program, or a jitted function (``jax.jit``
    or a redeqx step) with example arguments: it is lowered and compiled for
    them (nothing runs). Bytes are per device, summed over calls of that
    kind; a collective inside a loop (a ``lax.scan`` over stacked layers,
    ``accumulate``'s micro-batches) counts once per iteration.

    **Example:**

    ```python
    print(redeqx.collective_summary(train_step, state, batch))
    # {'all-reduce': {'count': 6, 'bytes': 81920}}
    ```
    """
    text = fn_or_text if isinstance(fn_or_text, str) else compiled_text(fn_or_text, *args, **kwargs)
    return summarise(collectives(text))


def summarise(found: list[Collective]) -> dict[str, dict[str, int]]:
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


_COPYING = ("copy", "transpose", "slice", "dynamic-slice", "concatenate", "gather")


def repeated_copies(hlo_text: str, shapes: list[tuple[int, ...]], min_runs: int) -> list[tuple[str, str, int]]:
    """``(op, shape copied from, runs)`` of each copy out of an array of one
    of ``shapes`` that the program makes at least ``min_runs`` times (inside
    a loop: a decoding loop's body runs once per token). A copy is a
    ``dynamic-slice`` of such an array anywhere (an index computed in the
    loop: a GPU backend materialises the slice, inside a fusion or not) or
    any of ``copy``, ``transpose``, ``slice``, ``concatenate``, ``gather``
    that makes a buffer (outside a fusion, or a fusion's result). Static
    slices read inside a fusion (a product reading its weight in place) are
    not copies."""
    computations, params, entry = parse_module(hlo_text)
    runs = executions(computations, entry)
    fused = {m.group(1) for c in computations.values() for i in c if i.op == "fusion"
             for m in [re.search(r"\bcalls=%?([\w.\-]+)", i.attributes)] if m}
    wanted = {tuple(s) for s in shapes}
    found = []
    for name, instructions in computations.items():
        if runs.get(name, 0) < min_runs:
            continue
        shape_of = dict(params.get(name, {}))
        shape_of.update({i.name: i.shape for i in instructions})
        root = instructions[-1].name if instructions else None
        for ins in instructions:
            if ins.op not in _COPYING or not ins.operands:
                continue
            source = array_shapes(shape_of.get(ins.operands[0], ""))
            if not source or source[0][1] not in wanted:
                continue
            whole = source[0][1]
            layer = next((d for d in whole if d != 1), 1)
            if _elements(ins.shape) * layer < int(np.prod(whole, dtype=np.int64)):
                continue  # less than a layer: a few slots of a cache, read in place
            if ins.op == "dynamic-slice" or name not in fused or ins.name == root:
                found.append((ins.op, shape_of[ins.operands[0]].split("{")[0], runs[name]))
    return found
