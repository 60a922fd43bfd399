"""A run fed by Grain for tests/test_grain_resume.py: each process reads its
own share of the examples through a shuffled, repeated Grain pipeline
(``mp_prefetch`` worker processes when WORKERS > 0), `grain_batches` makes
global batches of it, and `CheckpointManager` saves the pipeline's position
with the train state every EVERY steps; at step KILL_AT every process
SIGKILLs its process group (itself and its Grain workers), and a run started again resumes from the latest checkpoint.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/grain_resume_worker.py WORKDIR KILL_AT WORKERS
    python -m redeqx.launch -n 2 tests/grain_resume_worker.py WORKDIR KILL_AT WORKERS

Process 0 prints "step N <hash of the global batch>" after each step and
writes WORKDIR/final.npz at the end; KILL_AT=0 runs to the end.
"""

import hashlib
import os
import signal
import sys
from pathlib import Path

import equinox as eqx
import grain
import jax
import numpy as np
from absl import flags
from jax.experimental import multihost_utils

import redeqx
from resume_worker import collate_fn, say, training

N_STEPS, EVERY, N_EXAMPLES, PER_DEVICE = 10, 3, 40, 2  # mesh data=4: a global batch of 8, 5 an epoch


def pipeline(workers: int):
    """This process's examples (every ``process_count``-th), shuffled anew
    each epoch, forever."""
    rng = np.random.default_rng(0)
    examples = [(rng.normal(size=8).astype(np.float32), rng.normal(size=4).astype(np.float32))
                for _ in range(N_EXAMPLES)]
    ds = grain.MapDataset.source(examples)[jax.process_index()::jax.process_count()]
    ds = ds.shuffle(seed=5).repeat().to_iter_dataset()
    if workers:
        flags.FLAGS.mark_as_parsed()  # grain 0.2.18 reads an absl flag in its workers (fixed after it)
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    return ds


def digest(batch) -> str:
    full = {k: np.asarray(multihost_utils.process_allgather(v, tiled=True)) for k, v in sorted(batch.items())}
    return hashlib.sha256(b"".join(x.tobytes() for x in full.values())).hexdigest()[:16]


def main(workdir, kill_at, workers):
    mesh, specs, state, train_step = training()
    batches = redeqx.grain_batches(pipeline(int(workers)), collate_fn, PER_DEVICE, mesh)

    manager = redeqx.CheckpointManager(workdir, keep_last=2, every=EVERY)
    found = manager.restore(state, mesh, specs, data_iterator=batches)
    if found is not None:
        state = found[0]
        say(f"resumed at step {int(state.step)}, batch {batches.get_state()['batches']}")
    for batch in batches:
        state, _ = train_step(state, batch)
        step = int(state.step)
        say(f"step {step} {digest(batch)}")
        manager.save(state, data_iterator=batches)
        # as a scheduler kills a job: its Grain workers too (they outlive a lone kill). Process 0 only, once it
        # has printed the step: a process 1 that got there first killed itself, and the launcher then stopped
        # process 0 before it printed. The launcher stops process 1 (no Grain workers there) when 0 dies.
        if step == int(kill_at) and jax.process_index() == 0:
            os.killpg(os.getpgrp(), signal.SIGKILL)
        if step == N_STEPS:
            break
    batches.close()
    manager.close()
    leaves = jax.tree.leaves(eqx.filter((state.model, state.opt_state), eqx.is_array))
    gathered = [np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in leaves]
    if jax.process_index() == 0:
        np.savez(Path(workdir) / "final.npz", *gathered, step=np.asarray(int(state.step)))


if __name__ == "__main__":
    main(*sys.argv[1:])
