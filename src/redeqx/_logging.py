"""`Logger`: metrics to TensorBoard and JSONL, messages to the console and a
log file, predictions to JSON, optionally wandb; process 0 only.

Files under ``workdir``::

    tensorboard/events.out.tfevents.*   scalars, for `tensorboard --logdir workdir`
    metrics.jsonl                       one {"step": ..., **metrics} line per `log` (strict JSON)
    log.txt                             every `info` message, timestamped
    outputs/<name>_step<step>.json      every `save_outputs`

Every write happens in the calling thread, so a full disk or a lost
permission is an ``OSError`` from the call that hit it, naming the file,
never a writer thread that dies quietly and leaves later calls waiting.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import jax
import numpy as np
from tqdm.auto import tqdm

from . import _hooks
from . import _progress
from ._failures import describe_failure
from ._json import dumps, to_json
from ._typing import typechecked


def _watched(name: str) -> bool:
    """The metrics whose NaN or inf means the run diverged: `make_train_step`'s
    ``loss`` and ``grad_norm``, and any ``*_loss`` / ``*_grad_norm``."""
    return name in ("loss", "grad_norm") or name.endswith(("_loss", "_grad_norm"))


class _RaisingFileHandler(logging.FileHandler):
    """``log.txt``: a write that fails raises (the logging module would
    print a "Logging error" traceback and go on, the message lost)."""

    def handleError(self, record) -> None:
        raise  # the OSError being handled, for `Logger.info` to name the file


def _write_failed(where: Path, e: OSError, also: Sequence[Path] = ()) -> OSError:
    more = f" (and {', '.join(map(str, also))})" if also else ""
    return OSError(e.errno, f"Logger could not write to {where}{more}: {describe_failure(e)}. Free space or fix the "
                   "permissions, or pass another workdir.")


class _EventFile:
    """TensorBoard scalars appended to one event file in the caller's thread.
    (tensorboardX's SummaryWriter hands them to a thread through a bounded
    queue; once that thread died on a full disk, every later call blocked on
    the full queue, forever.)"""

    def __init__(self, logdir: Path):
        from tensorboardX.event_file_writer import EventsWriter

        logdir.mkdir(parents=True, exist_ok=True)
        # the name's time is in seconds: a second logger made within the same second (a quick
        # restart) opened the first one's file and truncated it. The suffix keeps names unique, in
        # the order TensorBoard reads them (by name).
        self._writer = EventsWriter(str(logdir / "events"), filename_suffix=f".{time.time_ns()}")

    def add(self, scalars: Mapping[str, float], step: int) -> None:
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.proto.summary_pb2 import Summary
        from tensorboardX.summary import scalar

        summary = Summary(value=[scalar(k, v).value[0] for k, v in scalars.items()])
        self._writer.write_event(Event(wall_time=time.time(), step=step, summary=summary))
        self._writer.flush()

    def restart(self, step: int) -> None:
        """Mark that the run starts over at ``step``: TensorBoard hides the events at ``step`` and
        later written before this mark (a ``SessionLog.START``, as tensorboardX's ``purge_step``)."""
        from tensorboardX.proto.event_pb2 import Event, SessionLog

        self._writer.write_event(Event(wall_time=time.time(), step=step, session_log=SessionLog(status=SessionLog.START)))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def _records_before(path: Path, step: int) -> tuple[list[str], int] | None:
    """The lines of ``metrics.jsonl`` at ``path`` to keep for a run that starts at ``step`` (the
    records of earlier steps) and how many others it holds (records at ``step`` or later, a line
    cut short by a kill); None when there are none to drop."""
    import json

    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return None
    kept = []
    for line in lines:
        try:
            if json.loads(line)["step"] < step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            pass
    return None if len(kept) == len(lines) else (kept, len(lines) - len(kept))


def _check_count(name: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0):
        raise ValueError(f"{name} must be a count >= 0 of items since the previous log call, got {value!r}.")


class Logger:
    """Where a run's numbers and messages go. Only process 0 writes; on other
    processes every method does nothing, so call them unconditionally.

    - ``log(metrics, step, *, examples=None, tokens=None)`` writes the scalars
      in ``metrics`` (device arrays are fetched) to TensorBoard and every value
      to ``metrics.jsonl``. ``examples`` / ``tokens`` are how many examples and
      tokens were processed since the previous ``log``; the logger adds
      ``examples_per_s`` / ``tokens_per_s`` over that interval, and on the
      first call ``time_to_first_step_s``, the wall time since the logger was
      made (so: make it just before the loop; it includes the compile).
    - ``info(msg)`` prints ``msg`` and appends it to ``log.txt``.
    - ``save_outputs(outputs, name, step)`` writes predictions as JSON.
    - ``bar(iterable, ...)`` wraps an iterable in a tqdm bar that ``log``
      annotates with the latest ``loss`` and ``learning_rate``.
    - ``wandb=dict(project=..., ...)`` also sends metrics to Weights & Biases
      (``wandb.init(**wandb)``); wandb is imported only then and is never
      required otherwise.
    - ``nonfinite="raise"`` (default): when ``loss``, ``grad_norm`` or any
      ``*_loss`` / ``*_grad_norm`` value logged is NaN or inf, `log` writes it
      and then raises ``FloatingPointError`` naming the step, on every
      process, so a diverged run stops at the step it diverged instead of
      training on NaN. It reads the values `log` fetches anyway: no extra
      device sync. ``nonfinite="warn"`` warns and goes on.

    ``step`` is the optimizer step count (``state.step``), the x axis of every
    plot. The first ``log`` marks where this run starts: records of that step
    and later already in the workdir's ``metrics.jsonl`` (a resumed run's
    steps after its last checkpoint, which the resume replays; an earlier
    run's) are dropped from it and hidden in TensorBoard, so each step is
    recorded once. A NaN or inf is written to ``metrics.jsonl`` as the string
    ``"NaN"``, ``"Infinity"`` or ``"-Infinity"`` (strict JSON has no NaN).

    **Example:**

    ```python
    logger = redeqx.Logger("runs/mnist")
    for batch in logger.bar(redeqx.batches(train, collate_fn, 32, mesh), desc="train"):
        state, metrics = train_step(state, batch)
        logger.log(metrics, int(state.step), examples=len(batch["x"]))
    logger.close()
    ```
    """

    @typechecked
    def __init__(
        self,
        workdir: str | os.PathLike,
        *,
        tensorboard: bool = True,
        wandb: Mapping[str, Any] | None = None,
        nonfinite: Literal["raise", "warn"] = "raise",
    ):
        self.nonfinite = nonfinite
        self.workdir = Path(workdir)
        self.active = jax.process_index() == 0
        self._t_start = self._t_last = time.perf_counter()
        self._first = True
        self._started = False  # `_start_at` done
        self._bar = None
        self._tb = None
        self._wandb = None
        if not self.active:
            return
        try:
            self.workdir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OSError(f"Logger cannot create workdir {self.workdir}: {e}. Pass a writable directory.") from e
        self._jsonl = open(self.workdir / "metrics.jsonl", "a")
        self._log = logging.getLogger(f"redeqx.{self.workdir.resolve()}")
        self._log.setLevel(logging.INFO)
        self._log.propagate = False
        self._log.handlers.clear()
        fmt = logging.Formatter("%(asctime)s %(message)s", "%Y-%m-%d %H:%M:%S")
        self._file = _RaisingFileHandler(self.workdir / "log.txt")
        self._console = logging.StreamHandler(sys.stdout)
        for handler in (self._file, self._console):
            handler.setFormatter(fmt)
            self._log.addHandler(handler)
        if tensorboard:
            self._tb = _EventFile(self.workdir / "tensorboard")
        _hooks.close_at_exit(self)  # held weakly: a logger dropped earlier is not kept alive
        if wandb is not None:
            try:
                import wandb as wandb_module
            except ImportError:
                raise ImportError("Logger(wandb=...) needs wandb: pip install wandb, or pass wandb=None.") from None
            self._wandb = wandb_module.init(**dict(wandb))

    def log(self, metrics: Mapping[str, Any], step: int, *, examples: int | None = None, tokens: int | None = None) -> dict:
        """Write ``metrics`` at ``step``; returns what was written (with throughput)."""
        if not isinstance(metrics, Mapping):
            raise TypeError(f"metrics must be a dict of name -> value, got {type(metrics).__name__}.")
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
            raise TypeError(f"step must be an int (e.g. int(state.step)), got {step!r}.")
        _check_count("examples", examples)
        _check_count("tokens", tokens)
        values = to_json(jax.device_get(dict(metrics)), "metrics", strict=False)  # one fetch for all; waits for the step
        now = time.perf_counter()
        elapsed = max(now - self._t_last, 1e-9)
        if self._first:
            values["time_to_first_step_s"] = now - self._t_start
            self._first = False
        if examples is not None:
            values["examples_per_s"] = examples / elapsed
        if tokens is not None:
            values["tokens_per_s"] = tokens / elapsed
        self._t_last = now
        scalars = {k: float(v) for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        diverged = {k: v for k, v in scalars.items() if _watched(k) and not math.isfinite(v)}
        if self.active:
            self._write(values, scalars, int(step))
        if diverged:
            message = (
                f"step {int(step)}: {', '.join(f'{k} = {v}' for k, v in diverged.items())}: training diverged. "
                "Lower the learning rate, clip gradients (optax.clip_by_global_norm), skip bad updates "
                "(optax.apply_if_finite), or look at this step's batch; resume from the last checkpoint, which "
                "CheckpointManager never writes from a state holding NaN. Logger(..., nonfinite='warn') logs on."
            )
            if self.nonfinite == "raise":
                raise FloatingPointError(message)
            warnings.warn(message, stacklevel=2)
        return values

    def _start_at(self, step: int) -> None:
        """The first `log` marks where this run starts: records of ``step`` and later already in
        ``metrics.jsonl`` come from a run that went past its last checkpoint before it stopped (a
        resume replays those steps) or from an earlier run in this workdir; they are dropped, and
        TensorBoard hides them, so each step is recorded once."""
        path = self.workdir / "metrics.jsonl"
        found = _records_before(path, step)
        if found is None:
            return
        kept, dropped = found
        self._jsonl.close()
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
        self._jsonl = open(path, "a")
        if self._tb is not None:
            self._tb.restart(step)
        self._log.info(f"Logger: this run starts at step {step}; dropped {dropped} line(s) of metrics.jsonl "
                       f"from step {step} on (or cut short), written by a run that stopped after them.")

    def _write(self, values: dict, scalars: dict[str, float], step: int) -> None:
        where = self.workdir / "metrics.jsonl"
        try:
            if not self._started:
                self._started = True
                self._start_at(step)
            self._jsonl.write(dumps({"step": step, **values}, "metrics") + "\n")
            self._jsonl.flush()
            if self._tb is not None:
                where = self.workdir / "tensorboard"
                self._tb.add(scalars, step)
        except OSError as e:
            raise _write_failed(where, e) from e
        if self._wandb is not None:
            self._wandb.log(values, step=int(step))
        bar = self._bar if self._bar is not None else _progress.innermost()
        if bar is not None:  # Logger.bar's, else the innermost redeqx.batches(..., desc=...) bar
            shown = {k: f"{scalars[k]:.4g}" for k in ("loss", "learning_rate", "lr") if k in scalars and math.isfinite(scalars[k])}
            bar.set_postfix(shown, refresh=False)

    def info(self, msg: str) -> None:
        """Print ``msg`` (above any progress bar) and append it to ``log.txt``."""
        if not self.active:
            return
        try:
            if self._bar is None:
                self._log.info(str(msg))
                return
            self._file.handle(self._log.makeRecord(self._log.name, logging.INFO, __file__, 0, str(msg), None, None))
        except OSError as e:
            raise _write_failed(self.workdir / "log.txt", e) from e
        tqdm.write(str(msg))  # keeps the bar intact

    def save_outputs(self, outputs: Any, name: str, step: int) -> Path | None:
        """Write ``outputs`` (e.g. `predict`'s list) to ``outputs/<name>_step<step>.json``
        (strict JSON, as ``metrics.jsonl``: a NaN is written as the string ``"NaN"``)."""
        if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
            raise ValueError(f"name must be a plain file name such as 'test_preds', got {name!r}.")
        if not self.active:
            return None
        path = self.workdir / "outputs" / f"{name}_step{int(step)}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(dumps(outputs, "outputs", indent=1))
        os.replace(tmp, path)
        return path

    def bar(self, iterable: Iterable, *, total: int | None = None, desc: str | None = None) -> Iterable:
        """``iterable`` with a progress bar (process 0) that `log` annotates with loss and learning rate."""
        if not self.active:
            yield from iterable
            return
        self._bar = tqdm(iterable, total=total, desc=desc, leave=False, dynamic_ncols=True)
        try:
            yield from self._bar
        finally:
            self._bar.close()
            self._bar = None

    def close(self) -> None:
        """Flush and close every file (also done at interpreter exit). Every
        file is closed even when one cannot be flushed (a full disk); then an
        ``OSError`` names the first that failed and the cause."""
        if not self.active:
            return
        failed: list[tuple[Path, OSError]] = []

        def closing(where: Path, close) -> None:
            try:
                close()
            except OSError as e:
                failed.append((where, e))

        if self._tb is not None:
            closing(self.workdir / "tensorboard", self._tb.close)
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if not self._jsonl.closed:
            closing(self.workdir / "metrics.jsonl", self._jsonl.close)
        for handler in list(self._log.handlers):
            closing(self.workdir / "log.txt", handler.close)
            self._log.removeHandler(handler)
        if failed:
            where, e = failed[0]
            raise _write_failed(where, e, also=[w for w, _ in failed[1:]]) from e

    def __enter__(self) -> Logger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
