"""Every process-level hook redeqx installs, in one place.

``import redeqx`` installs none of them. Each is installed by the first call
that needs it, once: a second call changes nothing (one ``atexit`` entry, one
``sys.excepthook`` replacement, whatever the number of loggers or managers).

| hook | what it does | installed by | removed |
|---|---|---|---|
| ``atexit``: `_at_exit` | closes every open `Logger`, newest first; then, if a `CheckpointManager` save is still in flight (no ``close()``), reports it lost (Python stops the writer's threads before ``atexit``) and ends the process with ``os._exit(1)``, never 0 | the first ``Logger(...)`` (process 0) or ``CheckpointManager(...)`` | never (runs once, at exit) |
| ``sys.excepthook``: `_excepthook` | on an uncaught exception, finishes the saves in flight (the writer still runs then), then the previous hook prints the traceback; after ``initialize()`` joined several processes, it then says so and ends the process with ``os._exit(1)`` rather than wait in JAX's shutdown barrier for processes blocked on it | the first ``CheckpointManager(...)`` (finish saves); ``initialize()`` with several processes (stop the process); one replacement for both | never |
| SIGTERM handler: `_Sigterm.handler` | sets the preemption flag `CheckpointManager.save` reads (one process); a handler the program had installed still runs | a manager's first ``save()`` in one process, on the main thread (with ``jax.distributed`` running, JAX's preemption service listens instead) | the last manager's ``close()`` puts the previous handler back |
| ``sys.unraisablehook``: `_unraisable` | drops orbax's cleanup noise: "Event loop is closed" after a failed save, and the exceptions of orbax coroutines a failed restore abandoned as the garbage collector closes them; the caller gets one `CheckpointError` | the first checkpoint write or restore (again if something replaced it since) | never |
| filters on the ``absl`` / ``asyncio`` loggers | drop orbax's echoes of a failed redeqx save (its writer threads' tracebacks) | the first checkpoint write | never |
| orbax's ``tensorstore_utils.get_tensorstore_raw_bytes``: `_raw_bytes` | the same count (TensorStore's bytes read or written, for orbax's throughput log), read from ``tensorstore.experimental_collect_prometheus_format_metrics``: orbax calls ``experimental_collect_matching_metrics`` twice per item on every save and restore, and TensorStore (0.1.86) leaks a reference to each dict it returns (~14 KiB a call, most of the ~40 KiB a save grew by) | the first checkpoint write or restore | never |
| SIGUSR1 handler: `_stopped` | raises `StoppedByLauncher`: the launcher's "another process failed, stop" | ``python -m redeqx.launch``, in each process it starts, before the script runs | with the process |

Not hooks, for completeness: `StepWatchdog` runs a daemon thread between
``start()`` and ``close()`` that ends a hung process with
``os._exit(HUNG_EXIT_CODE)``; the launcher's own process (``python -m
redeqx.launch``) forwards SIGINT / SIGTERM / SIGHUP to its children while
they run and restores its handlers when they are done, and each process it
starts asks the kernel for SIGKILL when the launcher dies
(``PR_SET_PDEATHSIG``; a watching thread off Linux).
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import traceback
import weakref
from collections.abc import Callable

# ----------------------------------------------------------------------------- atexit


class _Exit:
    """What the one ``atexit`` entry does: loggers to close, saves to finish."""

    def __init__(self):
        self.installed = False
        self.closers: list[weakref.ref] = []  # objects with close(), oldest first
        self.finish_saves: Callable[[str], list[str]] | None = None


_EXIT = _Exit()


def _at_exit() -> None:
    for ref in reversed(_EXIT.closers):  # newest first, as separate atexit entries would run
        obj = ref()
        if obj is None:
            continue
        try:
            obj.close()
        except Exception:  # as atexit reports a failing entry, and goes on to the next
            print(f"redeqx: closing {type(obj).__name__} at exit failed:", file=sys.stderr)
            traceback.print_exc()
    if _EXIT.finish_saves is None:
        return
    failures = _EXIT.finish_saves("at exit, without close()")
    if failures:
        for line in failures:
            print(line, file=sys.stderr)
        print("redeqx.CheckpointManager: a checkpoint was lost; exiting with status 1.", file=sys.stderr, flush=True)
        os._exit(1)


def _install_at_exit() -> None:
    if not _EXIT.installed:
        atexit.register(_at_exit)
        _EXIT.installed = True


def close_at_exit(obj) -> None:
    """Call ``obj.close()`` at interpreter exit, unless ``obj`` is gone by
    then (held weakly); closers run newest first, before saves are checked."""
    _install_at_exit()
    _EXIT.closers = [r for r in _EXIT.closers if r() is not None] + [weakref.ref(obj)]


# ----------------------------------------------------------------------------- sys.excepthook


class _Uncaught:
    def __init__(self):
        self.previous = None  # the hook replaced; None: not installed
        self.stop_process = False


_UNCAUGHT = _Uncaught()


def _excepthook(kind, value, tb) -> None:
    if _EXIT.finish_saves is not None:
        for line in _EXIT.finish_saves("the script ended with an uncaught exception"):
            print(line, file=sys.stderr)
    _UNCAUGHT.previous(kind, value, tb)
    if _UNCAUGHT.stop_process:
        import jax

        print(
            f"redeqx: process {jax.process_index()} stops on this uncaught {kind.__name__}; "
            "the other processes will stop too.",
            file=sys.stderr,
        )
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip JAX's shutdown barrier, which would wait for the other processes
        # (busy or blocked on this one) for minutes.
        os._exit(1)


def _install_excepthook() -> None:
    if _UNCAUGHT.previous is None:
        _UNCAUGHT.previous = sys.excepthook
        sys.excepthook = _excepthook


def finish_saves_on_exit(finish: Callable[[str], list[str]]) -> None:
    """At exit and on an uncaught exception, ``finish(why)`` waits for the
    saves in flight and returns their failures, one line each (`CheckpointManager`)."""
    _EXIT.finish_saves = finish
    _install_at_exit()
    _install_excepthook()


def stop_process_on_uncaught_exception() -> None:
    """An uncaught exception ends this process of several at once (`initialize`)."""
    _UNCAUGHT.stop_process = True
    _install_excepthook()


# ----------------------------------------------------------------------------- SIGTERM


class _Sigterm:
    """One process's SIGTERM notice, set by the handler `watch_sigterm` installs."""

    def __init__(self):
        self.received = False
        self.previous = None
        self.watchers = 0

    def handler(self, signum, frame):
        self.received = True
        if callable(self.previous):  # a handler the program had installed itself still runs
            self.previous(signum, frame)


_SIGTERM = _Sigterm()


def watch_sigterm() -> None:
    """Start listening for SIGTERM (main thread only); undo with `unwatch_sigterm`."""
    if _SIGTERM.watchers == 0:
        _SIGTERM.previous = signal.signal(signal.SIGTERM, _SIGTERM.handler)
    _SIGTERM.watchers += 1


def unwatch_sigterm() -> None:
    """Undo one `watch_sigterm`; the last one puts the previous handler back."""
    _SIGTERM.watchers -= 1
    if _SIGTERM.watchers == 0 and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _SIGTERM.previous if _SIGTERM.previous is not None else signal.SIG_DFL)


def sigterm_received() -> bool:
    return _SIGTERM.received


# ----------------------------------------------------------------------------- orbax's echoes


_QUIETED: list[bool] = []
_PREVIOUS_UNRAISABLE: list = []


def _from_orbax(obj) -> bool:
    """Whether ``obj`` is a coroutine of orbax's own code (``cr_code`` in ``orbax/checkpoint/``)."""
    code = getattr(obj, "cr_code", None)
    return code is not None and f"{os.sep}orbax{os.sep}checkpoint{os.sep}" in code.co_filename


def _unraisable(unraisable) -> None:
    """Drops two kinds of orbax cleanup noise; passes everything else to the hook it replaced.

    - "Event loop is closed": when a save fails, orbax closes its event loop while tensorstore's
      threads still complete that save's other writes, and each callback reports a bare traceback.
    - An orbax coroutine's exception while it is finalised: when one array of a restore fails,
      orbax abandons its other reads (``_read_array_index_and_device_put``) suspended in their
      ``async with``; the garbage collector closes them later, at any moment, during other work,
      and each printed a 60-line "Exception ignored in: <coroutine object ...>" block."""
    if unraisable.object is None and unraisable.exc_type is RuntimeError and str(unraisable.exc_value) == (
            "Event loop is closed"):
        return
    if _from_orbax(unraisable.object):
        return
    (_PREVIOUS_UNRAISABLE[-1] if _PREVIOUS_UNRAISABLE else sys.__unraisablehook__)(unraisable)


def quiet_orbax_unraisable() -> None:
    """Install `_unraisable` as ``sys.unraisablehook`` unless it is the hook now (something that
    replaced it since, a test runner for one, gets wrapped in turn)."""
    if sys.unraisablehook is not _unraisable:
        _PREVIOUS_UNRAISABLE.append(sys.unraisablehook)
        sys.unraisablehook = _unraisable


def quiet_orbax_echoes(record_filter: logging.Filter) -> None:
    """Add ``record_filter`` to the ``absl`` and ``asyncio`` loggers (orbax's
    errors; its tasks' "Task exception was never retrieved") and install
    `quiet_orbax_unraisable`."""
    quiet_orbax_unraisable()
    if _QUIETED:
        return
    for name in ("absl", "asyncio"):
        logging.getLogger(name).addFilter(record_filter)
    _QUIETED.append(True)


# ----------------------------------------------------------------------------- orbax's raw-bytes count


def _raw_bytes(direction=None) -> int:
    """TensorStore's bytes written (or read, for ``IoDirection.READ``) by
    every kvstore driver, as orbax's ``get_tensorstore_raw_bytes`` counts
    them, from the Prometheus text (which leaks nothing): lines such as
    ``tensorstore_kvstore_file_bytes_written 210348``."""
    import tensorstore as ts

    suffix = "_bytes_read" if getattr(direction, "value", direction) == "read" else "_bytes_written"
    total = 0
    for line in ts.experimental_collect_prometheus_format_metrics("/tensorstore/kvstore/"):
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        if name.split("{", 1)[0].endswith(suffix):
            try:
                total += int(float(value))
            except ValueError:
                continue
    return total


def count_orbax_bytes_without_leaking() -> None:
    """Replace orbax's count of TensorStore's raw bytes (telemetry it takes
    around every array write and read) with `_raw_bytes`, once. An orbax
    without that function is left alone."""
    from orbax.checkpoint._src.serialization import tensorstore_utils

    if getattr(tensorstore_utils, "get_tensorstore_raw_bytes", _raw_bytes) is not _raw_bytes:
        tensorstore_utils.get_tensorstore_raw_bytes = _raw_bytes


# ----------------------------------------------------------------------------- the launcher's stop signal


class StoppedByLauncher(BaseException):
    """The launcher stops this process because another one failed."""


def _stopped(signum, frame):
    raise StoppedByLauncher


def stop_on_launcher_signal(signum: int) -> None:
    """``signum`` (the launcher's stop signal) raises `StoppedByLauncher` in this process."""
    signal.signal(signum, _stopped)
