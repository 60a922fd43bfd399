"""`sharding_rules` and `explain`: the public face of the rules."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
from jax.sharding import Mesh, PartitionSpec as P

from ..mesh import DATA, MODEL, check_mesh
from .._trees import human_bytes, is_array_like, path_parts, path_str, per_device_shape
from .._typing import (
    LOSS_CALL, LOSS_EXAMPLE, STATEFUL_CALL, STATEFUL_EXAMPLE, check_signature, fn_name, takes, typechecked,
    warn_user,
)
from ._decide import leaf_specs
from ._program import read_program
from ._specs import Overrides, unplaced_warning


def program_facts(model, loss_fn, batch, model_state=None):
    """The program's facts about ``model``'s leaves, or None without a program;
    an error naming what to pass when only half of it is given, or when
    ``loss_fn`` cannot be called as given (no ``key``; a ``model_state`` it
    needs or cannot take)."""
    if loss_fn is None and batch is None:
        return None
    if loss_fn is None or batch is None:
        given, missing = ("loss_fn", "batch") if batch is None else ("batch", "loss_fn")
        raise ValueError(
            f"sharding_rules got {given}= but not {missing}=: the rules read each weight's role from the "
            f"program loss_fn(model, batch, key), so pass both (the same pair as make_train_step and plan), "
            "or neither (the name rules alone)."
        )
    if not callable(loss_fn):
        raise TypeError(f"loss_fn={loss_fn!r} is not callable; pass loss_fn(model, batch, key) -> loss.")
    _check_call(loss_fn, model_state)
    paths = [path_str(kp) for kp, x in jax.tree_util.tree_flatten_with_path(model)[0] if is_array_like(x)]
    try:
        return read_program(model, loss_fn, batch, paths, model_state)
    except Exception as e:
        raise ProgramError(
            f"sharding_rules traced loss_fn(model, batch, key) on abstract shapes to read each weight's role, "
            f"and it raised: {str(e).rstrip('.')}. Pass the loss_fn and a batch (arrays or jax.ShapeDtypeStruct of the global "
            "batch) exactly as make_train_step receives them."
        ) from e


def _check_call(loss_fn, model_state) -> None:
    """``loss_fn`` takes what the rules will pass: ``(model, batch, key)``, and a ``model_state``
    when one is given; an error naming the fix otherwise, as the steps word it."""
    if model_state is not None:
        return check_signature(loss_fn, "loss_fn", 4, STATEFUL_CALL, STATEFUL_EXAMPLE)
    check_signature(loss_fn, "loss_fn", (3, 4), LOSS_CALL, LOSS_EXAMPLE)
    if takes(loss_fn, 3) is False:  # it takes four: a stateful loss given no state
        raise TypeError(
            f"loss_fn {fn_name(loss_fn)!r} takes a model_state (loss_fn(model, batch, key, model_state), as for "
            "BatchNorm): pass the same state to the rules, model_state=state.model_state (or the state "
            "eqx.nn.make_with_state gave), so its program can be read."
        )


class ProgramError(ValueError):
    """``loss_fn`` could not be traced on the model and batch given to the rules."""


def _warn(fallbacks, unplaced, advice, mesh, name) -> None:
    who = f"(name={name!r})" if name else ""
    loud = [(leaf, why) for leaf, why, is_loud in fallbacks if is_loud]
    if loud:
        by_why: dict[str, list[str]] = {}  # one reason said once for every leaf it holds for
        for leaf, why in loud:
            by_why.setdefault(why, []).append(leaf)
        warn_user(
            f"redeqx.sharding_rules{who}: {len(loud)} leaf/leaves replicated, as n_model_shards="
            f"{mesh.shape[MODEL]} cannot split them as the rules would: "
            + "; ".join(", ".join(leaves) + ": " + why for why, leaves in by_why.items())
            + ". Where a dim or count does not divide, pick n_model_shards that divides it; or pass "
            "overrides=[(regex, spec)]."
        )
    if unplaced and mesh.shape[MODEL] > 1:
        warn_user(unplaced_warning(unplaced, who))
    for text in advice:
        warn_user(f"redeqx.sharding_rules{who}: {text}")


@typechecked
def sharding_rules(model, mesh: Mesh, *, loss_fn: Callable | None = None, batch: Any = None,
                   overrides: Sequence = (), fsdp: bool = False, name: str | None = None, model_state: Any = None):
    """PartitionSpecs for every array in ``model``, from the two rules.

    Returns a tree with ``model``'s structure: a ``PartitionSpec`` at each array
    leaf and ``None`` elsewhere. ``model`` may be abstract (``jax.ShapeDtypeStruct``
    leaves from ``eqx.filter_eval_shape``), so a model too large for one device
    gets its plan before it exists.

    - ``loss_fn`` and ``batch`` (the pair `make_train_step` and `plan` take;
      ``batch`` as arrays or ``jax.ShapeDtypeStruct``s of the global batch):
      each weight's role is read from the program ``loss_fn(model, batch, key)``
      traced on abstract shapes (nothing computed): which dims its matmul
      contracts, which layer contracts its output (a Megatron pair: column
      then row), how its output splits into heads, which axis a ``scan``
      slices. Whatever the weights are named or however they are stored.
      Where a split costs more a step than the weight whole, in bytes moved
      and FLOPs (a small head or table, a depthwise conv, narrow convs over a
      long signal), the weight is kept whole (estimated from the batch's
      activations: give the global batch; `explain` says so); a large weight
      with no partner that costs clearly less split alone (DiT's adaLN
      modulation: a matrix applied to a vector an example) is split on its
      input features, its output summed. Without them, the name rules decide
      (and warn about weights they cannot place).
    - ``overrides`` is a list of ``(regex, spec)``; the first regex found in a
      leaf's path (e.g. ``"blocks.0.attn.wq.weight"``, see `explain`) sets its
      spec, finally (``fsdp`` does not re-split it). A regex that matches no
      path, or only paths an earlier one took, is an error.
    - ``fsdp=True`` also splits each large leaf's largest free dim over
      ``data`` (ZeRO-3 style), so parameter and optimizer memory falls with
      every device.
    - ``name`` (e.g. ``"critic"``) prefixes the paths in warnings and errors.
    - ``model_state``: for a ``loss_fn(model, batch, key, model_state)`` (a
      model with state, such as BatchNorm's), the state its program is read
      with (``state.model_state``, or what ``eqx.nn.make_with_state`` gave).

    Attention is split on whole heads only; leaves whose split dim
    ``n_model_shards`` does not divide are replicated, said in one warning
    (pointing at your line) and in `explain`.

    **Example:**

    ```python
    mesh = redeqx.make_mesh(n_model_shards=2)
    model = eqx.nn.MLP(784, 10, 256, depth=2, key=jax.random.key(0))
    batch = {"x": np.zeros((16, 784), np.float32), "y": np.zeros(16, np.int32)}
    specs = redeqx.sharding_rules(model, mesh, loss_fn=loss_fn, batch=batch)
    print(redeqx.explain(model, specs, mesh, loss_fn=loss_fn, batch=batch))
    ```
    """
    return specs_from(model, check_mesh(mesh), program_facts(model, loss_fn, batch, model_state), overrides, fsdp,
                      name)


def specs_from(model, mesh: Mesh, facts, overrides=(), fsdp: bool = False, name: str | None = None):
    """`sharding_rules` from facts already read (`read`): the planner reads the program once for every mesh."""
    treedef, decided, fallbacks, unplaced, advice = leaf_specs(model, mesh, overrides, fsdp, name, facts)
    _warn(fallbacks, unplaced, advice, mesh, name)
    return jax.tree_util.tree_unflatten(treedef, [p.spec if p is not None else None for p in decided])


@typechecked
def specs_from_overrides(model, mesh: Mesh, overrides: Sequence):
    """A spec tree placed by hand: every array of ``model`` replicated, except
    where an override says otherwise.

    ``overrides`` is a list of ``(regex, spec)`` as `sharding_rules` takes it:
    the first regex found in a leaf's path (as `explain` prints it, e.g.
    ``"blocks.0.attn.wq.weight"``) sets that leaf's spec. Each spec is checked
    against ``mesh`` (its axes exist and divide the leaf), and a regex that
    matches no path, or only paths an earlier one took, is an error. Returns a
    tree of ``model``'s structure, ``None`` at non-array leaves, to pass as
    ``specs`` wherever redeqx takes them: a hand plan to compare the rules
    with, or to train with when you know better.

    **Example:**

    ```python
    mesh = redeqx.make_mesh(n_model_shards=2)
    model = eqx.nn.MLP(784, 10, 256, depth=2, key=jax.random.key(0))
    specs = redeqx.specs_from_overrides(model, mesh, [
        (r"layers\\.0\\.(weight|bias)$", P("model")),   # column parallel
        (r"layers\\.1\\.weight$", P(None, "model")),     # row parallel
    ])                                                  # the rest (layers.1.bias, layers.2) replicated
    state = redeqx.init_state(model, optax.adamw(1e-3), mesh, specs, key=jax.random.key(1))
    ```
    """
    mesh = check_mesh(mesh)
    found = Overrides(overrides, mesh, "")
    flat, treedef = jax.tree_util.tree_flatten_with_path(model)
    specs, paths = [], []
    for kp, leaf in flat:
        if not is_array_like(leaf):
            specs.append(None)
            continue
        paths.append(path_str(kp))
        hit = found.find(paths[-1], leaf)
        specs.append(P() if hit is None else hit[0])
    found.check_all_used(paths, None)
    return jax.tree_util.tree_unflatten(treedef, specs)


@typechecked
def explain(model, specs, mesh: Mesh, *, loss_fn: Callable | None = None, batch: Any = None,
            overrides: Sequence = (), fsdp: bool | None = None, reasons: Literal["short", "full"] = "short",
            model_state: Any = None) -> str:
    """A table of where each array of ``model`` lives under ``specs``.

    One short row per array: path, shape, dtype, spec, bytes per device, and
    why in a few words ("column parallel, dim 0", "replicated: dim 0 (10) does
    not split 4 ways", "override 'wo'"): what the program showed when
    ``loss_fn`` and ``batch`` (and ``model_state``) are given as to `sharding_rules`, the name rule
    otherwise, the override or ``fsdp``; ``given`` where ``specs`` differ from
    anything the rules would say (e.g. a hand plan). Totals at the bottom.

    ``reasons="full"`` gives each reason whole: the weights a layer feeds or
    contracts, its heads' reshape, what the names alone would have said, the
    rules' spec beside an override.

    **Example:**

    ```python
    specs = redeqx.sharding_rules(model, mesh, loss_fn=loss_fn, batch=batch)
    print(redeqx.explain(model, specs, mesh, loss_fn=loss_fn, batch=batch))
    print(redeqx.explain(model, specs, mesh, loss_fn=loss_fn, batch=batch, reasons="full"))
    ```
    """
    mesh = check_mesh(mesh)
    full = reasons == "full"
    facts = program_facts(model, loss_fn, batch, model_state)
    candidates = [leaf_specs(model, mesh, overrides, f, None, facts)[1]
                  for f in ((False, True) if fsdp is None else (fsdp,))]
    by_path = [{p.path: p for p in decided if p is not None} for decided in candidates]
    m_leaves = jax.tree_util.tree_flatten_with_path(model, is_leaf=lambda x: x is None)[0]
    s_leaves = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P) or x is None)
    if len(m_leaves) != len(s_leaves):
        raise ValueError(
            f"specs has {len(s_leaves)} leaves but model has {len(m_leaves)}; "
            "pass the specs made by redeqx.sharding_rules(model, mesh) for this model."
        )
    rows = [("path", "shape", "dtype", "spec", "per device", "why")]
    total = per_dev = n_arrays = 0
    for (kp, leaf), spec in zip(m_leaves, s_leaves):
        if not is_array_like(leaf):
            continue
        path = ".".join(path_parts(kp))
        spec = P() if spec is None else spec
        found = [d[path] for d in by_path if path in d]
        why = next((p.reason if full else p.short for p in found if _same(p.spec, spec)), None)
        if why is None:
            why = "given" if not found else (f"given (rules: {found[0].spec}, {found[0].reason})" if full
                                             else f"given (rules: {found[0].spec})")
        itemsize = leaf.dtype.itemsize  # (a PRNG key's dtype has one too; NumPy cannot read it)
        dev = math.prod(per_device_shape(leaf.shape, spec, mesh)) * itemsize
        total += math.prod(leaf.shape) * itemsize
        per_dev += dev
        n_arrays += 1
        rows.append((path, str(tuple(leaf.shape)), str(leaf.dtype), str(spec), human_bytes(dev), why))
    return _table(rows, total, per_dev, n_arrays, mesh)


def _same(a: P, b: P) -> bool:
    """One layout, however written: ``P('model')`` is ``P('model', None)``."""
    def trimmed(spec):
        entries = list(spec)
        while entries and entries[-1] is None:
            entries.pop()
        return tuple(entries)
    return trimmed(a) == trimmed(b)


def _table(rows, total, per_dev, n_arrays, mesh) -> str:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    n_data = mesh.shape[DATA]
    lines.append("")
    lines.append(
        f"total {human_bytes(total)} in {n_arrays} arrays; per device {human_bytes(per_dev)} "
        f"(mesh {', '.join(f'{k}={v}' for k, v in mesh.shape.items())}); a step's global batch is "
        f"per_device_batch_size x {n_data} (data) rows"
    )
    return "\n".join(lines)
