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
    if any(any(s in f for s in _LOSS_FUNCTIONS) for f in functions[:2]):
        return "loss"
    if opcode in _COPIES or (opcode == "fusion" and op["inner"] and set(op["inner"]) <= {*_COPIES, "parameter"}):
        return "copies"
    return "norms and elementwise"


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


def breakdown(xplane: str, hlo_text: str, steps: int, top: int = 30) -> dict:
    """Device milliseconds per step by kind, the device's busy time (the union
    of its events) and the ``top`` instructions by time, each with its kind."""
    return tally(device_events(xplane), hlo_text, steps, top)


def tally(events, hlo_text: str, steps: int, top: int = 30) -> dict:
    """`breakdown` of ``(kernel, hlo_op, start_ns, duration_ns)`` events (`device_events`)."""
    ops = hlo_ops(hlo_text)
    kernels = kernel_names(ops)
    by_kind: dict[str, float] = defaultdict(float)
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
        by_kind[kind] += duration / 1e6 / steps
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
    return {"ms_per_step": {k: round(by_kind.get(k, 0.0), 3) for k in KINDS},
            "busy_ms_per_step": busy / 1e6 / steps,
            "top": [{"op": op, "kind": k, "ms": round(ms, 3), "launches": n // steps, "kernel": kernel}
                    for op, (k, ms, n, kernel) in ranked]}
