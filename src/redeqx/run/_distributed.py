"""Many processes, one program: start-up of JAX's multi-controller runtime
(`jax.distributed`) and a preflight check that every process agrees.

Configuration comes from, in order: the arguments of `initialize`, these
environment variables, a scheduler's variables (SLURM, a Kubernetes indexed
Job or JobSet: `_clusters`), then whatever cluster `jax.distributed` detects
by itself (Cloud TPU, Open MPI, Kubernetes through its API):

    REDEQX_HOST0_ADDRESS      address of process 0 ("10.0.0.1" or "10.0.0.1:1234")
    REDEQX_HOST0_PORT         port process 0 listens on (default 12321)
    REDEQX_N_PROCESSES        number of processes
    REDEQX_PROCESS_ID         this process's index, 0 .. n_processes - 1
    REDEQX_LOCAL_DEVICE_IDS   devices this process uses, e.g. "0,1,2,3"
    REDEQX_INIT_TIMEOUT       seconds to wait for every process to connect (default 1800)
    REDEQX_HEARTBEAT_TIMEOUT  seconds of silence after which a process counts as dead (default 100)
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .. import _hooks
from ._clusters import scheduler_settings
from .._typing import typechecked

DEFAULT_PORT = 12321
# A cold start of a large job (containers pulled, a filesystem mounted, thousands of processes
# scheduled) can take many minutes: JAX's own default is 300 s, and large runs raise it to 1,800 s.
# Waiting longer costs nothing when the processes do come; when one does not, the roll call
# (`_roll_call`) names it.
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
class _Config:
    host0_address: str | None
    host0_port: int | None
    n_processes: int | None
    process_id: int | None
    local_device_ids: tuple[int, ...] | None
    timeout: int
    heartbeat_timeout: int


# Who started the runtime in this process: None (nobody yet), "user" (a call to
# `initialize`) or "launcher" (`python -m redeqx.launch`, before the script ran).
_started_by: str | None = None
_started_with: _Config | None = None

_BACKEND_STARTED = """\
redeqx.initialize() must run before anything starts JAX's backend, but JAX is
already running here (something called jax.devices(), created an array, or
compiled a function). Call it first thing in the script:

    import jax, redeqx
    redeqx.initialize()          # before any other jax / redeqx call
    mesh = redeqx.make_mesh(...)
"""


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


def _resolve(host0_address, host0_port, n_processes, process_id, local_device_ids, timeout, heartbeat_timeout) -> _Config:
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
    return _Config(
        host0_address=host0_address,
        host0_port=port,
        n_processes=n_processes,
        process_id=process_id,
        local_device_ids=local_device_ids,
        timeout=DEFAULT_TIMEOUT if timeout is None else timeout,
        heartbeat_timeout=DEFAULT_HEARTBEAT_TIMEOUT if heartbeat_timeout is None else heartbeat_timeout,
    )


@typechecked
def initialize(
    host0_address: str | None = None,
    host0_port: int | None = None,
    n_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: int | Sequence[int] | None = None,
    *,
    timeout: int | None = None,
    heartbeat_timeout: int | None = None,
) -> None:
    """Join this process to a multi-process (multi-host) run; a no-op on one host.

    Call it once, first thing in the script, before any other JAX call. Every
    process runs the same script; afterwards ``jax.devices()`` (and so
    `make_mesh`) spans the devices of all processes, and every redeqx function
    works on the global mesh.

    Settings come from the arguments, else from the environment variables
    ``REDEQX_HOST0_ADDRESS``, ``REDEQX_HOST0_PORT``, ``REDEQX_N_PROCESSES``,
    ``REDEQX_PROCESS_ID``, ``REDEQX_LOCAL_DEVICE_IDS``, ``REDEQX_INIT_TIMEOUT``
    and ``REDEQX_HEARTBEAT_TIMEOUT``, else from a SLURM job step (``srun``)
    or a Kubernetes indexed Job / JobSet pod (read by redeqx), else from the
    cluster `jax.distributed` detects (Cloud TPU, Open MPI, Kubernetes through
    its API); docs/guides/clusters.md has a recipe for each. With none of these, or
    with ``n_processes=1``, it does nothing: the script runs on this host's
    devices alone (then a call after JAX started is harmless too; with
    settings or a cluster it is an error, since JAX can no longer join).

    - ``host0_address``: where process 0 runs; ``"10.0.0.1"`` or
      ``"10.0.0.1:1234"``. ``host0_port`` defaults to 12321.
    - ``local_device_ids``: the accelerators this process uses (one process per
      GPU: ``local_device_ids=[local_rank]``).
    - ``timeout``: seconds to wait for all processes to connect (default
      1,800, enough for the cold start of a large job). With an address,
      process 0 first takes a roll call on its port: when the time is up it
      raises an error naming the processes that never connected, and every
      process that did connect raises the same (rather than JAX aborting
      with ``DEADLINE_EXCEEDED``, naming nobody).
    - ``heartbeat_timeout``: seconds after which a silent process counts as
      dead; the others then stop with an error naming it (default 100).

    Once started, a preflight check runs: every process must see the same
    devices, device kind and library versions, and a one-number all-reduce
    over every device must give the device count; otherwise every process
    raises an error saying which process differed and how. In a run with
    several processes, an uncaught exception ends its process at once (after
    printing the traceback) so that the others notice within
    ``heartbeat_timeout`` instead of waiting for it at shutdown.

    **Example** (two hosts by hand; run the same script on both):

    ```python
    import redeqx
    redeqx.initialize("10.0.0.1", n_processes=2, process_id=0)   # process_id=1 on the other host
    mesh = redeqx.make_mesh(n_model_shards=2)                    # spans both hosts' devices
    ```
    """
    config = _resolve(host0_address, host0_port, n_processes, process_id, local_device_ids, timeout, heartbeat_timeout)
    _start(config, by="user", explicit=(host0_address, host0_port, n_processes, process_id, local_device_ids))


def _start(config: _Config, *, by: str, explicit=()) -> None:
    global _started_by, _started_with
    if _started_by == "launcher" and by == "user":
        if any(v is not None for v in explicit) and config != _started_with:
            raise RuntimeError(
                "redeqx.initialize: this script runs under `python -m redeqx.launch`, which already started "
                f"the processes with {_describe(_started_with)}; the arguments given here ask for "
                f"{_describe(config)}. Drop the arguments (the launcher's settings apply), or run the script "
                "without redeqx.launch."
            )
        return  # the launcher did it; a bare call in the script is fine
    if _started_by is not None:
        raise RuntimeError(
            "redeqx.initialize was already called in this process; call it once, at the start of the script."
        )
    if jax.distributed.is_initialized():
        raise RuntimeError(
            "jax.distributed.initialize was already called in this process; use either it or "
            "redeqx.initialize, once."
        )
    if config.n_processes == 1:
        _started_by, _started_with = by, config
        return
    address = None
    if config.host0_address is not None:
        address = f"{config.host0_address}:{config.host0_port or DEFAULT_PORT}"
    nothing_given = address is None and config.n_processes is None and config.process_id is None
    if address is not None and config.n_processes is not None and config.process_id is not None:
        if config.process_id == 0 and _backend_started():  # else its roll call would wait first
            raise RuntimeError(_BACKEND_STARTED)
        _roll_call(config)
    _use_cpu_collectives()
    complete = address is not None and config.n_processes is not None and config.process_id is not None
    try:
        jax.distributed.initialize(
            coordinator_address=address,
            num_processes=config.n_processes,
            process_id=config.process_id,
            local_device_ids=None if config.local_device_ids is None else list(config.local_device_ids),
            # everything known: JAX's own detection would only narrow the devices (one a process under SLURM)
            cluster_detection_method="deactivate" if complete else None,
            initialization_timeout=config.timeout,
            heartbeat_timeout_seconds=config.heartbeat_timeout,
        )
    except RuntimeError as e:
        if "backend" not in str(e):
            raise
        if nothing_given and _cluster_hint() is None:  # one host: there was nothing to start anyway
            _started_by, _started_with = by, config
            return
        raise RuntimeError(_BACKEND_STARTED) from None
    except ValueError as e:
        if nothing_given:  # no settings, and JAX detected no cluster: one host
            _started_by, _started_with = by, config
            return
        missing = [ENV[k].replace("REDEQX_", "").lower() for k in ("host0_address", "n_processes", "process_id")
                   if getattr(config, k) is None]
        raise ValueError(
            f"redeqx.initialize could not start a multi-process run with {_describe(config)}: {e} "
            f"Give {', '.join(missing) or 'every setting'} (as arguments or as the REDEQX_* environment variables), "
            "or run under a cluster manager JAX detects (SLURM, Open MPI, Kubernetes, Cloud TPU)."
        ) from None
    except Exception as e:  # connection timeouts and the like, from XLA
        raise RuntimeError(
            f"redeqx.initialize: process {config.process_id} could not join the run at {address} within "
            f"timeout={config.timeout}s ({type(e).__name__}: {e}). Check that process 0 runs and that "
            f"host0_address / host0_port point at it, that every process got the same n_processes, and that "
            "the port is open between the hosts."
        ) from None
    _started_by, _started_with = by, config
    if jax.process_count() > 1:
        _hooks.stop_process_on_uncaught_exception()
    preflight()


def _backend_started() -> bool:
    """Whether JAX's backend already runs here, so that `jax.distributed`
    can no longer start. Asked before the roll call, which would otherwise
    wait ``timeout`` seconds for processes before JAX says so. JAX has no
    public question for it: the one private call in redeqx, guarded (without
    it, JAX's own error comes after the roll call)."""
    try:
        from jax._src import xla_bridge
    except ImportError:
        return False
    started = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(started()) if callable(started) else False


_ROLL_CALL = b"redeqx-roll-call"


def _roll_call(config: _Config) -> None:
    """Every process checks in with process 0 on ``host0_port`` before JAX's
    runtime starts there, so that a process that never comes is named: JAX's
    own wait ends in a fatal ``DEADLINE_EXCEEDED`` abort that names nobody.
    Process 0 listens until all ``n_processes`` have checked in (then tells
    them to go on, waits for them to hang up, and frees the port for JAX), or
    until ``timeout``, when it and every process that checked in raise an
    error naming the missing ones."""
    if config.process_id == 0:
        _call_the_roll(config)
    else:
        _answer_the_roll(config)


def _call_the_roll(config: _Config) -> None:
    n, port = config.n_processes, config.host0_port or DEFAULT_PORT
    family = socket.AF_INET6 if socket.has_dualstack_ipv6() else socket.AF_INET
    try:
        server = socket.create_server(("", port), family=family, dualstack_ipv6=family == socket.AF_INET6)
    except OSError as e:
        raise RuntimeError(f"redeqx.initialize: process 0 cannot listen on port {port} ({e}): another program uses "
                           "it; give another host0_port (the same on every process).") from None
    present: dict[int, socket.socket] = {}
    deadline = time.monotonic() + config.timeout
    try:
        while len(present) < n - 1 and time.monotonic() < deadline:
            server.settimeout(min(1.0, max(0.01, deadline - time.monotonic())))
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            conn.settimeout(10)
            try:
                words = conn.recv(256).decode(errors="replace").split()
            except OSError:
                conn.close()
                continue
            if len(words) != 3 or words[0] != _ROLL_CALL.decode() or not words[1].isdigit():
                conn.close()  # not one of ours
                continue
            pid, their_n = int(words[1]), words[2]
            if their_n != str(n):
                conn.sendall(f"refused n_processes={n} at process 0\n".encode())
                conn.close()
                raise RuntimeError(f"redeqx.initialize: process {pid} was started with n_processes={their_n}, "
                                   f"process 0 with n_processes={n}: give every process the same n_processes.")
            present[pid] = conn
        missing = [i for i in range(1, n) if i not in present]
        if missing:
            text = _missing_text(missing, n, config.timeout)
            for conn in present.values():
                with contextlib.suppress(OSError):
                    conn.sendall(f"missing {','.join(map(str, missing))}\n".encode())
            raise RuntimeError(
                f"redeqx.initialize: process 0 {text}. Check that they were started, with host0_address / "
                f"host0_port pointing at this host (port {port}), the same n_processes={n} and their own "
                "process_id; raise timeout= (or REDEQX_INIT_TIMEOUT) if the job's processes start far apart."
            )
        for conn in present.values():
            conn.sendall(b"go\n")
        for conn in present.values():  # they hang up first, so the port is free at once for JAX's service
            with contextlib.suppress(OSError):
                conn.recv(16)
    finally:
        for conn in present.values():
            conn.close()
        server.close()


def _missing_text(missing: list[int], n: int, timeout: int) -> str:
    who = ("process " if len(missing) == 1 else "processes ") + ", ".join(map(str, missing[:20]))
    who += f" ... ({len(missing)} in all)" if len(missing) > 20 else ""
    return f"waited {timeout}s for {who} (of {n}), which never connected"


def _answer_the_roll(config: _Config) -> None:
    host, port = config.host0_address.strip("[]"), config.host0_port or DEFAULT_PORT
    deadline = time.monotonic() + config.timeout
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=2)
            break
        except OSError as e:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"redeqx.initialize: process {config.process_id} could not reach process 0 at "
                    f"{host}:{port} within timeout={config.timeout}s ({e}). Check host0_address and host0_port "
                    f"(or {ENV['host0_address']} / {ENV['host0_port']}), that process 0 runs, and that the port "
                    "is open between the hosts; raise timeout= if the hosts start far apart."
                ) from None
            time.sleep(0.5)
    with conn:
        conn.sendall(f"{_ROLL_CALL.decode()} {config.process_id} {config.n_processes}\n".encode())
        conn.settimeout(max(1.0, deadline - time.monotonic()) + 30)  # process 0 answers by its own deadline
        try:
            reply = conn.recv(4096).decode(errors="replace").strip()
        except OSError as e:
            reply = f"no answer ({e})"
    if reply == "go":
        return
    if reply.startswith("missing "):
        missing = [int(x) for x in reply.split()[1].split(",")]
        raise RuntimeError(
            f"redeqx.initialize: process {config.process_id} reached process 0, which "
            f"{_missing_text(missing, config.n_processes, config.timeout)}. Check that they were started with the "
            "same host0_address, host0_port and n_processes; raise timeout= if the job's processes start far apart."
        )
    raise RuntimeError(f"redeqx.initialize: process {config.process_id} checked in with process 0 at {host}:{port}, "
                       f"which answered {reply!r}.")


def _cluster_hint() -> str | None:
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


def _describe(config: _Config | None) -> str:
    if config is None:
        return "no settings"
    shown = {k: v for k, v in asdict(config).items() if v is not None}
    return ", ".join(f"{k}={v!r}" for k, v in shown.items())


def _use_cpu_collectives() -> None:
    """CPU devices of several processes talk through gloo; without it their
    collectives fail. It changes nothing for GPUs and TPUs."""
    if not jax.config.jax_cpu_collectives_implementation:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")


def _facts() -> dict:
    """What every process must agree on, as this process sees it."""
    import jaxlib

    from .._version import __version__

    devices = jax.devices()
    mine = jax.local_devices()
    layout = ";".join(f"{d.id}@{d.process_index}" for d in devices)
    return {
        "local devices": len(mine),
        "global devices": len(devices),
        "processes": jax.process_count(),
        "platform": mine[0].platform,
        "device kind": mine[0].device_kind,
        "device order (crc32)": zlib.crc32(layout.encode()),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "redeqx": __version__,
        "prng": f"{jax.config.jax_default_prng_impl}, partitionable={jax.config.jax_threefry_partitionable}",
        "x64": bool(jax.config.jax_enable_x64),
    }


_FACT_BYTES = 1024


@typechecked
def preflight() -> None:
    """Checks that every process sees the same devices, device kind and
    library versions, and that an all-reduce over every device works.
    `initialize` runs it once after start-up; it is safe to call again (it
    is itself a collective: every process must call it).

    **Example:**

    ```python
    redeqx.preflight()   # raises, naming the odd process, if processes disagree
    ```
    """
    facts = _facts()
    counts = Counter(d.process_index for d in jax.devices())
    if len(set(counts.values())) > 1:
        usual = Counter(counts.values()).most_common(1)[0][0]
        odd = sorted(p for p, c in counts.items() if c != usual)
        raise RuntimeError(
            "redeqx preflight: processes have different numbers of devices: "
            + ", ".join(f"process {p} has {counts[p]}" for p in odd)
            + f", the others {usual}. Give every process the same number of devices "
            "(local_device_ids=, CUDA_VISIBLE_DEVICES, or the cluster's per-task GPU count)."
        )
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        raw = json.dumps(facts, sort_keys=True).encode()[:_FACT_BYTES]
        mine = np.zeros(_FACT_BYTES, np.uint8)
        mine[: len(raw)] = np.frombuffer(raw, np.uint8)
        everyone = np.asarray(multihost_utils.process_allgather(mine))  # (n_processes, bytes)
        seen = [json.loads(bytes(row).rstrip(b"\0").decode()) for row in everyone]
        problems = []
        for name in seen[0]:
            values = [s.get(name) for s in seen]
            if len(set(map(repr, values))) > 1:
                problems.append(f"{name}: " + ", ".join(f"process {p} has {v!r}" for p, v in enumerate(values)))
        if problems:
            raise RuntimeError(
                "redeqx preflight: the processes of this run disagree (they must run the same software on "
                "the same kind of devices):\n  " + "\n  ".join(problems)
            )
    mesh = Mesh(np.asarray(jax.devices()), ("all",))
    n = len(jax.devices())
    ones = jax.make_array_from_callback((n,), NamedSharding(mesh, P("all")), lambda idx: np.ones(n, np.int32)[idx])
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(ones)
    got = int(np.asarray(total.addressable_data(0)))
    if got != n:
        raise RuntimeError(
            f"redeqx preflight: an all-reduce of one 1 per device over {n} devices gave {got} on process "
            f"{jax.process_index()}: the collectives between processes are broken. On CPU, set "
            "JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo; on GPU, check NCCL (NCCL_DEBUG=INFO)."
        )


def launcher_start() -> None:
    """Used by `python -m redeqx.launch` in each child before the script runs."""
    config = _resolve(None, None, None, None, None, None, None)
    _start(config, by="launcher")
