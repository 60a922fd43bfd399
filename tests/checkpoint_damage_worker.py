"""Damaged checkpoints restored by several processes onto other layouts
(run by `test_multihost.py` as ``python -m redeqx.launch -n 2
tests/checkpoint_damage_worker.py DIR``).

``DIR/by_1`` holds checkpoints of `model` saved by one process on
``make_mesh(2)``: ``intact``, one per damage of `_helpers.DAMAGES` (valid
files holding damaged values of ``layers.1.weight``, split over ``model``),
and ``run``, a manager's workdir whose newest step is damaged. The worker
saves the same set itself (``DIR/by_2``, saved by both processes), then
restores each onto several meshes and writes what happened, per process,
to ``DIR/process_<i>.json``: ``{"by_1/values swapped@data": "CheckpointError", ...}``.
"""

from __future__ import annotations

import json
import shutil
import sys
import warnings
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
from _helpers import DAMAGES, damaged, mlp

import redeqx
from redeqx.data._data import to_host


def saved_model(mesh):
    """The model the checkpoints hold, on ``mesh``, and its specs."""
    model = mlp()
    specs = redeqx.sharding_rules(model, mesh)
    return redeqx.shard(model, specs, mesh), specs


def save_set(directory: Path) -> None:
    """``intact`` and one checkpoint per damage in ``directory`` (a
    collective: every process calls it)."""
    model, _ = saved_model(redeqx.make_mesh(2))
    w = model.layers[1].weight
    redeqx.save_checkpoint(directory / "intact", model)
    for damage in DAMAGES:
        values = damaged(to_host(w), damage)
        bad = jax.make_array_from_callback(w.shape, w.sharding, values.__getitem__)
        redeqx.save_checkpoint(directory / f"{damage}.values", eqx.tree_at(lambda m: m.layers[1].weight, model, bad))
        redeqx.save_checkpoint(directory / damage, model)
        barrier(f"saved {damage}")
        if jax.process_index() == 0:  # the damaged values under the intact metadata
            shutil.rmtree(directory / damage / "model")
            shutil.copytree(directory / f"{damage}.values" / "model", directory / damage / "model")
        barrier(f"damaged {damage}")


def barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


LAYOUTS = {  # name -> (mesh, fsdp)
    "data": lambda: (redeqx.make_mesh(1), False),
    "model": lambda: (redeqx.make_mesh(4), False),
    "fsdp": lambda: (redeqx.make_mesh(2), True),
    "context": lambda: (redeqx.make_mesh(1, n_context_shards=2), False),
}


def main(directory: str) -> None:
    directory = Path(directory)
    redeqx.initialize()
    save_set(directory / "by_2")
    want = [np.asarray(x) for x in jax.tree.leaves(eqx.filter(mlp(), eqx.is_array))]
    result = {}
    for name, layout in LAYOUTS.items():
        mesh, fsdp = layout()
        like = eqx.filter_eval_shape(mlp)
        specs = redeqx.sharding_rules(like, mesh, fsdp=fsdp)
        for source in ("by_1", "by_2"):
            for case in ("intact", *DAMAGES):
                try:
                    got = redeqx.restore_checkpoint(directory / source / case, like, mesh, specs)
                except redeqx.CheckpointError:
                    outcome = "CheckpointError"
                else:
                    same = all(np.array_equal(a, b) for a, b in
                               zip(to_host(jax.tree.leaves(eqx.filter(got, eqx.is_array))), want, strict=True))
                    outcome = "restored" if same else "restored other values"
                result[f"{source}/{case}@{name}"] = outcome
        with warnings.catch_warnings(record=True) as caught, redeqx.CheckpointManager(directory / "by_1" / "run") as m:
            warnings.simplefilter("always")
            found = m.restore(like, mesh, specs)
        result[f"manager@{name}"] = {"step": None if found is None else found[1]["step"],
                                     "warned": [str(w.message)[:200] for w in caught]}
    (directory / f"process_{jax.process_index()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
