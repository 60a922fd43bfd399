"""The program reader's state: a `View` of weights, and the `Reader` that walks a jaxpr.

Each variable holds a `View` (it is made of weights), a dict ``{seed: dim}``
of the splits it carries, and whether it depends on no input (``static``:
iota and constants, e.g. positions); a value reshaped from a split dim into
``(groups, per group)`` also says which of its dims are the per-group factors
(``within``: heads' features, or a GroupNorm's channels per group), and which values are
``derived`` from weights alone without being one (a weight's norm: weight normalisation, a
standardised conv kernel). The handlers in `_ops` and `_loops` move these from an equation's
inputs to its outputs; `_program` lists them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jax.extend import core as jcore

from ._facts import Facts


@dataclasses.dataclass(frozen=True)
class View:
    """A value made of weights: ``parts[k] = (leaf, dims)``, ``dims[d]`` the
    leaf dim behind the value's dim ``d`` (None: not one dim of that leaf)."""

    parts: tuple[tuple[int, tuple[int | None, ...]], ...]
    # normalised by statistics of weights (``g * v / |v|``, ``(w - mean w) / std w``, a LayerNorm
    # of learned latents): a weight where an activation contracts it, an activation where another
    # weight does (a Perceiver's normed latents times its query projection)
    normalized: bool = False

    def mapped(self, fn) -> View:
        return View(tuple((leaf, fn(dims)) for leaf, dims in self.parts), self.normalized)


class Reader:
    """Walks a jaxpr with, for each variable, a `View`, a dict ``{seed: dim}``
    of the splits it carries, and whether it depends on no input (``static``:
    iota, literals and closed-over constants, e.g. positions)."""

    def __init__(self, facts: Facts, handlers: dict):
        self.facts, self.handlers = facts, handlers
        self.views: dict[Any, View] = {}
        self.tags: dict[Any, dict[int, int]] = {}
        self.static: set = set()
        self.within: dict[Any, dict[int, frozenset[int]]] = {}  # var -> {seed: dims made of its split dim's inner factors}
        self.learned: set = set()  # values that depend on the model's weights (not on data alone)
        self.derived: set = set()  # values computed from weights and constants alone that are no view of one
        self.one_hot: set = set()  # floats converted from booleans made of data alone (`one_hot(ids)`)
        # a matrix updated, sampled or masked by an activation of its own shape inside the loss (MAML's
        # `W - lr * dW`, `mu + softplus(rho) * eps`): that matrix where a product meets it with an activation
        self.perturbed: dict[Any, View] = {}
        self.positions: dict[Any, tuple] = {}  # indices into a split dim (`_topk`): (seeds, dim, shape)
        self.trips = 1  # how many times the body being read runs in one step (scans' lengths multiplied)
        self.manual = 0  # how many bodies deep the reader is that lay out their own operands (shard_map)

    # -- values ---------------------------------------------------------------
    def view(self, v):
        return None if isinstance(v, jcore.Literal) else self.views.get(v)

    def updated(self, v) -> View | None:
        """The weight ``v`` is an update of (`perturbed`), or None."""
        return None if isinstance(v, jcore.Literal) else self.perturbed.get(v)

    def position(self, v) -> tuple | None:
        """The split dim ``v`` indexes into (`positions`: seeds, dim, shape), or None."""
        return None if isinstance(v, jcore.Literal) else self.positions.get(v)

    def moved_update(self, out, src, fn=lambda dims: dims) -> None:
        """``out`` is the weight update ``src`` is (`perturbed`), its dims moved by ``fn`` (a
        transpose, a scan's slice), or none (a body read before)."""
        if (update := self.updated(src)) is None:
            self.perturbed.pop(out, None)
        else:
            self.perturbed[out] = update.mapped(fn)

    def whole_matrices(self, vw: View) -> bool:
        """Whether ``vw`` is every dim of weights of 2+ dims longer than 1 (maybe broadcast over more
        dims): not a conv's bias, ``(channels, 1, 1)``."""
        wide = [{d for d, size in enumerate(self.facts.shapes[leaf]) if size > 1} for leaf, _ in vw.parts]
        return all(len(w) > 1 and w <= set(dims) for w, (_, dims) in zip(wide, vw.parts))

    def tag(self, v) -> dict[int, int]:
        return {} if isinstance(v, jcore.Literal) else self.tags.get(v, {})

    def inner(self, v) -> dict[int, frozenset[int]]:
        return {} if isinstance(v, jcore.Literal) else self.within.get(v, {})

    def is_static(self, v) -> bool:
        return isinstance(v, jcore.Literal) or v in self.static

    def is_derived(self, v) -> bool:
        """Whether ``v`` is computed from weights (and constants) alone without being a view of one:
        ``jnp.linalg.norm(w, axis=1, keepdims=True)`` scaling ``w`` (weight normalisation) is no
        activation, and ``w / norm`` is still the weight."""
        return not isinstance(v, jcore.Literal) and v in self.derived

    def is_learned(self, v) -> bool:
        """Whether ``v`` depends on the model's weights: the gradient of a value made from data
        alone (a first layer's input) is never computed, so a split never sums it."""
        return not isinstance(v, jcore.Literal) and (v in self.learned or v in self.views)

    def set_tags(self, var, tags: dict[int, int], where: str) -> None:
        if tags:
            self.tags[var] = self.facts.checked(tags, where)

    def block_all(self, eqn, why: str) -> None:
        for v in eqn.invars:
            for seed in self.tag(v):
                self.facts.block(seed, why)

    # -- walking --------------------------------------------------------------
    def run(self, jaxpr, views, tags, static) -> tuple[list, list, list]:
        # the constants a program closes over (a NumPy index table, as Swin's relative positions)
        # depend on no input, as a literal or an iota does
        self.static.update(jaxpr.constvars)
        self.bind(jaxpr.invars, views, tags, static)
        for eqn in _live(jaxpr):
            self.step(eqn)
        return self.inputs(jaxpr.outvars)

    def step(self, eqn) -> None:
        name = eqn.primitive.name
        if eqn.invars and all(self.is_static(v) for v in eqn.invars) or name == "iota":
            self.static.update(eqn.outvars)
        learned = [self.is_learned(v) for v in eqn.invars]
        if any(learned):
            self._learn_inside(eqn, learned)
        self._derive_inside(eqn)
        if name == "convert_element_type" and eqn.invars[0].aval.dtype == bool and not any(learned):
            self.one_hot.update(eqn.outvars)
        handler = self.handlers.get(name)
        if handler is None:
            handler = self.handlers["<call>"] if _sub_jaxprs(eqn) else self.handlers["<unknown>"]
        handler(self, eqn)
        if any(learned):
            self.learned.update(eqn.outvars)
        weighty = [self.view(v) is not None or self.is_derived(v) for v in eqn.invars]
        if any(weighty) and all(w or self.is_static(v) for w, v in zip(weighty, eqn.invars)):
            self.derived.update(v for v in eqn.outvars if v not in self.views and v not in self.static
                                and not self.tag(v))  # (a weight's product with a constant grid is a use)

    def _derive_inside(self, eqn) -> None:
        """Marks a body's inputs that are derived from weights (a call's arguments, a cond's
        operands, a scan's constants; never a loop's carry, which each iteration replaces)."""
        if not any(self.is_derived(v) for v in eqn.invars) or eqn.primitive.name == "while":
            return
        n_outer = _scan_counts(eqn.params)[0] if eqn.primitive.name == "scan" else len(eqn.invars)
        for j, var in _body_inputs(eqn):
            if j is not None and j < n_outer and self.is_derived(eqn.invars[j]):
                self.derived.add(var)

    def _learn_inside(self, eqn, learned: list[bool]) -> None:
        """Marks the inputs of ``eqn``'s bodies that depend on weights: a loop's carry, and a while's
        inputs, depend on weights once any input does."""
        carry = range(0)
        if eqn.primitive.name == "scan":
            nc, ncarry = _scan_counts(eqn.params)
            carry = range(nc, nc + ncarry)
        for j, var in _body_inputs(eqn):
            if eqn.primitive.name == "while" or j is None or learned[j] or j in carry:
                self.learned.add(var)

    def inputs(self, vars_):
        return [self.view(v) for v in vars_], [self.tag(v) for v in vars_], [self.is_static(v) for v in vars_]

    def bind(self, outvars, views, tags, static) -> None:
        for var, vw, tg, st in zip(outvars, views, tags, static):
            if vw is not None:
                self.views[var] = vw
            if tg:
                self.tags[var] = tg
            if st:
                self.static.add(var)


def _live(jaxpr) -> list:
    """``jaxpr``'s equations that its outputs depend on (or with effects). ``jax.grad`` inside a
    loss leaves the value it differentiates in the program, unused: a test-time-training layer's
    inner loss, ``sum((W @ k - v) ** 2)``, read as a reduction of ``k``'s features, kept the key
    projection whole."""
    used = {v for v in jaxpr.outvars if not isinstance(v, jcore.Literal)}
    live = []
    for eqn in reversed(jaxpr.eqns):
        if eqn.effects or any(v in used for v in eqn.outvars):
            live.append(eqn)
            used.update(v for v in eqn.invars if not isinstance(v, jcore.Literal))
    return live[::-1]


def _body_inputs(eqn):
    """``(j, var)`` for each input ``var`` of ``eqn``'s bodies, ``j`` the equation's input it binds:
    a body's inputs are its equation's last ones (a call's arguments, a cond's operands, a scan's
    consts, carry and xs); None where the body has more inputs than the equation."""
    for body in _sub_jaxprs(eqn):
        invars = _open(body).invars
        skip = len(eqn.invars) - len(invars)
        for i, var in enumerate(invars):
            yield (i + skip if skip >= 0 else None), var


def _sub_jaxprs(eqn) -> list:
    found = []
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, (jcore.ClosedJaxpr, jcore.Jaxpr)):
                found.append(item)
    return found


def _scan_counts(params) -> tuple[int, int]:
    """How many of a scan's inputs are constants and how many its carry. JAX up to 0.10 names
    them (``num_consts``, ``num_carry``); 0.11 packs the inputs into ``ft_in``, a flat tree of
    (consts, carry, xs)."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def _open(j):
    return j.jaxpr if isinstance(j, jcore.ClosedJaxpr) else j


def _shape(v) -> tuple[int, ...]:
    return tuple(getattr(v.aval, "shape", ()))


def nbytes(v) -> int:
    """The bytes of the value ``v`` (0 for a token or other non-array)."""
    dtype = getattr(v.aval, "dtype", None)
    return 0 if dtype is None else math.prod(_shape(v)) * getattr(dtype, "itemsize", 4)
