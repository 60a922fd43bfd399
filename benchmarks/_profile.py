"""A compiled step's device time by kind, from a profile (issue 41's breakdown).

``breakdown(xplane, hlo_text, steps)`` reads the kernels a device ran
(``jax.profiler.ProfileData``: each GPU kernel event names the HLO instruction
it runs in its ``hlo_op`` stat), looks each instruction up in the compiled
program's text (``compiled.as_text()``: its opcode, its custom-call target,
what its fused computation holds, and the Python frames its metadata points
at), and sums the time by kind:

- ``matmuls``: cuBLAS calls, Triton/cuBLAS GEMM fusions, any fusion holding a
  ``dot`` or ``convolution``, Pallas grouped-matmul kernels;
- ``attention``: cuDNN's fused attention (forward and backward);
- ``loss``: what the loss function's frames made (the log-softmax, the gather of the labels);
- ``optimizer update``: what optax's or the step's update made (Adam's moments, the weight update, the norm);
- ``copies``: copies, transposes, memcpy/memset, dynamic (update) slices on their own;
- ``collectives``; ``norms and elementwise``: every other instruction;
- ``other``: kernels no instruction of the program names.

The raw per-instruction times are kept too (``top``), so a wrong
classification can be re-read from the JSON without another GPU run.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

KINDS = ("matmuls", "attention", "norms and elementwise", "loss", "optimizer update", "copies", "collectives", "other")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) \(.*\) -> .* \{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = \S+(?: \S+)*? ([a-z][\w\-]*)\(")
_CALLS = re.compile(r"calls=%([\w.\-]+)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_FRAME = re.compile(r"stack_frame_id=(\d+)")
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_COPIES = ("copy", "copy-start", "copy-done", "transpose", "dynamic-slice", "dynamic-update-slice", "bitcast",
           "slice", "concatenate", "pad")
# function names whose frames mark the loss, and the optimizer update (redeqx.state.optimizer_update and optax)
_LOSS_FUNCTIONS = ("loss", "cross_entropy", "log_softmax", "logsumexp")
# and the module whose code is all loss: `redeqx.models.cross_entropy`'s derivative rules, whose
# metadata names only their own function (``_tangent``), not the loss they belong to
_LOSS_FILES = ("redeqx/models/_losses.py",)
_UPDATE_FUNCTIONS = ("_update", "update_fn", "apply_updates", "apply_gradients", "global_norm", "clip")


def _frames(text: str) -> dict[int, list[tuple[str, str]]]:
    """stack_frame_id -> [(file, function), innermost first], from the text's frame tables."""
    def table(name):
        i = text.find(f"\n{name}\n")
        if i < 0:
            return {}
        rows = {}
        for line in text[i + len(name) + 2:].split("\n"):
            if not line.strip():
                break
            key, _, value = line.partition(" ")
            rows[int(key)] = value
        return rows

    files = {k: v.strip('"') for k, v in table("FileNames").items()}
    functions = {k: v.strip('"') for k, v in table("FunctionNames").items()}
    locations = {k: dict(re.findall(r"(\w+)=(\d+)", v)) for k, v in table("FileLocations").items()}
    stack = {k: dict(re.findall(r"(\w+)=(\d+)", v)) for k, v in table("StackFrames").items()}

    def chain(frame: int) -> list[tuple[str, str]]:
        out, seen = [], set()
        while frame in stack and frame not in seen:
            seen.add(frame)
            loc = locations.get(int(stack[frame]["file_location_id"]), {})
            out.append((files.get(int(loc.get("file_name_id", 0)), "?"),
                        functions.get(int(loc.get("function_name_id", 0)), "?")))
            parent = int(stack[frame].get("parent_frame_id", 0))
            frame = parent if parent != frame else -1
        return out

    return {k: chain(k) for k in stack}


def hlo_ops(text: str) -> dict[str, dict]:
    """Instruction name -> {opcode, target, inner (opcodes of its fused computation), frames}."""
    frames = _frames(text)
    computations: dict[str, list[str]] = defaultdict(list)  # computation -> its instructions' opcodes
    ops, current = {}, None
    for line in text.split("\n"):
        m = _COMPUTATION.match(line)
        if m:
            current = m.group(1)
            continue
        m = _INSTRUCTION.match(line)
        if not m or current is None:
            continue
        name, opcode = m.groups()
        computations[current].append(opcode)
        target = _TARGET.search(line)
        if opcode == "custom-call" and target:
            computations[current].append("custom-call:" + target.group(1))
        calls = _CALLS.search(line)
        frame = _FRAME.search(line)
        ops[name] = {"opcode": opcode, "target": target.group(1) if target else "",
                     "calls": calls.group(1) if calls else "",
                     "frames": frames.get(int(frame.group(1)), []) if frame else []}
    for op in ops.values():
        op["inner"] = sorted(set(computations.get(op.pop("calls"), [])))
    return ops


def kernel_names(ops: dict[str, dict]) -> dict[str, str]:
    """Kernel name -> instruction name. XLA:GPU names a fusion's kernel after the fusion with every
    character PTX does not allow in a name made ``_`` (``%loop_slice_fusion.26`` runs as
    ``loop_slice_fusion_26``), so a kernel inside a command buffer is found by that name."""
    return {re.sub(r"[^A-Za-z0-9_$]", "_", name): name for name in ops}


def kind_of(op: dict | None, kernel: str = "") -> str:
    """One of `KINDS` for an instruction (``hlo_ops``' value) or, lacking one, a kernel's name."""
    kernel = kernel.lower()
    if op is None:
        if "memcpy" in kernel or "memset" in kernel:
            return "copies"
        if "fmha" in kernel or "flash" in kernel:
            return "attention"
        if any(s in kernel for s in ("gemm", "nvjet", "xmma", "cutlass", "wgmma")):
            return "matmuls"
        return "other"
    opcode, target, inner = op["opcode"], op["target"].lower(), " ".join(op["inner"]).lower()
    if opcode.startswith(_COLLECTIVES):
        return "collectives"
    if "fmha" in target or "fmha" in inner or "flash" in kernel or "fmha" in kernel:
        return "attention"
    if (opcode in ("dot", "convolution") or "gemm" in target or "matmul" in target or "mosaic" in target
            or "dot" in op["inner"] or "convolution" in op["inner"] or "gemm" in inner):
        return "matmuls"
    functions = [f for _, f in op["frames"]]
    files = [f for f, _ in op["frames"]]
    if any("optax" in f for f in files) or any(f.endswith(_UPDATE_FUNCTIONS) for f in functions):
        return "optimizer update"
    if any(any(s in f for s in _LOSS_FUNCTIONS) for f in functions[:2]) or (files and files[0].endswith(_LOSS_FILES)):
        return "loss"
    if opcode in _COPIES or (opcode == "fusion" and op["inner"] and set(op["inner"]) <= {*_COPIES, "parameter"}):
        return "copies"
    return "norms and elementwise"


def source_of(op: dict | None) -> str:
    """The innermost Python function an instruction's metadata names (``RMSNorm.__call__``), where
    its code came from; ``(no source)`` for an instruction without one (or a kernel without one).
    A fusion is named after its root's source: SwiGLU's backward, which ends in the sum of the
    gradients of the product it feeds, reads as that product's function."""
    frames = (op or {}).get("frames") or []
    return frames[0][1] if frames else "(no source)"


def device_events(path: str):
    """(name, hlo_op, start_ns, duration_ns) of every event on the GPU planes of an ``.xplane.pb``."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(path)
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if line.name in ("XLA Modules", "XLA Ops", "Steps", "XLA TraceMe"):  # derived lines: counted twice
                continue
            for ev in line.events:
                stats = dict(ev.stats)
                yield ev.name, str(stats.get("hlo_op", "")), ev.start_ns, ev.duration_ns


def _by_source(totals: dict[tuple[str, str], list], unit: str, scale: float, steps: int = 1) -> list[dict]:
    """(kind, function) -> [total, kernels] outside matmuls and attention, largest first, each total
    times ``scale``: what the step's other time (or bytes) is made of, by the code that made it."""
    rows = [{"kind": kind, "function": function, unit: round(v * scale, 3), "kernels": n // steps}
            for (kind, function), (v, n) in totals.items() if kind not in ("matmuls", "attention")]
    return sorted(rows, key=lambda r: -r[unit])


def _by_kind(totals: dict[tuple[str, str], list]) -> tuple[dict[str, float], dict[str, int]]:
    """`_by_source`'s totals summed by kind: (total, kernels)."""
    value, count = defaultdict(float), defaultdict(int)
    for (kind, _), (v, n) in totals.items():
        value[kind] += v
        count[kind] += n
    return value, count


def breakdown(xplane: str, hlo_text: str, steps: int, top: int = 30) -> dict:
    """Device milliseconds per step by kind, the device's busy time (the union
    of its events) and the ``top`` instructions by time, each with its kind."""
    return tally(device_events(xplane), hlo_text, steps, top)


def tally(events, hlo_text: str, steps: int, top: int = 30) -> dict:
    """`breakdown` of ``(kernel, hlo_op, start_ns, duration_ns)`` events (`device_events`)."""
    ops = hlo_ops(hlo_text)
    kernels = kernel_names(ops)
    by_source: dict[tuple[str, str], list] = defaultdict(lambda: [0.0, 0])  # (kind, function) -> [ms, kernels]
    by_op: dict[str, list] = {}
    spans = []
    for name, hlo_op, start, duration in events:
        hlo_op = hlo_op if hlo_op in ops else kernels.get(hlo_op, hlo_op)
        op = ops.get(hlo_op)
        if op is None or op["opcode"] == "call":
            # inside a CUDA command buffer every kernel names the buffer as its instruction
            # (one instruction for the whole step on an H200); XLA names a fusion's kernel
            # after the fusion, so the kernel's own name finds its instruction
            hlo_op = name if name in ops else kernels.get(name, name)
            op = ops.get(hlo_op)
        kind = kind_of(op, name)
        total = by_source[kind, source_of(op)]
        total[0] += duration / 1e6 / steps
        total[1] += 1
        entry = by_op.setdefault(hlo_op or name, [kind, 0.0, 0, name[:80]])
        entry[1] += duration / 1e6 / steps
        entry[2] += 1
        spans.append((start, start + duration))
    busy, end = 0.0, None
    for a, b in sorted(spans):  # the union of the intervals: time the device ran anything
        if end is None or a > end:
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    ranked = sorted(by_op.items(), key=lambda kv: -kv[1][1])[:top]
    by_kind, _ = _by_kind(by_source)
    return {"ms_per_step": {k: round(by_kind.get(k, 0.0), 3) for k in KINDS},
            "busy_ms_per_step": busy / 1e6 / steps,
            "by_source": _by_source(by_source, "ms", 1.0, steps),
            "top": [{"op": op, "kind": k, "ms": round(ms, 3), "launches": n // steps, "kernel": kernel}
                    for op, (k, ms, n, kernel) in ranked]}


# ----------------------------------------------------------------------------- the same split, from the text alone
# read with the planner's parser of compiled programs (`redeqx.planner._hlo`: computations, how often
# each runs, array shapes)

_SLICES = ("slice", "dynamic-slice")
_NO_KERNEL = ("parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "partition-id",
              "replica-id", "opt-barrier", "add-dependency", "while", "call", "conditional")


_PER_ELEMENT = ("convert", "bitcast", "reshape", "copy", "bitcast-convert")  # one element in, one out
_ASYNC_COPY = {"copy-start": 2, "copy-done": 0}
_MEMORY_SPACE = re.compile(r"S\([1-9]\d*\)")  # a layout's memory space other than device memory's (a TPU's S(3))


def _nbytes(shape: str, skip_workspace: bool = False) -> int:
    """Bytes of the arrays a shape text names (a tuple's elements summed; with ``skip_workspace``
    a custom call's ``s8`` scratch buffer left out)."""
    from redeqx.planner._hlo import DTYPE_BYTES, array_shapes

    return sum(DTYPE_BYTES[dtype] * math.prod(dims) for dtype, dims in array_shapes(shape)
               if not (skip_workspace and dtype == "s8"))


def _elements(shape: str) -> int:
    from redeqx.planner._hlo import array_shapes

    return sum(math.prod(dims) for _, dims in array_shapes(shape))


def _elements_taken(name: str, users: dict) -> int | None:
    """How many of ``name``'s elements a fusion reads when it only slices them (a table read at some
    rows, a stack at one layer), through element-wise conversions in between (a stack cast to bf16,
    then sliced: XLA reads the slice); None when it reads them all."""
    if not users[name]:
        return None
    taken = 0
    for u in users[name]:
        if u.op in _SLICES or u.op == "gather" and u.operands[0] == name:
            taken += _elements(u.shape)
        elif u.op in _PER_ELEMENT and len(u.operands) == 1 and (below := _elements_taken(u.name, users)) is not None:
            taken += below
        else:
            return None
    return taken


def _fusion_bytes(ins, fused: list, shapes: dict[str, str]) -> int:
    """Bytes a fusion reads and writes: a parameter only sliced inside is read as its slices, the
    buffer a dynamic-update-slice or a scatter writes in place is neither read nor written whole
    (only the update is written)."""
    by_name = {i.name: i for i in fused}
    users = defaultdict(list)
    for i in fused:
        for o in i.operands:
            users[o].append(i)
    root = fused[-1]
    roots = [by_name[o] for o in root.operands] if root.op == "tuple" else [root]
    update = {"dynamic-update-slice": 1, "scatter": 2}  # which operand of an in-place root is its update
    in_place = {r.operands[0] for r in roots if r.op in update}
    params = {int(i.operands[0]): i for i in fused if i.op == "parameter"}
    read = 0
    for index, operand in enumerate(ins.operands):
        p = params.get(index)
        if p is None:
            read += _nbytes(shapes.get(operand, ""))
        elif p.name not in in_place:
            whole, taken = _elements(p.shape), _elements_taken(p.name, users)
            read += _nbytes(p.shape) * (whole if taken is None else min(taken, whole)) // max(whole, 1)
    return read + sum(_nbytes(by_name[r.operands[update[r.op]]].shape) if r.op in update else _nbytes(r.shape)
                      for r in roots)


def kernels(text: str, start: str | None = None) -> list[dict]:
    """The kernels a compiled GPU program launches per call (or per run of computation ``start``, a
    loop's body), read from its text: each with the bytes it reads and writes (`_fusion_bytes`) and
    how many times it runs (loops' trip counts)."""
    from redeqx.planner._hlo import executions, parse_module

    computations, _, entry = parse_module(text)
    fused = {m for body in computations.values() for i in body if i.op == "fusion"
             for m in re.findall(r"\bcalls=%?([\w.\-]+)", i.attributes)}
    out = []
    for name, times in executions(computations, start or entry).items():
        if not times or name in fused:
            continue
        shapes = {i.name: i.shape for i in computations[name]}
        for ins in computations[name]:
            if ins.op in _NO_KERNEL:
                continue
            calls = re.search(r"\bcalls=%?([\w.\-]+)", ins.attributes) if ins.op == "fusion" else None
            if calls:
                moved = _fusion_bytes(ins, computations[calls[1]], shapes)
            elif ins.op in _ASYNC_COPY:  # its operand read and written once, by the pair (not its tuples' bytes)
                moved = _ASYNC_COPY[ins.op] * _nbytes(shapes.get(ins.operands[0], ""))
            else:
                moved = sum(_nbytes(shapes.get(o, "")) for o in ins.operands) + _nbytes(ins.shape, ins.op == "custom-call")
            out.append({"name": ins.name, "bytes": moved, "times": times,
                        "between_memories": ins.op in _ASYNC_COPY and bool(_MEMORY_SPACE.search(ins.shape))})
    return out


def static_tally(text: str, bandwidth: float, top: int = 25) -> dict:
    """`tally`'s split of a compiled GPU program without running it: kernels and gigabytes moved
    per step by kind, and the milliseconds those bytes take at ``bandwidth`` (bytes/s), the floor of
    every kind that is not a matmul or attention (their time is set by FLOPs, not bytes)."""
    ops = hlo_ops(text)
    by_source: dict[tuple[str, str], list] = defaultdict(lambda: [0, 0])  # (kind, function) -> [bytes, kernels]
    ranked = []
    for k in kernels(text):
        op = ops.get(k["name"])
        kind, moved = kind_of(op), k["bytes"] * k["times"]
        total = by_source[kind, source_of(op)]
        total[0] += moved
        total[1] += k["times"]
        ranked.append((moved, k["name"], kind, k["times"], [f for _, f in (op or {}).get("frames", [])[:3]]))
    ranked.sort(key=lambda r: -r[0])
    moved, count = _by_kind(by_source)
    return {"kernels": {kind: count[kind] for kind in KINDS if count[kind]},
            "gb": {kind: round(moved[kind] / 1e9, 3) for kind in KINDS if count[kind]},
            "floor_ms": {kind: round(moved[kind] / bandwidth * 1e3, 3) for kind in KINDS if count[kind]},
            "by_source": _by_source(by_source, "gb", 1e-9),
            "top": [{"op": n, "kind": kind, "gb": round(b / 1e9, 3), "times": t, "frames": f}
                    for b, n, kind, t, f in ranked[:top]]}


def longest_loop(text: str) -> tuple[str, int] | None:
    """(body, trip count) of the loop that runs most often (a generation's loop over tokens)."""
    from redeqx.planner._hlo import _callees, parse_module

    computations, _, _ = parse_module(text)
    loops = [(body, trips) for caller in computations.values() for i in caller if i.op == "while"
             for body, trips in _callees(i, computations, caller)
             if re.search(rf"\bbody=%?{re.escape(body)}\b", i.attributes)]
    return max(loops, key=lambda loop: loop[1], default=None)


def _loop_kernels(text: str) -> list[tuple[str, dict]]:
    """(kind, kernel) of each kernel one run of the longest loop's body runs (none without a loop)."""
    body, _ = longest_loop(text) or (None, 0)
    ops = hlo_ops(text)
    return [(kind_of(ops.get(k["name"])), k) for k in kernels(text, body)] if body else []


def loop_copies(text: str) -> dict:
    """What one run of the longest loop's body (a generation's step: one token) copies: kernels of
    kind ``copies`` and their bytes read and written (0 and 0 in a program without a loop). An
    asynchronous copy into or out of another memory (libtpu prefetching a weight into a faster
    one) is how the chip reads that array, not a second copy of it: left out."""
    copies = [k for kind, k in _loop_kernels(text) if kind == "copies" and not k["between_memories"]]
    return {"copies_per_token": sum(k["times"] for k in copies),
            "copied_bytes_per_token": sum(k["bytes"] * k["times"] for k in copies)}


def loop_bytes(text: str) -> dict[str, int]:
    """Bytes one run of the longest loop's body reads and writes, by kind of kernel."""
    moved = defaultdict(int)
    for kind, k in _loop_kernels(text):
        moved[kind] += k["bytes"] * k["times"]
    return dict(moved)


def gemms(text: str) -> dict:
    """The GEMMs a compiled GPU program calls (cuBLAS custom calls and Triton GEMM fusions), and
    those with fp8 operands (cuBLAS's ``$f8`` matmul, or a Triton GEMM reading f8 parameters)."""
    from redeqx.planner._hlo import parse_module

    computations, params, _ = parse_module(text)
    count = fp8 = 0
    for body in computations.values():
        for i in body:
            target = _TARGET.search(i.attributes)
            calls = re.search(r"\bcalls=%?([\w.\-]+)", i.attributes)
            if i.op == "custom-call" and target and target[1].startswith("__cublas"):
                count += 1
                fp8 += target[1].endswith("$f8")
            elif i.op == "fusion" and calls and re.search(r'"kind":"__triton\w*gemm', i.attributes):
                count += 1
                fp8 += any("f8e" in shape for shape in params.get(calls[1], {}).values())
    return {"gemms": count, "fp8_gemms": fp8}
