"""What a scheduler's environment says about a multi-process run: pure
functions of the environment variables, read by `initialize` after its
arguments and the ``REDEQX_*`` variables (docs/guides/clusters.md).

- **SLURM** (a job step started by ``srun``): process 0's host is the first
  node of ``SLURM_STEP_NODELIST``, its port ``JAX_COORDINATOR_PORT`` or one
  derived from ``SLURM_JOB_ID`` (as JAX picks it, so two jobs on one node do
  not collide), ``n_processes = SLURM_NTASKS``, ``process_id =
  SLURM_PROCID``. With several tasks on a node each takes one device
  (``SLURM_LOCALID``), as JAX does; with one task a node it takes all of
  the node's devices.
- **Kubernetes**, an indexed Job or a JobSet: ``process_id =
  JOB_COMPLETION_INDEX``; in a JobSet, process 0 is the first pod of the
  first job, ``<jobset>-<replicated job>-0-0.<jobset>``. The number of
  processes is not in a pod's environment: the manifest sets
  ``REDEQX_N_PROCESSES``.
- **Cloud TPU VM** and **Open MPI**: nothing here; `jax.distributed` asks
  the TPU metadata server (or reads Open MPI's variables) itself.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

# JAX's choice for SLURM, so that a job started either way listens on the same port
_SLURM_PORT_BASE, _SLURM_PORTS = 65535 - 2**12 + 1, 2**12
_SLURM_NEEDS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")


def first_host(node_list: str) -> str:
    """The first host of a SLURM node list: ``"node[001-004,9],gpu7"`` -> ``"node001"``."""
    head = re.match(r"[^,\[]*(\[[^\]]*\])?", node_list.strip()).group(0)
    prefix, _, ranges = head.partition("[")
    return prefix + re.split(r"[,\-\]]", ranges, maxsplit=1)[0] if ranges else prefix


def _int(env: Mapping[str, str], name: str) -> int:
    value = env[name].strip()
    if not value.isdigit():
        raise ValueError(f"{name}={value!r} (environment variable) must be a non-negative integer.")
    return int(value)


def slurm(env: Mapping[str, str]) -> dict:
    if not all(name in env for name in _SLURM_NEEDS):
        return {}
    n, n_nodes = _int(env, "SLURM_NTASKS"), _int(env, "SLURM_STEP_NUM_NODES") if "SLURM_STEP_NUM_NODES" in env else 0
    port = env.get("JAX_COORDINATOR_PORT", "").strip()
    return {
        "host0_address": first_host(env["SLURM_STEP_NODELIST"]),
        "host0_port": int(port) if port.isdigit() else _SLURM_PORT_BASE + _int(env, "SLURM_JOB_ID") % _SLURM_PORTS,
        "n_processes": n,
        "process_id": _int(env, "SLURM_PROCID"),
        # several tasks on a node: one device each; one task a node (n == nodes): all of them
        "local_device_ids": None if n == n_nodes else (_int(env, "SLURM_LOCALID"),),
    }


def kubernetes(env: Mapping[str, str]) -> dict:
    if "JOB_COMPLETION_INDEX" not in env:
        return {}
    found = {"process_id": _int(env, "JOB_COMPLETION_INDEX")}
    if env.get("JOBSET_NAME") and env.get("REPLICATED_JOB_NAME"):
        jobset = env["JOBSET_NAME"]
        found["host0_address"] = f"{jobset}-{env['REPLICATED_JOB_NAME']}-0-0.{jobset}"
    return found


def scheduler_settings(env: Mapping[str, str]) -> tuple[str | None, dict]:
    """``(scheduler name, the settings its variables give)`` for the first
    scheduler whose variables are set, or ``(None, {})``. Keys are
    `initialize`'s argument names."""
    for name, read in (("SLURM", slurm), ("Kubernetes", kubernetes)):
        found = read(env)
        if found:
            return name, found
    return None, {}
