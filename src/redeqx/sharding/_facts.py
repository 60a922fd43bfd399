"""What the program reader learned about each weight: the facts `_roles` decides from.

A *seed* is one use of a weight in a matmul or conv with an activation, whose
output is split on the weight's output dim. Seeds whose splits meet (added,
multiplied, or contracted on a shared batch dim such as attention's heads) are
one group: a Megatron block, split together. For each group the reader
records its row-parallel partners (weights that contract the split), its
followers (biases and per-channel weights applied to the split activation),
the reductions over the split dim it reaches (a vocabulary-parallel loss when
that dim alone is reduced; a norm when groups of it are, as GroupNorm does),
what blocked it, and the counts that must stay whole (heads, groups).
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass
class Use:
    """One use of a weight: which of its dims are the contraction's input,
    output and batch (expert) dims."""

    leaf: int
    contracted: tuple[int, ...]
    produced: tuple[int, ...]
    batch: tuple[int, ...]
    kind: str


@dataclasses.dataclass
class Whole:
    """A reshape after the split: ``size`` split ``n`` ways must land on whole
    ``count`` blocks (heads, or a GroupNorm's groups: ``unit``), i.e. ``(size / n) * inner_in`` a
    multiple of ``inner_out``."""

    size: int
    inner_in: int
    inner_out: int
    count: int
    text: str
    unit: str = "heads"
    shared: bool = False  # a block may also span several devices (a GroupNorm's group: its statistics summed)

    def holds(self, n: int) -> bool:
        if self.size % n:
            return False
        chunk = self.size // n * self.inner_in
        return chunk % self.inner_out == 0 or self.shared and self.inner_out % chunk == 0


class Facts:
    """``seed_last``: a weight with several output dims (an expert stack's ``(E, F, D)`` under
    ``einsum("td,efd->tef")``: experts and hidden units) seeds a split of its last one, not its
    first; `read_program` reads such a program both ways (``alternative``: the other reading)."""

    def __init__(self, paths: list[str], shapes: list[tuple[int, ...]], itemsizes: list[int] | None = None,
                 seed_last: bool = False):
        self.paths, self.shapes = paths, shapes
        self.seed_last = seed_last
        self.several_outputs = False  # some product's weight has several output dims: a second reading differs
        self.alternative: Facts | None = None
        self.itemsizes = itemsizes or [4] * len(shapes)
        self.uses: list[Use] = []
        self.use_out: list[int] = []  # each use's output bytes a step
        self.seed_use: list[int] = []  # seed -> index in uses
        self.seed_dim: dict[int, int] = {}  # seed -> the leaf dim its output split comes from
        self.parent: list[int] = []
        self.blocked: dict[int, str] = {}
        self.reduced: dict[int, str] = {}
        self.needs_whole: dict[int, str] = {}  # seeds reduced where the split activation is needed whole
        self.summed: set[int] = set()  # seeds whose split outputs are added to other layers' (a split stream)
        self.normalized: set[int] = set()  # seeds whose split dim alone is reduced (a softmax over classes)
        self.rows: list[tuple[int, int, int, str]] = []  # (seed, leaf, dim, why)
        # seed -> (the seed whose split activation its own product contracts, on the weight's dim): a
        # use that is also a row partner (``l(l(x))``'s second product)
        self.row_seeds: dict[int, tuple[int, int]] = {}
        self.gathered: set[int] = set()  # tables looked up by a gather (not only by one-hot products)
        self.gathers: dict[int, int] = {}  # seed -> bytes of its split output gathered whole a step (`_topk`)
        self.one_hot_uses: dict[int, int] = {}  # use index -> the weight's dim it contracts with a one-hot of data
        self.transposed: set[int] = set()  # uses that transpose an earlier one (`transposes`)
        self._uses_of: dict[int, list[int]] = {}  # leaf -> its uses' indices
        self.follows: list[tuple[int, int, int, str]] = []
        self.wholes: dict[int, list[Whole]] = {}
        self.group_counts: dict[int, int] = {}
        self.layer_dims: dict[int, dict[int, str]] = {}
        self.lookups: dict[int, list[tuple[int, bool]]] = {}
        self.laid_out: list[Use] = []  # products in a body that lays out its own operands (a shard_map's)
        self.looped: set[int] = set()  # weights a loop's body reads whole every trip (a scan's consts)
        # (leaf, equation) -> bytes of the activation a weight's matmul or conv reads (0 where it is
        # made from data alone: its gradient is never computed, nor summed) and of what it writes,
        # over all of the loop's trips (a scan over 22 layers: 22 times the body's); global
        # (the whole batch), so one device's share is this over the devices splitting the batch; and
        # the product's FLOPs (forward), likewise global, and how many times it runs a step
        self.traffic: dict[int, dict[int, tuple[int, int, int | None, int, int]]] = {}  # leaf -> eqn -> ...
        self._leaf_seed: dict[int, int] = {}

    # -- recording ---------------------------------------------------------------
    def use(self, leaf, contracted, produced, batch, kind, out_bytes: int = 0) -> int | None:
        """A product of ``leaf`` with an activation, writing ``out_bytes`` a step; its seed, if it
        produces a dim of the weight and transposes none of its earlier products (`transposes`)."""
        if self.transposes(leaf, contracted, produced, batch):
            self.transposed.add(len(self.uses))
        self._uses_of.setdefault(leaf, []).append(len(self.uses))
        self.uses.append(Use(leaf, contracted, produced, batch, kind))
        self.use_out.append(out_bytes)
        if not produced or len(self.uses) - 1 in self.transposed:
            return None
        seed = len(self.seed_use)
        self.seed_use.append(len(self.uses) - 1)
        self.parent.append(seed)
        if leaf in self._leaf_seed:  # one weight used twice is split one way
            self.union(seed, self._leaf_seed[leaf])
        else:
            self._leaf_seed[leaf] = seed
        return seed

    def transposes(self, leaf, contracted, produced, batch) -> bool:
        """Whether a product of ``leaf`` contracting ``contracted`` and producing ``produced`` is the
        transpose of an earlier one (it produces dims that one contracted, contracts those it produced:
        a flipped kernel's extent may be read by neither, `_ops.rev`): the same weight's
        ``W.T @ g`` beside its ``W @ x``, as a model differentiated inside its loss runs it (a critic's
        gradient penalty, a physics-informed net's derivatives, forces from an energy), or a tied
        decoder. Its output is split as that product's input was (`row_splits`), never on its own:
        each weight's transposed product seeding a split of its own, unified with its other uses'
        (one weight, one split), joined every block of such a model into one group, which then asked
        for a weight split on two dims and was kept whole: 2x / 4x the FLOPs, 1.9x / 3.6x a hand
        plan's bytes at 2 / 4 shards. A product with a one-hot (a lookup, `one_hot_uses`) is no
        forward product: a head tied to it seeds its vocabulary split."""
        return bool(produced) and any(
            (u := self.uses[i]).batch == tuple(batch) and set(produced) <= set(u.contracted)
            and set(u.produced) <= set(contracted) and i not in self.one_hot_uses for i in self._uses_of.get(leaf, ()))

    def row_splits(self, leaf: int, dim: int) -> list[int]:
        """The seeds whose split activation a product contracts with ``leaf``'s ``dim`` (its row
        partners' seeds)."""
        return [seed for seed, at, d, _ in self.rows if at == leaf and d == dim]

    def moves(self, leaf: int, eqn, act_in: int, act_out: int, read=None, flops: int = 0, trips: int = 1) -> None:
        """``leaf``'s matmul, conv or lookup ``eqn`` reads ``act_in`` bytes of the activation ``read``
        (0 where ``read`` is made from data alone: no gradient of it is summed), writes ``act_out``
        and does ``flops``, over its ``trips`` runs a step (a body a fixed point runs twice is
        counted once)."""
        self.traffic.setdefault(leaf, {})[id(eqn)] = (act_in, act_out, None if read is None else id(read), flops,
                                                      trips)

    def activation_bytes(self, leaf: int) -> tuple[int, int]:
        """The bytes of activations ``leaf``'s products read and write in one step (forward)."""
        found = self.traffic.get(leaf, {}).values()
        return sum(v[0] for v in found), sum(v[1] for v in found)

    def runs(self, leaf: int) -> int:
        """How many times ``leaf``'s products run in one step (a scan's body once a trip)."""
        return sum(v[4] for v in self.traffic.get(leaf, {}).values())

    def step_flops(self, leaf: int) -> int:
        """The FLOPs of ``leaf``'s products in one step: forward, the weight's gradient, and the
        input's gradient where the input has one (not where it is made from the batch alone)."""
        return sum(v[3] * (3 if v[0] else 2) for v in self.traffic.get(leaf, {}).values())

    def inputs_read(self, leaves) -> int:
        """The bytes of the activations the products of ``leaves`` read, each activation once (Q, K and
        V reading one input: one backward all-reduce of its gradient, as XLA merges them)."""
        seen: dict[object, int] = {}
        for k in leaves:
            for eqn, (act_in, _, read, *_) in self.traffic.get(k, {}).items():
                seen[(eqn, k) if read is None else read] = act_in
        return sum(seen.values())

    def nbytes(self, leaf: int) -> int:
        return self.size(leaf) * self.itemsizes[leaf]

    def block(self, seed: int, why: str) -> None:
        self.blocked.setdefault(seed, why)

    def reduce(self, seed: int, why: str, *, alone: bool = True, whole: bool | None = None) -> None:
        """``seed``'s split dim is reduced; ``alone``: that dim only, position by position (a
        softmax or a label's logit over classes: a vocabulary-parallel head; a LayerNorm's
        statistics over a block's hidden units), not with others (a norm over groups of channels,
        an MSE's total). ``whole`` (default: not ``alone``): the split activation is needed whole
        there, which a block cannot pay for (the residual stream, the loss's outputs); a reduction
        alone costs a block only its results' small sum over ``model`` (a row's mean and variance)."""
        self.reduced.setdefault(seed, why)
        if alone:
            self.normalized.add(seed)
        if (not alone) if whole is None else whole:
            self.needs_whole.setdefault(seed, why)

    def row(self, seed, leaf, dim, why) -> None:
        self.rows.append((seed, leaf, dim, why))

    def follow(self, seed, leaf, dim, why) -> None:
        self.follows.append((seed, leaf, dim, why))

    def whole(self, seed, size, inner_in, inner_out, count, text, unit: str = "heads", shared: bool = False) -> None:
        self.wholes.setdefault(seed, []).append(Whole(size, inner_in, inner_out, count, text, unit, shared))

    def conv_groups(self, seed, count) -> None:
        self.group_counts[seed] = count

    def layer_dim(self, leaf, dim, why) -> None:
        self.layer_dims.setdefault(leaf, {}).setdefault(dim, why)

    def lookup(self, leaf, dim, positional: bool, product: bool = False) -> None:
        """``leaf`` looked up on ``dim`` (by data, or at ``positional`` places the program computes),
        by a gather or (``product``) by a product with a one-hot of data (`_contract._one_hot_product`)."""
        self.lookups.setdefault(leaf, []).append((dim, positional))
        if not product:
            self.gathered.add(leaf)

    def summed_if_split(self, leaf: int, dim: int) -> int:
        """The bytes a step that splitting ``leaf`` on ``dim`` sums over ``model`` in its products:
        the outputs of those that contract that dim (not a tied head's logits, which come out split)."""
        return sum(b for u, b in zip(self.uses, self.use_out) if u.leaf == leaf and dim in u.contracted)

    # -- groups --------------------------------------------------------------------
    def find(self, s: int) -> int:
        while self.parent[s] != s:
            self.parent[s] = self.parent[self.parent[s]]
            s = self.parent[s]
        return s

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)

    def checked(self, tags: dict[int, int], where: str) -> dict[int, int]:
        """Seeds on one dim of one value are one group; one group on two dims is blocked."""
        by_dim: dict[int, int] = {}
        for seed, dim in tags.items():
            if dim in by_dim:
                self.union(seed, by_dim[dim])
            else:
                by_dim[dim] = seed
        roots: dict[int, int] = {}
        for seed, dim in tags.items():
            r = self.find(seed)
            if roots.setdefault(r, dim) != dim:
                self.block(seed, f"{where} would need its output split on two dims of one value")
        return tags

    def size(self, leaf: int) -> int:
        return math.prod(self.shapes[leaf])


def reshape_target(old: tuple[int, ...], new: tuple[int, ...], d: int) -> tuple[int, int, int] | None:
    """Where dim ``d`` of ``old`` goes when reshaped to ``new``: ``(t, inner_in,
    inner_out)`` with ``t`` the output dim it becomes the leading factor of, and
    the sizes of the dims after it in its reshape group on each side; None when
    other non-unit dims come before it in its group (a split of ``d`` would not
    be a split of any output dim)."""
    i = j = 0
    while i < len(old) and j < len(new):
        a, b = [i], [j]
        pa, pb = old[i], new[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb and i < len(old):
                a.append(i)
                pa *= old[i]
                i += 1
            elif j < len(new):
                b.append(j)
                pb *= new[j]
                j += 1
            else:
                return None
        while i < len(old) and old[i] == 1 and (j >= len(new) or new[j] != 1):
            a.append(i)
            i += 1
        if d in a:
            if any(old[x] != 1 for x in a[:a.index(d)]):
                return None
            big = [x for x in b if new[x] != 1]
            if not big:
                return None
            t = big[0]
            inner_in = math.prod(old[x] for x in a[a.index(d) + 1:])
            inner_out = math.prod(new[x] for x in b[b.index(t) + 1:])
            return t, inner_in, inner_out
    return None
