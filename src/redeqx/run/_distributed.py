"""Many processes, one program: start-up of JAX's multi-controller runtime
(`jax.distributed`) and a preflight check that every process agrees.

Configuration comes from, in order: the arguments of `initialize`, the
``REDEQX_*`` environment variables, a scheduler's variables (all three read
by `_settings`), then whatever cluster `jax.distributed` detects by itself
(Cloud TPU, Open MPI, Kubernetes through its API).
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
import zlib
from collections import Counter
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .. import _hooks, _startup
from .._typing import typechecked
from ._settings import DEFAULT_PORT, ENV, Config, cluster_hint, describe, resolve

# Who started the runtime in this process: None (nobody yet), "user" (a call to
# `initialize`) or "launcher" (`python -m redeqx.launch`, before the script ran).
_started_by: str | None = None
_started_with: Config | None = None

_BACKEND_STARTED = """\
redeqx.initialize() must run before anything starts JAX's backend, but JAX is
already running here (something called jax.devices(), created an array, or
compiled a function). Call it first thing in the script:

    import jax, redeqx
    redeqx.initialize()          # before any other jax / redeqx call
    mesh = redeqx.make_mesh(...)
"""


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
    config = resolve(host0_address, host0_port, n_processes, process_id, local_device_ids, timeout, heartbeat_timeout)
    _start(config, by="user", explicit=(host0_address, host0_port, n_processes, process_id, local_device_ids))


def _start(config: Config, *, by: str, explicit=()) -> None:
    """Starts the runtime with ``config`` for ``by`` ("user": `initialize`,
    whose arguments are ``explicit``; "launcher": `launcher_start`), records
    who did, and checks the processes (`preflight`)."""
    global _started_by, _started_with
    if _started_by == "launcher" and by == "user":
        _check_launcher_settings(config, explicit)
        return  # the launcher did it; a bare call in the script is fine
    _check_not_started()
    joined = config.n_processes != 1 and _join(config)
    _started_by, _started_with = by, config
    if joined:
        if jax.process_count() > 1:
            _hooks.stop_process_on_uncaught_exception()
        preflight()


def _check_launcher_settings(config: Config, explicit) -> None:
    """Arguments to `initialize` under `python -m redeqx.launch` must ask for
    what the launcher started."""
    if any(v is not None for v in explicit) and config != _started_with:
        raise RuntimeError(
            "redeqx.initialize: this script runs under `python -m redeqx.launch`, which already started "
            f"the processes with {describe(_started_with)}; the arguments given here ask for "
            f"{describe(config)}. Drop the arguments (the launcher's settings apply), or run the script "
            "without redeqx.launch."
        )


def _check_not_started() -> None:
    if _started_by is not None:
        raise RuntimeError(
            "redeqx.initialize was already called in this process; call it once, at the start of the script."
        )
    if jax.distributed.is_initialized():
        raise RuntimeError(
            "jax.distributed.initialize was already called in this process; use either it or "
            "redeqx.initialize, once."
        )


def _join(config: Config) -> bool:
    """Starts `jax.distributed` with ``config``, after process 0's roll call
    where every setting is known. False where there was nothing to start (no
    settings and no cluster: the run is this host alone)."""
    address = None
    if config.host0_address is not None:
        address = f"{config.host0_address}:{config.host0_port or DEFAULT_PORT}"
    nothing_given = address is None and config.n_processes is None and config.process_id is None
    complete = address is not None and config.n_processes is not None and config.process_id is not None
    if complete:
        if config.process_id == 0 and _backend_started():  # else its roll call would wait first
            raise RuntimeError(_BACKEND_STARTED)
        _roll_call(config)
    _use_cpu_collectives()
    try:
        _initialize_jax(config, address, complete)
    except RuntimeError as e:
        if "backend" not in str(e):
            raise
        if nothing_given and cluster_hint() is None:  # one host: there was nothing to start anyway
            return False
        raise RuntimeError(_BACKEND_STARTED) from None
    except ValueError as e:
        if nothing_given:  # no settings, and JAX detected no cluster: one host
            return False
        raise _incomplete_settings(config, e) from None
    except Exception as e:  # connection timeouts and the like, from XLA
        raise RuntimeError(
            f"redeqx.initialize: process {config.process_id} could not join the run at {address} within "
            f"timeout={config.timeout}s ({type(e).__name__}: {e}). Check that process 0 runs and that "
            f"host0_address / host0_port point at it, that every process got the same n_processes, and that "
            "the port is open between the hosts."
        ) from None
    return True


def _initialize_jax(config: Config, address: str | None, complete: bool) -> None:
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


def _incomplete_settings(config: Config, error: ValueError) -> ValueError:
    """JAX could not tell the run from ``config`` and found no cluster."""
    missing = [ENV[k].replace("REDEQX_", "").lower() for k in ("host0_address", "n_processes", "process_id")
               if getattr(config, k) is None]
    return ValueError(
        f"redeqx.initialize could not start a multi-process run with {describe(config)}: {error} "
        f"Give {', '.join(missing) or 'every setting'} (as arguments or as the REDEQX_* environment variables), "
        "or run under a cluster manager JAX detects (SLURM, Open MPI, Kubernetes, Cloud TPU)."
    )


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


def _roll_call(config: Config) -> None:
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


def _call_the_roll(config: Config) -> None:
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


def _answer_the_roll(config: Config) -> None:
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
    _startup.doing("joining the run (jax.distributed: waiting for every process)")
    config = resolve(None, None, None, None, None, None, None)
    _start(config, by="launcher")
