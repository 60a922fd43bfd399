"""Pin the sharding of an activation inside a model: `constrain`.

The sharding rules only place parameters. XLA's partitioner (Shardy, the
default in this JAX; GSPMD before it) then propagates layouts to every
activation, and on its own it may gather activations around a
row-parallel matmul instead of all-reducing them. A few pins (the head dim of
Q/K/V on ``model``, the residual stream replicated over ``model``) give the
Megatron-LM plan: two all-reduces per layer forward, two backward.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import PyTree

from ._mesh import CONTEXT
from .._typing import typechecked


def _axes(entry) -> tuple[str, ...]:
    if entry is None or entry is P.UNCONSTRAINED:
        return ()
    return entry if isinstance(entry, tuple) else (entry,)


def _fit(spec: P, shape: tuple[int, ...], sizes: dict[str, int], where: str) -> P:
    if len(spec) > len(shape):
        raise ValueError(
            f"constrain: spec {spec} has {len(spec)} entries but the array has shape {shape}; "
            f"give at most {len(shape)} entries (one per dim, None for 'not split')."
        )
    entries = []
    for d, entry in enumerate(spec):
        if entry is P.UNCONSTRAINED:  # left to the partitioner (a head's logits follow the head's layout)
            entries.append(entry)
            continue
        # 'context' (the sequence split) names a dim that a mesh without that axis keeps whole,
        # so a model written for split sequences runs on every redeqx mesh
        axes = tuple(a for a in _axes(entry) if a != CONTEXT or a in sizes)
        entry = None if not axes else axes if isinstance(entry, tuple) else entry
        for a in axes:
            if a not in sizes:
                raise ValueError(
                    f"constrain: spec {spec} names mesh axis {a!r}, but the mesh{where} has axes "
                    f"{tuple(sizes)}; use axes of that mesh (redeqx meshes have 'data' and 'model')."
                )
        n = 1
        for a in axes:
            n *= sizes[a]
        # An axis that does not divide the dim (a batch of one row during
        # generation, 2 KV heads over 4 shards) leaves that dim replicated.
        entries.append(entry if shape[d] % n == 0 else None)
    return P(*entries)


@typechecked
def constrain(x: PyTree, spec: P, *, mesh: Mesh | None = None) -> PyTree:
    """Pin the layout of activation ``x`` (an array or a pytree of arrays) to ``spec``.

    Call it inside a model, at the points where the Megatron-LM plan fixes a
    layout. The mesh is ``mesh`` if given, else the one in context: redeqx's
    steps (`make_train_step`, `make_eval_step`, `make_predict_step`,
    `make_step`) trace the user's functions under ``jax.set_mesh(mesh)``, and
    so may a user's own code. With no mesh at all, ``constrain`` returns ``x``
    unchanged, so the same model also runs on one device, unjitted.

    ``spec`` names one entry per leading dim of ``x`` as the model sees it:
    inside ``jax.vmap`` the mapped (batch) dim is not named and stays free for
    the data axis. A dim whose size the named axes do not divide (a batch of
    one row, 2 KV heads over 4 shards) is left replicated. The axis
    ``"context"`` (a sequence dim, split by ``make_mesh(...,
    n_context_shards=C)``) is dropped on a mesh without it. An entry
    ``P.UNCONSTRAINED`` leaves that dim to the partitioner: the zoo's logits
    follow their head's layout, split over the vocabulary where the rules
    split the head and whole where they keep it whole (pinned over
    ``model``, a whole head's update and moments were gathered every step).

    **Example** (attention heads split over ``model``, the residual stream
    whole on every ``model`` device):

    ```python
    q = redeqx.constrain(q, P(None, "model", None))   # (seq, heads, head_dim)
    h = redeqx.constrain(h + attn_out, P())            # (seq, hidden)
    ```
    """
    if not isinstance(spec, P):
        raise TypeError(
            f"constrain: spec must be a jax.sharding.PartitionSpec, got {spec!r}; "
            "write e.g. PartitionSpec(None, 'model')."
        )
    if mesh is None:
        context = jax.sharding.get_abstract_mesh()
        if context.empty:
            return x
        sizes, where = dict(context.shape), " in context"
    else:
        if not isinstance(mesh, Mesh):
            raise TypeError(f"constrain: mesh must be a jax.sharding.Mesh (redeqx.make_mesh), got {mesh!r}.")
        sizes, where = dict(mesh.shape), ""

    def pin(a):
        fitted = _fit(spec, tuple(a.shape), sizes, where)
        target = fitted if mesh is None else NamedSharding(mesh, fitted)
        return jax.lax.with_sharding_constraint(a, target)

    return jax.tree.map(pin, x)
