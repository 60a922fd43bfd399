"""Read the collectives out of a compiled XLA program."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import numpy as np

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


def array_shapes(shape_text: str) -> list[tuple[str, tuple[int, ...]]]:
    out = []
    for dtype, dims in _ARRAY.findall(shape_text):
        if dtype in DTYPE_BYTES:
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
        arrays = array_shapes(m.group("shape"))
        if op.endswith("-start") and kind in ("all-gather", "collective-permute", "all-to-all") and len(arrays) > 1:
            arrays = arrays[len(arrays) // 2:]
        nbytes = sum(DTYPE_BYTES[d] * int(np.prod(s, dtype=np.int64)) for d, s in arrays)
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
