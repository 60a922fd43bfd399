"""What a split costs on one mesh, in bytes a step (`Pricing`): a proven split weighed against its
weights whole (`price`), for the blocks and heads where that can go either way (`priced`)."""

from __future__ import annotations

import dataclasses
import math
import re

from ._facts import Facts


@dataclasses.dataclass
class Pricing:
    """What a split costs on one mesh (`priced`): ``n_batch`` devices split the batch (each holds
    ``1 / n_batch`` of the program's activations, and gradients are summed over them); ``budget``:
    the bytes of a device's memory that weights kept whole because they move fewer bytes so may
    take (their parameters, gradients and two optimizer moments), less what is ``spent``."""

    n_batch: int
    budget: float
    spent: float = 0.0
    taken: list = dataclasses.field(default_factory=list)  # (leaves, split, whole) of each choice made whole

    def gradient(self, facts: Facts, leaves) -> float:
        """The bytes of ``leaves``' gradients summed over the batch's devices each step (none on one)."""
        return float(sum(facts.nbytes(k) for k in leaves)) if self.n_batch > 1 else 0.0

    def affords(self, facts: Facts, leaves, n: int) -> bool:
        """Whether holding ``leaves`` whole (instead of ``1 / n`` of them) fits what is left of the
        budget; if so it is spent."""
        extra = 4 * sum(facts.nbytes(k) for k in leaves) * (1 - 1 / n)
        if self.spent + extra > self.budget:
            return False
        self.spent += extra
        return True


def _kind_of(facts: Facts, leaves) -> tuple:
    """Leaves of the same kind of block (paths equal but for layer numbers, same shapes): one decision."""
    return tuple(sorted((re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", facts.paths[k]), facts.shapes[k]) for k in leaves))


def price(pricing: Pricing, facts: Facts, n: int,
           candidates: list[tuple[tuple, float, float]]) -> dict[int, tuple[float, float]]:
    """``candidates``: ``(leaves, split, whole)``, the bytes a step moves with ``leaves`` split as
    proven and whole. Blocks of one kind are decided together; those whole moves fewer bytes for are
    kept whole, most saved first, while the memory budget lasts. Returns each such leaf's kind's
    ``(split, whole)``."""
    kinds: dict[tuple, list] = {}
    for leaves, split, whole in candidates:
        entry = kinds.setdefault(_kind_of(facts, leaves), [[], 0.0, 0.0])
        entry[0] += list(leaves)
        entry[1] += split
        entry[2] += whole
    out: dict[int, tuple[float, float]] = {}
    for leaves, split, whole in sorted(kinds.values(), key=lambda e: e[2] - e[1]):
        if whole < split and pricing.affords(facts, leaves, n):
            pricing.taken.append((tuple(leaves), split, whole))
            out.update((k, (split, whole)) for k in leaves)
    return out


def priced(facts: Facts, fit, pricing: Pricing) -> bool:
    """Whether a proven split is weighed against its weights whole: a vocabulary-parallel head where
    the batch is split (its gradient, summed over the batch's devices, is what whole saves), or a
    block whose column layers are all convolutions with a kernel wider than 1 (a feature encoder
    over a long signal, where activations outweigh weights, its last conv paired with the linear
    projection after its norm; a 1 x 1 conv is a linear layer; a Mamba mixer's depthwise conv
    beside its linear ``dt_proj`` is not such a block).
    A block of linear layers is always split: its products are most of the model's work, which the
    split divides (bytes alone would keep a small model's blocks whole, every device doing all of it).
    So is a head on a mesh of ``model`` alone: whole, it would save no gradient's sum, only the
    split's small sums of the loss's statistics, while every device repeats the head's whole product
    (and a model that pins its logits over ``model``, as the zoo did, computes them split anyway,
    then gathers the head's update, weights and moments: the 116 M LLaMA of `benchmarks.collectives`
    at 8 x 1 moved 375 MiB a step more)."""
    if fit.kept.kind == "head":
        return pricing.n_batch > 1
    columns = {k for k, (_, t) in fit.kept.members.items() if t == "column"}
    return all(u.kind == "conv" and math.prod(facts.shapes[k][d] for d in u.contracted) > _in_features(facts, u)
               for u in facts.uses if (k := u.leaf) in columns)


def _in_features(facts: Facts, use) -> int:
    """A conv's input features alone (its first contracted dim): more contracted than that is a
    kernel with extent, not a 1 x 1 conv (a linear layer by another name)."""
    return facts.shapes[use.leaf][use.contracted[0]] if use.contracted else 1


def block_costs(facts: Facts, fit, n: int, pricing: Pricing) -> tuple[float, float]:
    """The bytes one device moves a step for ``fit``'s block split as proven, and whole. Split: each
    column layer's input gradient summed over 'model' (backward; one activation read by several
    layers once), each row layer's output summed (forward); the gradients, ``1 / n`` of them."""
    members = fit.kept.members
    cols = {k for k, (_, t) in members.items() if t == "column"}
    rows = {k for k, (_, t) in members.items() if t == "row"}
    acts = facts.inputs_read(cols) + sum(facts.activation_bytes(k)[1] for k in rows)
    grad = pricing.gradient(facts, members)
    return acts / pricing.n_batch + grad / n, grad
