"""A plan's compiled FLOPs and bytes as seconds: the bytes each collective puts on the wire, the
links it crosses (within a host or between two), and plans compared at the rates a user gives;
the rates and sizes users write (`parse_rate`, `parse_bytes`) and the one an accelerator's
compiler names when it refuses a step (`refused_temporaries`)."""

from __future__ import annotations

import math
import numbers
import re
from typing import Any

from ._hlo import Collective
from .._typing import typechecked

_RATE = re.compile(r"^\s*([0-9.]+(?:e[+-]?\d+)?)\s*([KMGTPkmgtp]?)(B|b|FLOP|FLOPS|FLOPs|flops)?(?:/s)?\s*$")


def parse_rate(value, name: str) -> float:
    """A rate per second: a number, or text such as "25GB/s" or "989TFLOP/s" (decimal units)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    m = _RATE.match(value) if isinstance(value, str) else None
    if m is None or float(m.group(1)) <= 0:
        raise ValueError(f"{name}={value!r}: give a positive rate per second, e.g. 25e9 or '25GB/s' "
                         "(FLOPs: '989TFLOP/s'; bits: '200Gb/s').")
    bits = m.group(3) == "b"  # a link's rate in bits: '200Gb/s' is 25 GB/s
    return float(m.group(1)) * 1000 ** " KMGTP".index(m.group(2).upper() or " ") / (8 if bits else 1)


_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value, name: str = "device_memory") -> int | None:
    """``40e9``, ``"40GB"``, ``"32 GiB"`` -> bytes."""
    if value is None:
        return None
    found = None
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        found = int(value)
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9.]+)\s*([kmgt]?i?b)\s*", value.lower())
        found = int(float(m.group(1)) * _UNITS[m.group(2)]) if m else None
    if found is None:
        raise ValueError(f"{name}={value!r}: give bytes (40e9) or a size such as '40GB' or '32GiB'.")
    if found < 1024:  # no step fits in a KiB: 40 meant 40 GB
        raise ValueError(f"{name}={value!r} is {found} bytes, under a KiB: give bytes (40e9 for 40 GB) or a size "
                         "such as '40GB' or '32GiB'.")
    return found


def wire_bytes(c: Collective, n_devices: int = 2) -> float:
    """What one device sends for collective ``c`` over a ring of its group's ``n`` devices: an
    all-reduce ``2 (n - 1) / n`` of its result, an all-gather or all-to-all ``(n - 1) / n``, a
    reduce-scatter ``n - 1`` times its (scattered) result, a permute its result. A collective
    without listed groups is over all ``n_devices``."""
    n = max((len(g) for g in c.groups), default=1) if c.groups else n_devices
    if c.kind == "collective-permute" or n == 1:
        return float(c.bytes) if c.kind == "collective-permute" else 0.0
    return c.bytes * {"all-reduce": 2 * (n - 1) / n, "all-gather": (n - 1) / n, "all-to-all": (n - 1) / n,
                      "reduce-scatter": n - 1}[c.kind]


def crosses(c: Collective, per_group: int) -> bool:
    """Whether a group of ``c`` holds devices of two runs of ``per_group`` consecutive devices
    (two hosts, two stages); a collective over every device does when there are two runs."""
    if c.groups is None:
        return True
    return any(len({d // per_group for d in g}) > 1 for g in c.groups)


_COLUMNS = ("compute", "within", "between", "serial", "overlapped")


def seconds(plan, *, flops_per_second: Any, devices_per_host: int, within_host: Any,
            between_hosts: Any) -> dict[str, float]:
    """`Plan.timing`."""
    flops_rate, within, between = (parse_rate(v, n) for v, n in (
        (flops_per_second, "flops_per_second"), (within_host, "within_host"), (between_hosts, "between_hosts")))
    n = math.prod(plan.mesh.values())
    if isinstance(devices_per_host, bool) or not isinstance(devices_per_host, int) or devices_per_host < 1 \
            or n % devices_per_host:
        raise ValueError(f"devices_per_host={devices_per_host!r}: give how many of the plan's {n} devices one host "
                         f"holds, a count dividing {n} (8 for 8-GPU hosts; {n} for one host).")
    far = sum(wire_bytes(c, n) for c in plan.found if crosses(c, devices_per_host))
    near = sum(wire_bytes(c, n) for c in plan.found) - far
    out = {"compute": plan.flops / flops_rate, "within": near / within, "between": far / between}
    out["serial"] = out["compute"] + out["within"] + out["between"]
    out["overlapped"] = max(out["compute"], out["within"], out["between"])
    return out


@typechecked
def compare_plans(plans: dict, *, flops_per_second: Any, devices_per_host: int,
                  within_host: Any = "450GB/s", between_hosts: Any = "25GB/s") -> str:
    """Plans of one model on one set of hosts (``{"stages over hosts": p1, "fsdp over hosts": p2}``)
    side by side: each step's seconds by `Plan.timing` (compiled FLOPs and bytes at these rates,
    nothing overlapped and everything overlapped), and which is fastest, by how much.

    **Example:**

    ```python
    print(redeqx.compare_plans({"stages": staged, "fsdp": fsdp}, flops_per_second="275TFLOP/s",
                               devices_per_host=8, between_hosts="25GB/s", within_host="450GB/s"))
    ```
    """
    if not plans:
        raise ValueError("compare_plans got no plans: pass {name: redeqx.plan(...)} for two or more.")
    times = {k: p.timing(flops_per_second=flops_per_second, devices_per_host=devices_per_host,
                         within_host=within_host, between_hosts=between_hosts) for k, p in plans.items()}
    width = max(len(k) for k in plans)
    lines = [f"per step at {between_hosts} between hosts of {devices_per_host} devices, {within_host} within, "
             f"{flops_per_second} per device:",
             f"  {'':{width}s}" + "".join(f"  {h:>11s}" for h in _COLUMNS)]
    for k, t in times.items():
        lines.append(f"  {k:{width}s}" + "".join(f"  {t[h] * 1e3:9.3f}ms" for h in _COLUMNS))
    for how in ("serial", "overlapped"):
        order = sorted(times, key=lambda k: times[k][how])
        if len(order) > 1:
            best, next_ = order[0], order[1]
            lines.append(f"{how}: {best} is fastest, {times[next_][how] / times[best][how]:.2f}x faster than {next_}")
    return "\n".join(lines)


_REFUSED = re.compile(r"required for HLO temporaries \(([0-9.]+)([KMGT]?)\)")


def refused_temporaries(message: str) -> int:
    """The temporaries an out-of-memory compile error names (libtpu: "the
    total memory required for HLO temporaries (84.27G) exceeds available HBM
    (30.75G)", binary units), or 0 when it names none."""
    m = _REFUSED.search(message)
    if not m:
        return 0
    return int(float(m.group(1)) * 1024 ** " KMGT".index(m.group(2) or " "))
