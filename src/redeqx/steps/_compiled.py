"""One ``jax.jit`` per structure of a step's first argument, with its array
leaves placed where the step says before the call: `CompiledStep` (its
batches placed by `redeqx.data.place_batch`).

A step's first argument (a state, or a model) is split into its array
leaves, the dynamic inputs, and everything else (activation functions,
Python numbers), compile-time constants of that structure. ``placement``
says where each array leaf must live; a committed leaf placed elsewhere is
moved there (with a warning), a deleted one is refused. A step that returns
a state returns it with the input's structure and shardings, donated when
asked, so a loop of steps never re-lays anything out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .. import _startup
from ._cpu import wait_for_program
from ._loss import fn_name
from ..context import check_split_program, mesh_context, split_lengths, splitting
from ..data import place_batch
from ..mesh import check_leaf, mesh_text, place, refuse_deleted, same_devices
from .._trees import CONCRETE_ARRAYS, named_leaves
from .._typing import short_repr, warn_user

Placement = Callable[[Any, list[str], list], list[NamedSharding]]


def stay_in_place(mesh: Mesh) -> Placement:
    """`make_step`'s placement: a leaf stays where it is on ``mesh``; a leaf
    not yet on a mesh (NumPy, a fresh single-device array) is replicated; a
    leaf on another mesh is an error, since nothing says how to lay it out."""

    def placement(tree, paths, leaves):
        return [where_it_is(path, x, mesh) for path, x in zip(paths, leaves)]

    return placement


def where_it_is(path: str, x, mesh: Mesh) -> NamedSharding:
    sh = getattr(x, "sharding", None)
    if not isinstance(sh, NamedSharding):
        return NamedSharding(mesh, P())
    if sh.mesh == mesh:
        return sh
    if sh.mesh.axis_names == mesh.axis_names and same_devices(sh.mesh, mesh):
        return NamedSharding(mesh, sh.spec)  # the same devices and axes (e.g. Explicit vs Auto types)
    raise ValueError(
        f"state leaf '{path}' lives on the mesh {mesh_text(sh.mesh)}, but this step was made for the mesh "
        f"{mesh_text(mesh)}. Lay the state out on this mesh first (redeqx.shard(tree, specs, mesh)), or make "
        "the step with the mesh the state lives on."
    )


def _sharding_text(x) -> str:
    sh = getattr(x, "sharding", None)
    if isinstance(sh, NamedSharding):
        return f"{sh.spec} on {mesh_text(sh.mesh)}"
    return type(sh).__name__ if sh is not None else type(x).__name__


def _same_constant(a, b) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:
        return False


class CompiledStep:
    """``fn(tree, *args)`` compiled once per structure of ``tree``.

    - ``placement(tree, paths, leaves)`` gives each array leaf's sharding;
      ``what`` names ``tree`` in messages ("state", "model").
    - ``returns_state=True``: ``fn`` returns ``(new_tree, out)``, ``new_tree``
      of ``tree``'s structure, its leaves leaving with the input shardings
      (the input donated when ``donate``).
    - ``batch_args``: positions in ``args`` of batches, placed by `place_batch`.
    """

    def __init__(self, fn, mesh: Mesh, *, placement: Placement, what: str, donate: bool = False,
                 returns_state: bool = False, batch_args: tuple[int, ...] = (), warn_moves: bool = True):
        self.fn, self.mesh, self.placement, self.what = fn, mesh, placement, what
        self.donate, self.returns_state, self.batch_args, self.warn_moves = donate, returns_state, batch_args, warn_moves
        self._by_structure: dict[Any, tuple] = {}  # (treedef, mask, constants) -> (jitted, shardings, paths)
        self._by_layout: dict[Any, tuple] = {}  # the same, plus the leaves' current shardings
        self._last_batch: dict[str, tuple] | None = None  # the batch shapes of the last call that ran
        self._split_read = False  # the program read once for what a split sequence must not meet

    def _jit(self, treedef, constants, mask, shardings, paths):
        fn, what, returns_state = self.fn, self.what, self.returns_state

        def rebuild(arrays):
            it = iter(arrays)
            return jax.tree.unflatten(treedef, [next(it) if m else c for m, c in zip(mask, constants)])

        def inner(arrays, args):
            result = fn(rebuild(arrays), *args)
            if not returns_state:
                return result
            if not (isinstance(result, tuple) and len(result) == 2):
                raise TypeError(f"step_fn {fn_name(fn)!r} must return (new_state, outputs), got {type(result).__name__}.")
            new_tree, out = result
            new_leaves, new_def = jax.tree.flatten(new_tree)
            if new_def != treedef:
                raise ValueError(
                    f"step_fn {fn_name(fn)!r} returned a {what} whose structure differs from its input:\n"
                    f"  in:  {treedef}\n  out: {new_def}\n"
                    f"A step must return a {what} of the same structure (same fields, same array leaves)."
                )
            for path, x, m, old in zip(paths, new_leaves, mask, constants):
                if not m and (isinstance(x, (jax.Array, np.ndarray)) or not _same_constant(x, old)):
                    raise TypeError(
                        f"step_fn {fn_name(fn)!r} changed the {what} leaf '{path}' from {short_repr(old)} to "
                        f"{short_repr(x)}, but that leaf is not an array, so it is a compile-time constant and "
                        f"the change would be lost. Make it an array in the {what} you pass in (e.g. "
                        "jnp.asarray(0) instead of 0)."
                    )
            return [x for x, m in zip(new_leaves, mask) if m], out

        if returns_state:
            return jax.jit(inner, out_shardings=(list(shardings), None), donate_argnums=(0,) if self.donate else ())
        return jax.jit(inner)

    def _lookup(self, tree, abstract: bool):
        """``(jitted, arrays, current, shardings, dyn_paths, treedef, mask,
        constants)`` for ``tree``. Leaf paths are spelled out only when a
        layout is seen for the first time: this runs on every step call."""
        leaves, treedef = jax.tree.flatten(tree)
        dynamic = CONCRETE_ARRAYS + ((jax.ShapeDtypeStruct,) if abstract else ())
        mask = tuple(isinstance(x, dynamic) for x in leaves)
        arrays = [x for x, m in zip(leaves, mask) if m]
        constants = tuple(None if m else x for x, m in zip(leaves, mask))
        current = tuple(x.sharding if isinstance(x, jax.Array) else None for x in arrays)
        try:
            key = (treedef, mask, constants, current)
            hit = self._by_layout.get(key)
        except TypeError:  # an unhashable constant: look up by identity instead
            key = (treedef, mask, tuple(map(id, constants)), current)
            hit = self._by_layout.get(key)
        if hit is None:
            paths = tuple(path for path, _ in named_leaves(tree))
            for path, x, m in zip(paths, leaves, mask):
                if not m:
                    check_leaf(path, x, self.what)
            hit = self._by_structure.get(key[:3])
            if hit is None:
                dyn_paths = [p for p, m in zip(paths, mask) if m]
                shardings = tuple(self.placement(tree, dyn_paths, arrays))
                hit = (self._jit(treedef, constants, mask, shardings, paths), shardings, dyn_paths)
                self._by_structure[key[:3]] = hit
            self._by_layout[key] = hit
        jitted, shardings, dyn_paths = hit
        return jitted, arrays, current, shardings, dyn_paths, treedef, mask, constants

    def _placed(self, arrays, current, shardings, paths) -> list:
        """``arrays`` where ``shardings`` say, moved (never sharing the caller's
        memory when donated) with a warning naming the moved leaves."""
        refuse_deleted(arrays, self.what, paths)
        moved, out, seen = [], [], set()
        for x, cur, s, path in zip(arrays, current, shardings, paths):
            if cur is not s and cur != s:
                if isinstance(x, jax.Array) and getattr(x, "committed", True) and isinstance(cur, NamedSharding):
                    moved.append(f"{path}: {_sharding_text(x)} -> {s.spec}")
                x = place(x, s, copy=self.donate)
            elif self.donate and id(x) in seen:  # one array at two places (a target network made of the
                x = place(x, s, copy=True)       # online one's arrays): XLA:CPU segfaults donating it twice
            seen.add(id(x))
            out.append(x)
        if moved and self.warn_moves:
            warn_user(
                f"redeqx: {len(moved)} {self.what} leaves were not laid out as this step's specs say and were moved "
                f"(each call that passes them so pays for the move): " + "; ".join(moved[:8])
                + (" ..." if len(moved) > 8 else "") + ". Use the state this step returns, or place the "
                f"{self.what} with redeqx.shard(tree, specs, mesh) / redeqx.init_state."
            )
        return out

    def _args(self, args):
        for i, arg in enumerate(args):
            refuse_deleted(arg, f"step's argument {i + 2}")
        if not self.batch_args:
            if jax.process_count() > 1:
                _refuse_local_arrays(args)
            return args
        return tuple(place_batch(a, self.mesh) if i in self.batch_args else a for i, a in enumerate(args))

    def _batch_shapes(self, args) -> dict[str, tuple]:
        return {f"batch{jax.tree_util.keystr(kp)}": tuple(x.shape) for i in self.batch_args if i < len(args)
                for kp, x in jax.tree_util.tree_flatten_with_path(args[i])[0] if hasattr(x, "shape")}

    def _split(self, args) -> tuple[int, ...]:
        """The lengths of the batch's sequences split over ``context`` (none without such a split)."""
        if not self.batch_args or mesh_context(self.mesh) == 1:
            return ()
        return split_lengths([a for i, a in enumerate(args) if i in self.batch_args])

    def _traced(self, jitted, arrays, args, lengths: tuple[int, ...]):
        """``jitted.trace``, under the mesh (and the split's lengths, for `redeqx.attention`'s errors); on
        the first trace over split sequences its program is read (`check_split_program`)."""
        with jax.set_mesh(self.mesh), splitting(lengths):
            traced = jitted.trace(arrays, args)
        if lengths and not self._split_read:
            self._split_read = True
            check_split_program(traced.jaxpr.jaxpr, lengths, mesh_context(self.mesh))
        return traced

    def __call__(self, tree, *args):
        jitted, arrays, current, shardings, paths, treedef, mask, constants = self._lookup(tree, abstract=False)
        arrays = self._placed(arrays, current, shardings, paths)
        shapes = self._batch_shapes(args) if self.batch_args else None
        if _startup.pending():
            _startup.doing(f"compiling and running its first step ({fn_name(self.fn)})")
        try:
            with jax.set_mesh(self.mesh):  # so redeqx.constrain inside user code sees the mesh
                args = self._args(args)
                lengths = self._split(args)
                if lengths and not self._split_read:
                    self._traced(jitted, arrays, args, lengths)  # the call below finds this trace in jit's cache
                with splitting(lengths):
                    result = wait_for_program(jitted(arrays, args))
        except Exception as e:
            _note_changed_batch(e, self._last_batch, shapes)
            raise
        _startup.stepped()
        self._last_batch = shapes
        if not self.returns_state:
            return result
        new_arrays, out = result
        it = iter(new_arrays)
        return jax.tree.unflatten(treedef, [next(it) if m else c for m, c in zip(mask, constants)]), out

    def lower(self, tree, *args):
        """``jax.jit(...).lower`` for these arguments, which may be abstract
        (``jax.ShapeDtypeStruct`` leaves, e.g. from ``eqx.filter_eval_shape``):
        nothing is allocated or run."""
        traced = self.trace(tree, *args)
        with jax.set_mesh(self.mesh):
            return traced.lower()

    def trace(self, tree, *args):
        """``jax.jit(...).trace`` for these arguments (as `lower`): its
        ``.jaxpr`` is the step's program before lowering, its ``.lower()`` `lower`'s."""
        jitted, arrays, _, shardings, *_ = self._lookup(tree, abstract=True)
        arrays = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) if isinstance(x, jax.ShapeDtypeStruct) else x
                  for x, s in zip(arrays, shardings)]
        args = self._args(args)
        return self._traced(jitted, arrays, args, self._split(args))


def _note_changed_batch(error: Exception, before: dict[str, tuple] | None, now: dict[str, tuple] | None) -> None:
    """A step that ran fails on a batch of other shapes: the error comes
    from deep in the model (``dot_general ... (8,) and (7,)``); add a note
    naming the batch keys whose shapes changed, and how."""
    if not before or now is None or not hasattr(error, "add_note"):
        return
    changed = [f"{k} {before.get(k)} -> {now.get(k)}" for k in sorted(set(before) | set(now))
               if before.get(k) != now.get(k)]
    if not changed:
        return
    error.add_note(
        "redeqx: the batch of this call differs from the previous call's, which ran: " + "; ".join(changed[:8])
        + (" ..." if len(changed) > 8 else "") + ". A collate_fn whose arrays change a feature size from one batch "
        "to the next (an example of another width, a missing column) fails inside the model like this: make every "
        "batch the same shape past the batch dim (pad or check the examples)."
    )


class StepFunction:
    """What a ``make_*_step`` returns: call it to run the step, ``lower`` it
    to compile for (possibly abstract) arguments. A ``first_call_check``
    (`redeqx.steps._shard_mean.FirstCallCheck`) runs on the first call's
    arguments, before the step."""

    def __init__(self, compiled: CompiledStep, first_call_check: Callable[..., None] | None = None):
        self._compiled = compiled
        self._first_call_check = first_call_check
        self.mesh = compiled.mesh

    def __call__(self, *args):
        if self._first_call_check is not None:
            self._first_call_check(*args)
            self._first_call_check = None
        return self._compiled(*args)

    def lower(self, *args):
        """``jax.jit(...).lower`` of this step for these arguments; leaves may
        be ``jax.ShapeDtypeStruct``\\ s (nothing is allocated)."""
        return self._compiled.lower(*args)

    def trace(self, *args):
        """``jax.jit(...).trace`` of this step for these arguments (as `lower`)."""
        return self._compiled.trace(*args)


def _refuse_local_arrays(args) -> None:
    """With several processes a NumPy argument would be taken as the same
    global value everywhere; if processes hold different rows they would
    silently compute different things."""
    for kp, x in jax.tree_util.tree_flatten_with_path(args)[0]:
        if isinstance(x, np.ndarray) and x.ndim:
            raise ValueError(
                f"argument{jax.tree_util.keystr(kp)} is a NumPy array, but this run has {jax.process_count()} "
                "processes, and a step's arguments must be global arrays: each process's own rows with "
                "jax.make_array_from_process_local_data(NamedSharding(mesh, P('data')), x) (what redeqx.batches "
                "does), or a value every process holds alike with jax.device_put(x, NamedSharding(mesh, P()))."
            )
