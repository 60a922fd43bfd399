"""What `plan` tries when a step does not fit: each change alone (fsdp, remat,
bfloat16 compute, a bfloat16 optimizer state, a smaller micro-batch, each
larger count of model shards), then the ones that lowered the peak combined, best first, then
the combination with ever smaller micro-batches.

Each try is ``attempt(mesh, settings) -> Plan``, a compile of the step with
those settings; the tries come back as ``(label, Plan)`` pairs.
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
from jax.sharding import Mesh

from ..mesh import CONTEXT, DATA, MODEL, STAGE, make_mesh


def options(settings: dict, mesh: Mesh, global_batch: int) -> list[tuple[str, dict, int]]:
    """Changes worth trying, each ``(label, settings change, n_model_shards)``."""
    n_model, n_dev = mesh.shape[MODEL], mesh.devices.size // dict(mesh.shape).get(STAGE, 1)  # devices a stage
    out = []
    fixed = settings.get("specs") is not None  # specs given by hand: neither fsdp nor another mesh re-derives them
    if not settings["fsdp"] and not fixed:
        out.append(("fsdp=True", {"fsdp": True}, n_model))
    if not settings["remat"]:
        out.append(("remat (redeqx.remat(loss_fn))", {"remat": True}, n_model))
    if settings["compute_dtype"] is None:
        out.append(("compute_dtype=jnp.bfloat16", {"compute_dtype": jnp.bfloat16}, n_model))
    if settings["opt_state_dtype"] is None:
        out.append(("bfloat16 optimizer state", {"opt_state_dtype": jnp.bfloat16}, n_model))
    per_device = global_batch // mesh.shape[DATA]
    for k in (2, 4, 8):
        if per_device % (settings["accumulate"] * k) == 0:
            out.append((f"accumulate={settings['accumulate'] * k}", {"accumulate": settings["accumulate"] * k}, n_model))
            break
    bigger = [k for k in range(n_model + 1, n_dev + 1) if n_dev % k == 0 and global_batch % (n_dev // k) == 0
              and not fixed]
    for k in bigger:  # each split these devices allow (a peak need not fall with the shards: GroupNorm, a head)
        out.append((f"n_model_shards={k}", {}, k))
    return out


def explore_options(first, settings: dict, mesh: Mesh, attempt: Callable) -> list[tuple[str, object]]:
    """The tries after ``first`` (a plan that does not fit), in order."""
    devices = list(mesh.devices.flat)
    tried = []
    for label, change, n_model in options(settings, mesh, first.global_batch):
        other_mesh = mesh if n_model == mesh.shape[MODEL] else make_mesh(
            n_model, n_context_shards=dict(mesh.shape).get(CONTEXT, 1),
            n_pipeline_stages=dict(mesh.shape).get(STAGE, 1), devices=devices)
        tried.append((label, attempt(other_mesh, {**settings, **change})))
    if not any(p.fits for _, p in tried):
        tried += _combine(first, dict(tried), settings, mesh, attempt)
    return tried


def _combine(first, alone: dict, settings: dict, mesh: Mesh, attempt: Callable) -> list[tuple[str, object]]:
    """Combines, on this mesh, the options that lowered the peak alone, best
    first; keeps each that lowers the combination's peak further (one that
    raises it is left out, and said so). Then smaller micro-batches, if the
    combination still does not fit."""
    helping = sorted(((name, change) for name, change, n_model in options(settings, mesh, first.global_batch)
                      if n_model == mesh.shape[MODEL] and alone[name].peak < first.peak),
                     key=lambda nc: alone[nc[0]].peak)
    tried, combined, label, best = [], dict(settings), [], None
    for name, change in helping:
        if not label:  # the best one alone was compiled already
            combined.update(change)
            label.append(name)
            best = alone[name]
            continue
        both = {**combined, **change}
        p = attempt(mesh, both)
        if p.peak < best.peak:
            combined, best = both, p
            label.append(name)
            tried.append((" + ".join(label), p))
            if p.fits:
                break
        else:
            tried.append((f"{' + '.join(label)} + {name} (raises the peak: left out)", p))
    if best is not None and not best.fits:
        tried += _accumulate_more(combined, label, mesh, first.global_batch, attempt)
    return tried


def _accumulate_more(combined: dict, label: list[str], mesh: Mesh, global_batch: int,
                     attempt: Callable) -> list[tuple[str, object]]:
    """The combination with ever smaller micro-batches (accumulate doubled while it divides the
    per-device batch, down to one row), stopping at the first that fits: the least accumulation
    that fits, in at most log2(per-device batch) compiles."""
    tried = []
    per_device = global_batch // mesh.shape[DATA]
    k = combined["accumulate"] * 2
    base = " + ".join(n for n in label if not n.startswith("accumulate="))
    while per_device % k == 0:
        p = attempt(mesh, {**combined, "accumulate": k})
        tried.append((f"{base + ' + ' if base else ''}accumulate={k}", p))
        if p.fits:
            break
        k *= 2
    return tried
