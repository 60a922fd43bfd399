"""The benchmarks' harness: devices, workers, the libtpu ahead-of-time
compile, alternated timing and benchmarks/RESULTS.md's sections.

Every benchmark runs from the repository root as ``python -m benchmarks.NAME``
and starts here: ``cpu_devices(8)`` before importing JAX, ``parser(__doc__)``
(with ``--no-write``), ``worker``/``serve`` for a figure that needs a fresh
process (its own device count, the libtpu venv), ``alternate`` to time
variants side by side, ``report`` to print a section and write it. tests/ is a
pytest root, not a package: this module puts it on ``sys.path`` (the only
place that does) and on every worker's ``PYTHONPATH``, for the tests' models.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "RESULTS.md"
if str(ROOT / "tests") not in sys.path:
    sys.path.append(str(ROOT / "tests"))
HEADER = ("# Benchmark results\n\nRun every benchmark from the repository root as `python -m benchmarks.NAME`; each "
          "section names the command that rewrote it. Ratios are measured side by side in one run.\n")
NOTES = "<!-- notes: written by hand, kept when the section is rewritten -->"
TPU_VENV = HERE / ".venv-tpu"
# XLA:CPU flags that make a compile 1.5-3x faster without changing its buffer assignment (they lower LLVM's
# effort on code nobody runs: a plan never executes the step); checked to the byte on GPT-2 Large's widths.
FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                "--xla_cpu_use_fusion_emitters=false")
# TPU v4 slices by chip count, as Cloud TPU names them; 4 chips per host, one JAX device per chip (megacore).
TPU_V4_SLICES = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8"}


# ----------------------------------------------------------------------------- devices and environments

def cpu_devices(n: int = 8) -> None:
    """Simulate ``n`` CPU devices in this process; call before importing JAX."""
    if "jax" in sys.modules:
        raise RuntimeError("cpu_devices() must run before JAX is imported")
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={n}")


def worker_env(devices: int | None = None, xla_flags: str = "", **extra: str) -> dict:
    """This process's environment for a worker: the repository and tests/ on
    its ``PYTHONPATH``, and ``devices`` simulated CPU devices when given."""
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH")]))
    if devices is not None:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices} {xla_flags}".strip()
    return env


def libtpu(chips: int = 8) -> tuple[str, dict]:
    """The Python of benchmarks/.venv-tpu and an environment in which libtpu
    compiles for a TPU v4 slice of ``chips``, no TPU attached; exits without it."""
    python = TPU_VENV / "bin" / "python"
    if not python.exists():
        sys.exit("no benchmarks/.venv-tpu: run `python -m benchmarks.table1 --setup-tpu` once")
    return str(python), worker_env(TPU_ACCELERATOR_TYPE=f"v4-{2 * chips}", TPU_WORKER_HOSTNAMES="localhost",
                                   TPU_SKIP_MDS_QUERY="1", ALLOW_MULTIPLE_LIBTPU_LOAD="1")  # no TPU: compiles may share


def tpu_v4_devices(n: int = 8) -> list:
    """The ``n`` chips of a TPU v4 slice, no TPU attached: libtpu compiles a
    step on a mesh of them as for that slice; nothing can run on them."""
    from jax.experimental import topologies

    if n not in TPU_V4_SLICES:
        raise ValueError(f"no TPU v4 slice of {n} chips here; choose one of {sorted(TPU_V4_SLICES)}")
    return list(topologies.get_topology_desc(platform="tpu", topology_name=f"v4:{TPU_V4_SLICES[n]}",
                                             chip_config_name="megacore", chips_per_host_bounds=(2, 2, 1),
                                             num_slices=1).devices)


def compiler(tpu: bool, devices: int = 8, xla_flags: str = "") -> tuple[str, dict]:
    """A worker's Python and environment: libtpu's for a TPU v4 slice of
    ``devices`` chips, or this Python with ``devices`` simulated CPU devices."""
    return libtpu(devices) if tpu else (sys.executable, worker_env(devices, xla_flags))


def compile_devices(n: int, tpu: bool) -> list:
    """``n`` devices to compile for: TPU v4 chips (none attached) or this process's own."""
    import jax

    return tpu_v4_devices(max(n, 4))[:n] if tpu else jax.devices()[:n]


def setup_tpu() -> None:
    """benchmarks/.venv-tpu: this environment plus the libtpu JAX's ``tpu`` extra names."""
    import importlib.metadata

    pins = [r.split(";")[0].strip() for r in importlib.metadata.requires("jax") or []
            if r.startswith("libtpu") and "extra == \"tpu\"" in r]
    if not pins:
        sys.exit("this jax names no libtpu in its 'tpu' extra; install a jax with TPU support")
    subprocess.run([sys.executable, "-m", "venv", "--clear", "--system-site-packages", str(TPU_VENV)], check=True)
    subprocess.run([str(TPU_VENV / "bin" / "python"), "-m", "pip", "install", "-q", *pins], check=True)
    print(f"TPU compiler venv ({' '.join(pins)}) ready at {TPU_VENV}")


GPU_VENV = HERE / ".venv-gpu"
# What XLA:GPU needs to know of a GPU it compiles for with none attached (a stream_executor
# GpuTargetConfigProto): the H100 SXM's, as JAX's CUDA plugin reads it off the card; the H200
# differs in memory (141 GB, 4.8 TB/s) and L2 (60 MB), which the figures here scale by.
H100_TARGET = """gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 84929347584 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 }
runtime_version { major: 13 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""
# The A100 SXM4 80GB's (sm_80, 108 SMs): a GPU off the Hopper kernels (`redeqx.models._grouped`).
A100_TARGET = (H100_TARGET.replace("shared_memory_per_core: 233472", "shared_memory_per_core: 167936")
               .replace("core_count: 132 fpus_per_core: 128", "core_count: 108 fpus_per_core: 64")
               .replace("memory_bandwidth: 3352320000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98",
                        "memory_bandwidth: 2039000000000 l2_cache_size: 41943040 clock_rate_ghz: 1.41")
               .replace("device_memory_size: 84929347584 shared_memory_per_block_optin: 232448",
                        "device_memory_size: 85899345920 shared_memory_per_block_optin: 166912")
               .replace("cuda_compute_capability { major: 9 }", "cuda_compute_capability { major: 8 }")
               .replace("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"))
GPU_TARGETS = {"H100": H100_TARGET, "A100": A100_TARGET}
HBM_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.039e12}


def gpu_compiler() -> tuple[str, dict]:
    """The Python of benchmarks/.venv-gpu and an environment in which it compiles for H100s with none
    attached (JAX on the CPU, the CUDA plugin loaded for its compiler; no autotuning without a card);
    exits without it."""
    python = GPU_VENV / "bin" / "python"
    if not python.exists():
        sys.exit("no benchmarks/.venv-gpu: run `python -m benchmarks.gpu_compile --setup` once")
    env = worker_env(JAX_PLATFORMS="cpu", JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1")
    env["XLA_FLAGS"] = "--xla_gpu_autotune_level=0"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env["PYTHONPATH"]])
    return str(python), env


def gpu_devices(n: int = 1, gpu: str = "H100") -> list:
    """``n`` GPUs of one host (`GPU_TARGETS`' ``gpu``), none attached: XLA:GPU compiles a program on
    a mesh of them as for those GPUs (JAX's deviceless compile); nothing can run on them."""
    from jax.experimental import topologies

    return list(topologies.get_topology_desc(platform="cuda", topology=f"1x1x{n}",
                                             target_config=GPU_TARGETS[gpu]).devices)


def setup_gpu() -> None:
    """benchmarks/.venv-gpu: this environment plus JAX's CUDA 13 plugin of this JAX's version, with
    the CUDA libraries it loads (cuDNN is asked its version while a program is traced)."""
    import jax

    subprocess.run([sys.executable, "-m", "venv", "--clear", "--system-site-packages", str(GPU_VENV)], check=True)
    subprocess.run([str(GPU_VENV / "bin" / "python"), "-m", "pip", "install", "-q",
                    f"jax-cuda13-plugin[with-cuda]=={jax.__version__}"], check=True)
    print(f"GPU compiler venv (jax-cuda13-plugin {jax.__version__}) ready at {GPU_VENV}")


def param_count(model) -> int:
    """Elements of a model's arrays (abstract ones included)."""
    import math

    import jax

    return sum(math.prod(x.shape) for x in jax.tree.leaves(model) if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)))


def compiled_figures(compiled) -> dict:
    """A compiled program's temporaries, argument/output bytes and FLOPs."""
    memory, cost = compiled.memory_analysis(), compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return dict(temporaries=memory.temp_size_in_bytes, arguments=memory.argument_size_in_bytes,
                outputs=memory.output_size_in_bytes, flops=float((cost or {}).get("flops", 0.0)))


def next_token_loss(model, batch, key):
    """Mean next-token cross-entropy of ``batch["ids"]`` (B, T + 1), its statistics in fp32
    (`redeqx.models.cross_entropy`: the logits stay in the compute dtype)."""
    import jax

    from redeqx.models import cross_entropy

    logits = jax.vmap(model)(batch["ids"][:, :-1])
    return cross_entropy(logits, batch["ids"][:, 1:], ignore_index=None)


def source_named(path: str | None) -> str:
    """``--before``'s source directory as a report names it: the path and, in a git checkout, its commit."""
    if not path:
        return "(not given)"
    found = subprocess.run(["git", "-C", path, "log", "-1", "--format=%h"], capture_output=True, text=True)
    return f"{path} ({found.stdout.strip()})" if found.returncode == 0 and found.stdout.strip() else path


# ----------------------------------------------------------------------------- workers

class WorkerFailed(RuntimeError):
    """A `worker` that exited with ``returncode`` (negative: killed by that signal, as by an abort)."""

    def __init__(self, message: str, returncode: int):
        super().__init__(message)
        self.returncode = returncode


def worker(module: str, fn: str, *, python: str = sys.executable, env: dict | None = None, **kwargs):
    """``fn(**kwargs)`` of ``module`` (a benchmark's ``__file__``) in a fresh
    process that ``serve`` answers (8 simulated CPU devices by default): the
    JSON of the last line it prints."""
    task = json.dumps({"fn": fn, "kwargs": kwargs})
    proc = subprocess.run([python, "-m", f"benchmarks.{Path(module).stem}", "--worker", task], env=env or worker_env(8),
                          cwd=ROOT, stdout=subprocess.PIPE, text=True)
    if proc.returncode:
        raise WorkerFailed(f"worker {fn}({kwargs}) failed (exit {proc.returncode}); its output is above",
                           proc.returncode)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def serve(namespace: dict) -> bool:
    """In a worker started by ``worker``: run the function it names, print its
    JSON result, and return True (the caller returns at once)."""
    if len(sys.argv) < 3 or sys.argv[1] != "--worker":
        return False
    task = json.loads(sys.argv[2])
    print(json.dumps(namespace[task["fn"]](**task["kwargs"])), flush=True)
    return True


class NotProbed(Exception):
    """A probe missing from a ``Probes`` cache that may not compile."""


class Probes:
    """Probe results by task, each run once (``run(task)``) and kept in the
    JSON file ``path`` when given; with ``cached_only`` a missing one raises.
    ``fixed``: fields added to every task."""

    def __init__(self, run, path: Path | None = None, cached_only: bool = False, **fixed):
        self.run, self.path, self.cached_only, self.fixed = run, path, cached_only, fixed
        self.cache = json.loads(path.read_text()) if path and path.exists() else {}

    def __call__(self, **task) -> dict:
        task = {**task, **self.fixed}
        key = json.dumps(task, sort_keys=True)
        if key not in self.cache:
            if self.cached_only:
                raise NotProbed(key)
            self.cache[key] = self.run(task)
            if self.path:
                self.path.write_text(json.dumps(self.cache, indent=1))
        print(f"  {key} -> {json.dumps(self.cache[key])[:160]}", file=sys.stderr, flush=True)
        return self.cache[key]

    def get(self, **task) -> dict | None:
        """``self(**task)``, or None for a task not probed (with ``cached_only``)."""
        try:
            return self(**task)
        except NotProbed:
            return None


def probe_options(p: argparse.ArgumentParser, cache: Path) -> None:
    """The options of a benchmark whose compiles are cached `Probes`: ``--cpu``, ``--cache``, ``--cached-only``."""
    p.add_argument("--cpu", action="store_true", help="XLA:CPU even when libtpu is installed")
    p.add_argument("--cache", type=Path, default=cache)
    p.add_argument("--cached-only", action="store_true", help="compile nothing: the section from --cache's probes")


def probes_for(args, make_run) -> tuple[Probes, bool]:
    """The `Probes` of ``probe_options``' ``args``, run by ``make_run(tpu)``, and whether they
    compile with libtpu (installed, and no ``--cpu``)."""
    tpu = (TPU_VENV / "bin" / "python").exists() and not args.cpu
    return Probes(make_run(tpu), args.cache, args.cached_only, tpu=tpu), tpu


# ----------------------------------------------------------------------------- options and timing

def parser(doc: str | None, **ints: int) -> argparse.ArgumentParser:
    """The benchmark's options, with ``--no-write`` (print only) and an
    integer option ``--name`` for each of ``ints`` (its default)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    for name, default in ints.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    return p


def timed(fn, n: int) -> list[float]:
    """Wall seconds of ``n`` calls of ``fn``, each waited for (``jax.block_until_ready``)."""
    import jax

    times = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return times


def alternate(runners: dict, rounds: int, steps: int, *, warmup: int = 3, per_step: bool = True) -> dict:
    """{name: median seconds per call}, timed side by side: ``rounds`` rounds,
    the order rotating each round, the runners alternating call by call
    (``per_step``) or ``steps`` calls each."""
    names = list(runners)
    for name in names:
        timed(runners[name], warmup)
    times = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        if per_step:
            for _ in range(steps):
                for name in order:
                    times[name] += timed(runners[name], 1)
        else:
            for name in order:
                times[name].append(statistics.median(timed(runners[name], steps)))
    return {name: statistics.median(t) for name, t in times.items()}


# ----------------------------------------------------------------------------- RESULTS.md

def command() -> str:
    """The command that ran this benchmark, as a user types it (``--no-write`` left out)."""
    args = [a for a in sys.argv[1:] if a != "--no-write"]
    return " ".join(["python", "-m", f"benchmarks.{Path(sys.argv[0]).stem}", *args])


def write_section(title: str, body: str, *, cmd: str | None = None) -> None:
    """Rewrite (or append) RESULTS.md's ``## title`` with the command that
    made it, keeping the hand-written text below its NOTES marker."""
    text = RESULTS.read_text() if RESULTS.exists() else HEADER
    stamp = f"_{datetime.date.today().isoformat()}, {platform.machine()}, {platform.node() or 'host'}_"
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    old = pattern.search(text)
    notes = old.group(0).split(NOTES, 1)[1].strip() if old and NOTES in old.group(0) else ""
    section = f"## {title}\n\n{stamp}\n\nCommand: `{cmd or command()}`\n\n{body.strip()}\n"
    if notes:
        section += f"\n{NOTES}\n\n{notes}\n"
    head, history, tail = text.partition("\n## History")  # a new section goes before the History
    text = pattern.sub(lambda _: section + "\n", text) if old else f"{head.rstrip()}\n\n{section}{history}{tail}"
    RESULTS.write_text(text.rstrip() + "\n")
    print(f"wrote section '{title}' of {RESULTS}")


def report(args, title: str, body: str, *, cmd: str | None = None) -> None:
    """Print a section; write it to RESULTS.md unless ``--no-write``."""
    print(f"## {title}\n\n{body}")
    if not getattr(args, "no_write", False):
        write_section(title, body, cmd=cmd)
