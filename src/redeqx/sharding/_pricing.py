"""What a split costs on one mesh, in bytes a step, FLOPs counted at `FLOPS_PER_BYTE` (`Pricing`):
a proven split weighed against its weights whole (`price`), for the blocks and heads where that can
go either way (`priced`); which of several splits that compete for one weight costs least (`Cost`)."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import NamedTuple

from ._facts import Facts


@dataclasses.dataclass
class Pricing:
    """What a split costs on one mesh (`priced`): ``n_batch`` devices split the batch (each holds
    ``1 / n_batch`` of the program's activations, and gradients are summed over them); ``budget``:
    the bytes of a device's memory that weights kept whole because they cost less so may
    take (their parameters, gradients and two optimizer moments, and the activations a block kept
    whole holds: `held_whole`), less what is ``spent``."""

    n_batch: int
    budget: float
    spent: float = 0.0
    taken: list = dataclasses.field(default_factory=list)  # (leaves, split, whole) of each choice made whole

    def gradient(self, facts: Facts, leaves) -> float:
        """The bytes of ``leaves``' gradients summed over the batch's devices each step (none on one)."""
        return float(sum(facts.nbytes(k) for k in leaves)) if self.n_batch > 1 else 0.0

    def affords(self, facts: Facts, leaves, n: int, held: float = 0.0) -> bool:
        """Whether holding ``leaves`` whole (instead of ``1 / n`` of them), and ``held`` bytes more of
        activations (`held_whole`), fits what is left of the budget; if so it is spent."""
        extra = 4 * sum(facts.nbytes(k) for k in leaves) * (1 - 1 / n) + held
        if self.spent + extra > self.budget:
            return False
        self.spent += extra
        return True


def _kind_of(facts: Facts, leaves) -> tuple:
    """Leaves of the same kind of block (paths equal but for layer numbers, same shapes): one decision."""
    return tuple(sorted((re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", facts.paths[k]), facts.shapes[k]) for k in leaves))


def price(pricing: Pricing, facts: Facts, n: int,
           candidates: list[tuple[tuple, float, float, float]]) -> dict[int, tuple[float, float]]:
    """``candidates``: ``(leaves, split, whole, held)``, what a step costs with ``leaves`` split as
    proven and whole, and the bytes of activations whole holds beyond split (`held_whole`). Blocks
    of one kind are decided together; those that cost less whole are kept whole, most saved first,
    while the memory budget lasts. Returns each such leaf's kind's ``(split, whole)``."""
    kinds: dict[tuple, list] = {}
    for leaves, *costs in candidates:
        entry = kinds.setdefault(_kind_of(facts, leaves), [[], 0.0, 0.0, 0.0])
        entry[0] += list(leaves)
        entry[1:] = [a + b for a, b in zip(entry[1:], costs)]
    out: dict[int, tuple[float, float]] = {}
    for leaves, split, whole, held in sorted(kinds.values(), key=lambda e: e[2] - e[1]):
        if whole < split and pricing.affords(facts, leaves, n, held):
            pricing.taken.append((tuple(leaves), split, whole))
            out.update((k, (split, whole)) for k in leaves)
    return out


def priced(facts: Facts, fit, pricing: Pricing) -> bool:
    """Whether a proven split is weighed against its weights whole: a vocabulary-parallel head where
    the batch is split (its gradient, summed over the batch's devices, is what whole saves), or a
    block whose column layers are all convolutions with a kernel wider than 1 (a narrow feature
    encoder over a long signal, where activations outweigh weights and FLOPs, its last conv paired
    with the linear projection after its norm; a 1 x 1 conv is a linear layer; a Mamba mixer's
    depthwise conv beside its linear ``dt_proj`` is not such a block).
    A block of linear layers is always split: its products are most of the model's work, which the
    split divides (bytes alone would keep a small model's blocks whole, every device doing all of it).
    So is a head on a mesh of ``model`` alone: whole, it would save no gradient's sum, only the
    split's small sums of the loss's statistics, while every device repeats the head's whole product
    (and a model that pins its logits over ``model``, as the zoo did, computes them split anyway,
    then gathers the head's update, weights and moments: the 116 M LLaMA of `benchmarks.collectives`
    at 8 x 1 moved 375 MiB a step more)."""
    if any(s in facts.gathers for s in fit.kept.seeds):  # (an activation gathered whole: `_topk`)
        return True
    if fit.kept.kind == "head" or fit.kept.mirrored:  # (a head whose transposed product sums its split)
        return pricing.n_batch > 1
    columns = {k for k, (_, t) in fit.kept.members.items() if "column" in t}
    return all(u.kind == "conv" and math.prod(facts.shapes[k][d] for d in u.contracted) > _in_features(facts, u)
               for u in facts.uses if (k := u.leaf) in columns)


def _in_features(facts: Facts, use) -> int:
    """A conv's input features alone (its first contracted dim): more contracted than that is a
    kernel with extent, not a 1 x 1 conv (a linear layer by another name)."""
    return facts.shapes[use.leaf][use.contracted[0]] if use.contracted else 1


def block_costs(facts: Facts, fit, n: int, pricing: Pricing) -> tuple[float, float]:
    """What ``fit``'s block costs one device a step, in bytes, split as proven (`acts`, ``1 / n`` of
    the gradients and of the products' FLOPs) and whole (the gradients and all the FLOPs); FLOPs,
    forward and backward, count at `FLOPS_PER_BYTE`, as in `Cost`. Bytes alone kept a conv block
    whole wherever its activations outweighed its weights, every device doing all of its work: a
    residual conv net of 128 channels (256 in its blocks) over 32 x 32 pixels moved 0.47x the
    Megatron plan's bytes at 2 shards, for 2x the FLOPs and 1.45x the peak memory (8x and 2.1x at
    8 shards). A conv's FLOPs per byte it sums grow with its channels and kernel: a narrow one
    (wav2vec2's feature encoder at its test width) stays whole."""
    whole = pricing.gradient(facts, fit.kept.members) + work(facts, fit.kept.members, pricing.n_batch)
    return acts(facts, fit) / pricing.n_batch + whole / n, whole


def held_whole(facts: Facts, fit, n: int, pricing: Pricing) -> float:
    """The bytes of activations one device holds more a step with ``fit``'s block whole than split:
    its column layers' outputs (the hidden units; split, ``1 / n`` of them), which the backward pass
    keeps. A block kept whole to save a step's bytes must leave the memory budget room for them too:
    a 256-channel conv's output over 16,000 frames is 16 MB an example (float32)."""
    columns = [k for k, (_, t) in fit.kept.members.items() if "column" in t]
    return sum(facts.activation_bytes(k)[1] for k in columns) / pricing.n_batch * (1 - 1 / n)


def work(facts: Facts, leaves, n_batch: int) -> float:
    """The FLOPs of ``leaves``' products on one of ``n_batch`` devices that split the batch, forward
    and backward (`Facts.step_flops`), in bytes at `FLOPS_PER_BYTE`."""
    return sum(facts.step_flops(k) for k in leaves) / n_batch / FLOPS_PER_BYTE


class Cost(NamedTuple):
    """What a set of groups chosen to split costs one device a step, in bytes: the activations its
    blocks sum over ``model`` (`acts`; none for one `price` would keep whole), the weights'
    gradients summed over the batch's devices (``1 / n`` of those split), and the products' FLOPs
    (forward and backward; ``1 / n`` of those split) over `FLOPS_PER_BYTE`. Between two splits of a
    residual MLP without norms, Megatron's (each block's wide layer column, its narrow one row) sums
    its blocks' narrow inputs and outputs; the other (the stream split: stem column, each block's
    first layer row, second column) sums the wide hidden activations, for splitting the stem and
    head besides."""

    facts: Facts
    n: int
    pricing: Pricing

    def cheapest(self, sets: list[list[int]], heaviest: list[int], component: list[int],
                 fits: list) -> list[int]:
        """The set in ``sets`` that costs least, where what it costs apart from what it shares with
        ``heaviest`` (the same groups, the same leaves split or whole) is under `CLEARLY_CHEAPER` of
        what ``heaviest`` costs apart from that, and its weights left whole beyond ``heaviest``'s fit
        the memory budget (`Pricing.affords`); else ``heaviest``. Blocks of one kind are one choice
        here too: where some sets split every block of a kind or none of them, only those are
        weighed. Weighed one by one, an EfficientNet-style stack of MBConv blocks, each choosing
        between its expansion/projection pair and its squeeze-excite pair, split the pair in its last
        block alone (the stream split is the only other way to split all four squeeze-excite pairs)."""
        kinds: dict[tuple, set[int]] = {}
        for j in component:
            kinds.setdefault(_kind_of(self.facts, fits[j].kept.members), set()).add(j)
        sets = [pick for pick in sets if all(g <= set(pick) or not g & set(pick) for g in kinds.values())] or sets
        nb = self.pricing.n_batch
        summed = {}  # each group `price` would not keep whole -> the activations it sums
        for j in component:
            split, whole = block_costs(self.facts, fits[j], self.n, self.pricing)
            if whole >= split or not priced(self.facts, fits[j], self.pricing):
                summed[j] = acts(self.facts, fits[j]) / nb
        own = {k: self.pricing.gradient(self.facts, [k]) + work(self.facts, [k], nb)
               for j in component for k in fits[j].wants()}

        def parts(pick):  # the groups' activations, and each leaf's gradient and FLOPs (1 / n split)
            covered = {k for j in pick if j in summed for k in fits[j].kept.members}
            return {j: summed[j] for j in pick if j in summed}, {
                k: c / self.n if k in covered else c for k, c in own.items()}

        top_groups, top_own = parts(heaviest)
        split = {k for j in heaviest for k in fits[j].kept.members}
        for pick in sorted(sets, key=lambda p: sum(map(sum, (d.values() for d in parts(p))))):
            if pick == heaviest:
                break
            groups, mine_own = parts(pick)
            apart = [k for k in own if mine_own[k] != top_own[k]]
            mine = sum(v for j, v in groups.items() if j not in top_groups) + sum(mine_own[k] for k in apart)
            theirs = sum(v for j, v in top_groups.items() if j not in groups) + sum(top_own[k] for k in apart)
            if mine < CLEARLY_CHEAPER * theirs and self.pricing.affords(
                    self.facts, split - {k for j in pick for k in fits[j].kept.members}, self.n):
                return pick
        return heaviest


CLEARLY_CHEAPER = 0.75
"""The estimate leaves out what overlaps, each collective's ring and what XLA merges, so a set of
groups is chosen over the one that splits the most weight only where what it costs apart from what
the two share is under this share of the other's. A residual MLP's Megatron split: 0.26-0.39 of its
stream split (2 and 4 shards, 64 and 512 rows; compiled, 0.41x the bytes at 512 rows, 0.77x at 64:
the gradients' sums, the same in both, weigh more there). An MLP chain's other pairings: 1.01-1.72,
never under. Taking the cheapest at a looser margin (tried: 0.95 of the whole estimate), the
reviewed UNet, with GroupNorm then read as no norm, took a plan 1.17x its hand plan's bytes: its
options estimated within 6% of one another."""

FLOPS_PER_BYTE = 1000
"""An accelerator's FLOPs a second over the bytes a second its links carry to the devices it
shares a model with: an A100 312 TFLOP/s over 300 GB/s, a TPU v5e 197 over 200; an H100's 989
over 450 is twice this, so this weighs FLOPs more (a split kept) where the two are close."""


def acts(facts: Facts, fit) -> float:
    """The activation bytes ``fit``'s block sums over ``model`` a step, over the whole batch: each
    column layer's input gradient (backward; one activation read by several layers once), each row
    layer's output (forward)."""
    members = fit.kept.members
    cols = {k for k, (_, t) in members.items() if "column" in t}  # one weight both (tied): its outputs all
    rows = {k for k, (_, t) in members.items() if "row" in t}  # summed, as its row use's is
    gathered = sum(facts.gathers.get(s, 0) for s in fit.kept.seeds)  # (top_k along the split: `_topk`)
    return facts.inputs_read(cols) + sum(facts.activation_bytes(k)[1] for k in rows) + gathered


COLLECTIVE_BYTES = 1 << 20
"""What a collective costs before its first byte, in bytes at the links' rate: a few microseconds of
an all-reduce's start and synchronisation, about 1 MiB at `FLOPS_PER_BYTE`'s 300 GB/s. Counted where a
split adds collectives that no proven pair already runs (`_decide._Decider._estimate`): a split that
saves a small model some kilobytes a step is not worth a collective more."""
