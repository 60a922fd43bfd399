"""Preemption: the SIGTERM a scheduler sends before it kills a job, and the
step at which every process agrees to save and stop.

Cloud VMs, SLURM and Kubernetes warn a job with SIGTERM, then kill it with
SIGKILL after a grace period (often 30 s). `CheckpointManager.save` asks
`reached` once per call; when it says yes the manager writes a checkpoint,
waits for it, and raises `Preempted`, which exits with status 143.

- Several processes (`jax.distributed` started, as `redeqx.initialize` or
  `python -m redeqx.launch` do): JAX's preemption service catches SIGTERM in
  any process, tells the others, and
  ``jax.experimental.multihost_utils.reached_preemption_sync_point`` returns
  True in every process at the same call, a little after the notice.
- One process: a SIGTERM handler (``_hooks.py``), installed while a manager
  is open, sets a flag that the next call reads.
"""

from __future__ import annotations

import signal
import sys
import threading
import warnings
from pathlib import Path

import jax

from .. import _hooks

PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM  # 143: "ended by SIGTERM", as a shell reports it
"""The exit status (143) of a script that `Preempted` ended after its checkpoint was saved:
"ended by SIGTERM", as a shell reports it, so a scheduler requeues the job."""


class Preempted(SystemExit):
    """Raised by `CheckpointManager.save` once the checkpoint of a preemption
    is on disk. A ``SystemExit``: uncaught, the process exits with status
    ``143`` (128 + SIGTERM), the status schedulers read as "ended by its
    SIGTERM" (SLURM requeues a job with ``--requeue``; a Kubernetes Job's
    ``podFailurePolicy`` can match it with ``onExitCodes``). ``finally``
    blocks and ``with`` statements run on the way out; catch it to do
    something else first.

    ``path`` is the checkpoint written, ``step`` its step.
    """

    def __init__(self, path: Path, step: int):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.path = path
        self.step = step

    def __str__(self) -> str:
        return (f"preempted: SIGTERM received; saved step {self.step} to {self.path} and exiting with status "
                f"{PREEMPTED_EXIT_CODE}")


_warned: set[str] = set()


def _jax_decides() -> bool:
    return jax.distributed.is_initialized()


def watch() -> bool:
    """Start listening for SIGTERM (one process); returns whether a handler
    was installed (undo it with `unwatch`). With `jax.distributed` running,
    JAX's preemption service already listens: nothing to install."""
    if _jax_decides():
        if not jax.config.jax_enable_preemption_service and "service" not in _warned:
            _warned.add("service")
            warnings.warn(
                "redeqx.CheckpointManager: jax_enable_preemption_service is off, so a preemption (SIGTERM) is not "
                "noticed and the run is killed without a checkpoint; leave it on (JAX's default).",
                stacklevel=3,
            )
        return False
    if threading.current_thread() is not threading.main_thread():
        if "thread" not in _warned:
            _warned.add("thread")
            warnings.warn(
                "redeqx.CheckpointManager made outside the main thread cannot listen for SIGTERM (Python runs "
                "signal handlers on the main thread only): a preemption ends the run without a checkpoint.",
                stacklevel=3,
            )
        return False
    _hooks.watch_sigterm()
    return True


def unwatch() -> None:
    """Undo one `watch`; the last one puts the previous SIGTERM handler back."""
    _hooks.unwatch_sigterm()


def reached(call: int) -> bool:
    """Whether this call is the one to save and stop at. ``call`` counts the
    calls, 1, 2, 3, ... in the same sequence on every process (JAX's protocol
    picks "the fastest process's count + 1")."""
    if not _jax_decides():
        return _hooks.sigterm_received()
    if not jax.config.jax_enable_preemption_service:
        return False
    from jax.experimental import multihost_utils

    return multihost_utils.reached_preemption_sync_point(call)


def exit_saved(path: Path, step: int) -> None:
    """Says (process 0) that the preemption's checkpoint is on disk, and raises `Preempted`."""
    if jax.process_index() == 0:
        print(f"redeqx: preempted (SIGTERM): saved step {step} to {path}; exiting with status "
              f"{PREEMPTED_EXIT_CODE}.", file=sys.stderr, flush=True)
    raise Preempted(path, step)
