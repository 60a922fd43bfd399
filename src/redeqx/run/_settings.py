"""The settings of a multi-process run, as `initialize` reads them: each from
its argument, else from these environment variables, else from a scheduler's
variables (SLURM, a Kubernetes indexed Job or JobSet: `_clusters`):

    REDEQX_HOST0_ADDRESS      address of process 0 ("10.0.0.1" or "10.0.0.1:1234")
    REDEQX_HOST0_PORT         port process 0 listens on (default 12321)
    REDEQX_N_PROCESSES        number of processes
    REDEQX_PROCESS_ID         this process's index, 0 .. n_processes - 1
    REDEQX_LOCAL_DEVICE_IDS   devices this process uses, e.g. "0,1,2,3"
    REDEQX_INIT_TIMEOUT       seconds to wait for every process to connect (default 1800)
    REDEQX_HEARTBEAT_TIMEOUT  seconds of silence after which a process counts as dead (default 100)
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from ._clusters import scheduler_settings

DEFAULT_PORT = 12321
# A cold start of a large job (containers pulled, a filesystem mounted, thousands of processes
# scheduled) can take many minutes: JAX's own default is 300 s, and large runs raise it to 1,800 s.
# Waiting longer costs nothing when the processes do come; when one does not, the roll call
# (`_distributed._roll_call`) names it.
DEFAULT_TIMEOUT = 1800
DEFAULT_HEARTBEAT_TIMEOUT = 100

ENV = {
    "host0_address": "REDEQX_HOST0_ADDRESS",
    "host0_port": "REDEQX_HOST0_PORT",
    "n_processes": "REDEQX_N_PROCESSES",
    "process_id": "REDEQX_PROCESS_ID",
    "local_device_ids": "REDEQX_LOCAL_DEVICE_IDS",
    "timeout": "REDEQX_INIT_TIMEOUT",
    "heartbeat_timeout": "REDEQX_HEARTBEAT_TIMEOUT",
}


@dataclass(frozen=True)
class Config:
    """The settings `initialize` starts with; None where nothing gave one."""

    host0_address: str | None
    host0_port: int | None
    n_processes: int | None
    process_id: int | None
    local_device_ids: tuple[int, ...] | None
    timeout: int
    heartbeat_timeout: int


def _int_setting(name: str, value, *, minimum: int) -> int | None:
    """An int setting from an argument, else from its environment variable."""
    where = f"{name}"
    if value is None and os.environ.get(ENV[name], "").strip():
        value, where = os.environ[ENV[name]].strip(), f"{ENV[name]} (environment variable)"
        try:
            value = int(value)
        except ValueError:
            raise ValueError(f"{where} must be an integer, got {value!r}.") from None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{where} must be an int, got {value!r} ({type(value).__name__}).")
    if value < minimum:
        raise ValueError(f"{where} must be >= {minimum}, got {value}.")
    return int(value)


def _split_address(address: str) -> tuple[str, int | None]:
    """"host", "host:port", "[v6]:port" or a bare IPv6 address -> (host, port)."""
    if address.startswith("["):
        host, _, rest = address[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else None
        return f"[{host}]", int(port) if port else None
    if address.count(":") == 1:
        host, port = address.split(":")
        if not port.isdigit():
            raise ValueError(f"host0_address={address!r} has a port that is not a number; write 'host:1234'.")
        return host, int(port)
    if address.count(":") > 1:  # bare IPv6
        return f"[{address}]", None
    return address, None


def resolve(host0_address, host0_port, n_processes, process_id, local_device_ids, timeout, heartbeat_timeout) -> Config:
    """The settings `initialize` starts with: each from its argument, else its
    ``REDEQX_*`` variable, else the scheduler's variables (`_clusters`)."""
    _, scheduler = scheduler_settings(os.environ)
    if host0_address is None:
        host0_address = os.environ.get(ENV["host0_address"], "").strip() or scheduler.get("host0_address")
    if host0_address is not None and (not isinstance(host0_address, str) or not host0_address.strip()):
        raise TypeError(f"host0_address must be a host name or IP address string, got {host0_address!r}.")
    port = _int_setting("host0_port", host0_port, minimum=1)
    if port is None and host0_address == scheduler.get("host0_address"):
        port = scheduler.get("host0_port")
    if host0_address is not None:
        host0_address, address_port = _split_address(host0_address.strip())
        if address_port is not None and port is not None and address_port != port:
            raise ValueError(
                f"host0_address gives port {address_port} but host0_port={port}: give the port once."
            )
        port = address_port if address_port is not None else port
    if port is not None and port > 65535:
        raise ValueError(f"host0_port must be a TCP port 1..65535, got {port}.")
    n_processes = _int_setting("n_processes", n_processes, minimum=1)
    n_processes = scheduler.get("n_processes") if n_processes is None else n_processes
    process_id = _int_setting("process_id", process_id, minimum=0)
    process_id = scheduler.get("process_id") if process_id is None else process_id
    if n_processes is not None and process_id is not None and process_id >= n_processes:
        raise ValueError(
            f"process_id={process_id} is not below n_processes={n_processes}: number the processes "
            f"0 .. {n_processes - 1}."
        )
    if local_device_ids is None and os.environ.get(ENV["local_device_ids"], "").strip():
        raw = os.environ[ENV["local_device_ids"]]
        try:
            local_device_ids = [int(x) for x in raw.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"{ENV['local_device_ids']} must be a comma-separated list of ints, got {raw!r}.") from None
    if local_device_ids is not None:
        if isinstance(local_device_ids, (int, np.integer)) and not isinstance(local_device_ids, bool):
            local_device_ids = [local_device_ids]
        if not isinstance(local_device_ids, Sequence) or not all(
            isinstance(i, (int, np.integer)) and not isinstance(i, bool) and i >= 0 for i in local_device_ids
        ):
            raise TypeError(f"local_device_ids must be an int or a list of ints >= 0, got {local_device_ids!r}.")
        local_device_ids = tuple(int(i) for i in local_device_ids)
    elif host0_address is not None and host0_address == scheduler.get("host0_address"):
        local_device_ids = scheduler.get("local_device_ids")
    timeout = _int_setting("timeout", timeout, minimum=1)
    heartbeat_timeout = _int_setting("heartbeat_timeout", heartbeat_timeout, minimum=1)
    return Config(
        host0_address=host0_address,
        host0_port=port,
        n_processes=n_processes,
        process_id=process_id,
        local_device_ids=local_device_ids,
        timeout=DEFAULT_TIMEOUT if timeout is None else timeout,
        heartbeat_timeout=DEFAULT_HEARTBEAT_TIMEOUT if heartbeat_timeout is None else heartbeat_timeout,
    )


def cluster_hint() -> str | None:
    """The cluster manager whose environment variables are set, if any (the
    ones `jax.distributed` detects); only used to decide whether a late call
    may be a one-host no-op."""
    env = os.environ

    def count(name: str) -> int:
        value = env.get(name, "1").strip()
        return int(value) if value.isdigit() else 1

    if env.get("JAX_COORDINATOR_ADDRESS"):
        return "JAX_COORDINATOR_ADDRESS"
    if "SLURM_JOB_ID" in env and count("SLURM_NTASKS") > 1:
        return "SLURM"
    if "OMPI_MCA_orte_hnp_uri" in env or count("OMPI_COMM_WORLD_SIZE") > 1:
        return "Open MPI"
    if "TPU_WORKER_HOSTNAMES" in env or "CLOUD_TPU_TASK_ID" in env:
        return "Cloud TPU"
    return None  # (not Kubernetes: every pod has its variables, single-host ones too)


def describe(config: Config | None) -> str:
    """``config``'s given settings, for error messages: "host0_address='h', n_processes=2"."""
    if config is None:
        return "no settings"
    shown = {k: v for k, v in asdict(config).items() if v is not None}
    return ", ".join(f"{k}={v!r}" for k, v in shown.items())

