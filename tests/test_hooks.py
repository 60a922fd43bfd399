"""Process-level hooks (issue 33): ``import redeqx`` changes no
``sys.excepthook``, ``atexit`` entry or signal handler; the calls that need
them install each once (``src/redeqx/_hooks.py`` lists them all)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

# Run in a fresh interpreter: this pytest process has long imported redeqx and made loggers and managers.
_SCRIPT = textwrap.dedent("""
    import atexit, json, signal, sys, tempfile, threading

    registered = []
    _register = atexit.register

    def recording(fn, *args, **kwargs):  # who registers what, whatever the count says
        registered.append(getattr(fn, "__module__", None) or repr(fn))
        return _register(fn, *args, **kwargs)

    atexit.register = recording
    # redeqx's dependencies first: their own atexit entries are not redeqx's
    import equinox, jax, jax.numpy, jaxtyping, beartype, numpy, optax, orbax.checkpoint, tensorboardX, tqdm.auto, xxhash

    def snapshot():
        return {
            "atexit": atexit._ncallbacks(),
            "excepthook": id(sys.excepthook),
            "threading.excepthook": id(threading.excepthook),
            "unraisablehook": id(sys.unraisablehook),
            "signals": {s.name: repr(signal.getsignal(s)) for s in signal.valid_signals()
                        if isinstance(s, signal.Signals)},
        }

    before = snapshot()
    del registered[:]
    import redeqx
    import redeqx.models
    imported, by_import = snapshot(), list(registered)

    workdir = tempfile.mkdtemp()
    loggers = [redeqx.Logger(f"{workdir}/log{i}", tensorboard=False) for i in range(2)]
    managers = [redeqx.CheckpointManager(f"{workdir}/ckpt{i}") for i in range(2)]
    from redeqx import _hooks
    made = snapshot()
    print(json.dumps({
        "before": before, "imported": imported, "by_import": by_import, "made": made,
        "hook_is_redeqx": sys.excepthook is _hooks._excepthook,
        "registered_after": registered,
    }))
    for x in loggers + managers:
        x.close()
""")


def _run() -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.join(os.path.dirname(__file__), "..", "src"),
                                                      env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def seen():
    return _run()


@pytest.mark.slow
def test_import_installs_no_hook(seen):
    before, imported = seen["before"], seen["imported"]
    assert seen["by_import"] == []  # no atexit.register call at all during `import redeqx, redeqx.models`
    assert imported["atexit"] == before["atexit"]
    for name in ("excepthook", "threading.excepthook", "unraisablehook"):
        assert imported[name] == before[name], name
    changed = {s: (before["signals"][s], h) for s, h in imported["signals"].items() if before["signals"][s] != h}
    assert changed == {}


@pytest.mark.slow
def test_loggers_and_managers_install_each_hook_once(seen):
    imported, made = seen["imported"], seen["made"]
    assert made["atexit"] == imported["atexit"] + 1  # one entry for two loggers and two managers
    assert [m for m in seen["registered_after"] if m.startswith("redeqx")] == ["redeqx._hooks"]
    assert seen["hook_is_redeqx"]  # one excepthook replacement, not one per manager
    assert made["signals"] == imported["signals"]  # SIGTERM is watched from a manager's first save, not before


# ----------------------------------------------------------------------------- the hooks themselves, in this process


def test_the_excepthook_finishes_saves_then_reports_then_stops_the_process(monkeypatch, capsys):
    from redeqx import _hooks

    calls = []
    monkeypatch.setattr(_hooks._EXIT, "finish_saves", lambda why: calls.append("finish") or ["a save failed"])
    monkeypatch.setattr(_hooks._UNCAUGHT, "previous", lambda kind, value, tb: calls.append("report"))
    monkeypatch.setattr(_hooks._UNCAUGHT, "stop_process", False)
    _hooks._excepthook(ValueError, ValueError("boom"), None)
    assert calls == ["finish", "report"]
    assert "a save failed" in capsys.readouterr().err

    monkeypatch.setattr(_hooks._UNCAUGHT, "stop_process", True)  # after initialize() joined several processes
    monkeypatch.setattr(_hooks.os, "_exit", lambda code: calls.append(f"exit {code}"))
    _hooks._excepthook(ValueError, ValueError("boom"), None)
    assert calls[2:] == ["finish", "report", "exit 1"]
    assert "stops on this uncaught ValueError" in capsys.readouterr().err


def test_at_exit_closes_loggers_newest_first_then_checks_saves(monkeypatch, capsys):
    import weakref

    from redeqx import _hooks

    closed = []

    class Closing:
        def __init__(self, name, fail=False):
            self.name, self.fail = name, fail

        def close(self):
            closed.append(self.name)
            if self.fail:
                raise OSError("disk full")

    objects = [Closing("old"), Closing("failing", fail=True), Closing("new")]
    monkeypatch.setattr(_hooks._EXIT, "closers", [weakref.ref(o) for o in objects])
    monkeypatch.setattr(_hooks._EXIT, "finish_saves", lambda why: closed.append("saves") or [])
    _hooks._at_exit()
    assert closed == ["new", "failing", "old", "saves"]  # a close that fails stops neither the others nor the check
    assert "disk full" in capsys.readouterr().err


def test_the_sigterm_handler_is_installed_once_and_the_previous_one_put_back():
    import signal

    from redeqx import _hooks

    def mine(signum, frame):
        pass

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        _hooks.watch_sigterm()
        _hooks.watch_sigterm()  # a second manager
        assert signal.getsignal(signal.SIGTERM) == _hooks._SIGTERM.handler
        _hooks.unwatch_sigterm()
        assert signal.getsignal(signal.SIGTERM) == _hooks._SIGTERM.handler  # the other manager still listens
        _hooks.unwatch_sigterm()
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)


async def _users_coroutine():
    return None


def test_orbax_coroutines_a_failed_restore_abandoned_print_nothing_when_collected(monkeypatch, tmp_path):
    """Before: when one array of a restore failed, orbax left its other reads suspended in their
    ``async with``; the garbage collector closed them later, at any moment, each printing a 60-line
    "Exception ignored in: <coroutine object _read_array_index_and_device_put>" block (517-2,429
    lines after a damaged checkpoint). A restore installs the hook that drops exceptions of orbax's
    own coroutines as they are finalised; any other goes to the hook it replaced."""
    import types

    import jax
    import jax.numpy as jnp
    from orbax.checkpoint._src.serialization import serialization

    import redeqx
    from redeqx import _hooks

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.object))
    monkeypatch.setattr(_hooks, "_PREVIOUS_UNRAISABLE", [])
    mesh = redeqx.make_mesh(1)
    like = {"w": jax.device_put(jnp.ones(4), jax.NamedSharding(mesh, jax.P()))}
    redeqx.save_checkpoint(tmp_path / "c", like)
    redeqx.restore_checkpoint(tmp_path / "c", like, mesh)
    assert sys.unraisablehook is _hooks._unraisable
    orbax_read = serialization._read_array_index_and_device_put(  # created, never run: as orbax abandons it
        [], (), None, global_shape=(4,), new_shard_shape=(4,), dtype=None, byte_limiter=None, strict=True, dll=None,
        memory_kind=None)
    users = _users_coroutine()
    for coroutine in (orbax_read, users):
        sys.unraisablehook(types.SimpleNamespace(exc_type=RuntimeError, exc_value=RuntimeError(
            "coroutine ignored GeneratorExit"), exc_traceback=None, err_msg="Exception ignored in", object=coroutine))
        coroutine.close()
    assert seen == [users]
