"""From the program's facts to each weight's split, for one ``n_model_shards``.

An ordered table of small rules (`RULES`), each deciding some leaves from the
facts and leaving the rest to the next:

1. ``experts``: a weight with a batch dim in its contraction with activations
   (an expert stack) is split on that axis when ``n_model_shards`` divides it;
2. ``blocks``: each group of seeds that reaches row-parallel partners through
   ops that keep the split (a Megatron block: column then row), or only
   reductions over the split dim alone (a vocabulary-parallel head and its
   softmax; not an MSE's total or a norm's statistics), is
   split as a whole, less the seeds whose own output is reduced or blocked
   first (left whole); among groups that would split one weight two ways,
   those that split the most weight, unless another choice costs clearly less
   a step (`_pricing.Cost`);
3. ``lookups``: a table gathered by data (token ids) is split on the gathered
   dim (vocab); one gathered at positions computed in the program (iota) is
   replicated;
4. ``read``: any other weight the program contracts is replicated, with the
   reason its groups were refused.

Weights the program does not contract or gather (norm scales, biases it does
not see beside a split, unused leaves) are left to the name rules.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import NamedTuple

from .._trees import human_bytes
from ._facts import Facts
from ._pricing import FLOPS_PER_BYTE, Cost, Pricing, block_costs, held_whole, price, priced


@dataclasses.dataclass(frozen=True)
class Role:
    """A program-derived decision for one leaf: the dim split over ``model``
    (None: replicated), why (in full, and ``short``), and ``refused`` when
    replication was forced by a count ``n_model_shards`` does not divide (said
    in the warning)."""

    dim: int | None
    reason: str
    refused: str | None = None
    short: str | None = None  # the reason in a few words, for `explain`'s default table
    priced: bool = False  # kept whole because that costs less than the split proven (`Pricing`)


@dataclasses.dataclass
class Group:
    seeds: list[int]
    members: dict[int, tuple[int, str]]  # leaf -> (dim, role text)
    reached: dict[int, set[int]]  # leaf -> the seeds that made it a member
    why_not: str | None
    kind: str  # "block" or "head"
    size: int
    left_whole: dict[int, str] = dataclasses.field(default_factory=dict)  # leaf -> why its seed was dropped
    # a head (its output reduced over the split alone) whose only row partners are its own transposed
    # products (an energy's gradient through its logits): weighed against whole as a head is
    # (`_pricing.priced`), not always split as a block (a tied autoencoder's, whose output is no head's)
    mirrored: bool = False


def _bad_seeds(facts: Facts, seeds: list[int], has_rows: bool) -> dict[int, str]:
    """Seeds of a group that cannot be split with it: blocked ones, and in a block (with
    row partners) those whose own output is needed whole first (added to the residual stream, a
    norm over groups of it, returned), and where one is, those reduced over the split too (a norm
    of that stream). Left whole, their output meets the others' split where it is sliced for free.
    In a block of its own, a reduction over the split alone (a LayerNorm over a block's hidden
    units) costs only its results' sum over ``model`` (a row's mean and variance), and keeps the seed.
    A weight with one such use keeps all its uses whole, unless that use is served another way
    (`_spared`)."""
    bad = {s: facts.blocked[s] for s in seeds if s in facts.blocked}
    if has_rows:  # a group where some seed feeds the residual stream, or several layers' outputs are added
        # (the stream itself, split), is the stream's: its norms need it whole too
        stream = any(s in facts.needs_whole or s in facts.summed for s in seeds)
        bad.update({s: f"its output {facts.needs_whole.get(s, facts.reduced[s])} before any layer contracts it (a "
                       "norm of the residual stream, or the stream)" for s in seeds
                    if s not in bad and (s in facts.needs_whole or stream and s in facts.reduced)})
    leaves = {facts.uses[facts.seed_use[s]].leaf for s in bad if not _spared(facts, s)}
    for s in seeds:
        if s not in bad and facts.uses[facts.seed_use[s]].leaf in leaves:
            bad[s] = "another use of the same weight cannot be split"
    return bad


def _spared(facts: Facts, seed: int) -> bool:
    """Whether ``seed``'s own output split is not needed, its product being served another way, so
    that its weight's other uses may still split: it contracts an activation its own group splits
    (row parallel there: a layer applied to its own output, ``l(l(x))``, which then asks for its
    weight split on two dims, and says so, `_groups`), or a one-hot of data (a lookup, `lookups`:
    ``one_hot(t) @ emb`` beside a tied head). A tied decoder's ``h @ W.T`` seeds nothing to spare: it
    transposes the encoder's ``x @ W`` (`Facts.transposes`), row parallel where ``h`` is split."""
    found = facts.row_seeds.get(seed)
    return found is not None and facts.find(found[0]) == facts.find(seed) or \
        facts.seed_use[seed] in facts.one_hot_uses


def _follows(facts: Facts, leaf: int) -> bool:
    """A weight applied elementwise beside a split may follow it unless it has uses of its
    own that need it whole (a token table looked up by data, a matmul)."""
    return not any(u.leaf == leaf for u in facts.uses) and not any(
        not positional for _, positional in facts.lookups.get(leaf, []))


def _groups(facts: Facts) -> list[Group]:
    by_root: dict[int, list[int]] = {}
    for seed in range(len(facts.seed_use)):
        by_root.setdefault(facts.find(seed), []).append(seed)
    rows, follows = {}, {}
    for seed, leaf, dim, why in facts.rows:
        rows.setdefault(facts.find(seed), []).append((leaf, dim, seed))
    for seed, leaf, dim, why in facts.follows:
        if _follows(facts, leaf):
            follows.setdefault(facts.find(seed), []).append((leaf, dim, seed))
    transposed = {facts.uses[i].leaf for i in facts.transposed}  # weights with a transposed product
    out = []
    for root, seeds in by_root.items():
        bad = _bad_seeds(facts, seeds, root in rows)
        good = [s for s in seeds if s not in bad]
        members: dict[int, tuple[int, str]] = {}
        reached: dict[int, set[int]] = {}
        why_not = next(iter(bad.values())) if not good else None
        entries = [(facts.uses[facts.seed_use[s]].leaf, facts.seed_dim.get(s), "column", s) for s in good]
        entries += [(leaf, dim, "follows", s) for leaf, dim, s in follows.get(root, []) if s not in bad]
        entries += [(leaf, dim, "row", s) for leaf, dim, s in rows.get(root, []) if s not in bad]
        # a product with a one-hot, its seed left out: its weight may split on the dim it contracts
        entries += [(facts.uses[facts.seed_use[s]].leaf, facts.one_hot_uses[facts.seed_use[s]], "follows", s)
                    for s in bad if facts.seed_use[s] in facts.one_hot_uses]
        for leaf, dim, text, seed in entries:
            if dim is None:
                continue
            if leaf in members and members[leaf][0] != dim:
                why_not = why_not or f"{facts.paths[leaf]} would be split on dims {members[leaf][0]} and {dim}"
            elif members.get(leaf) == (dim, "column") and text == "row":  # `x @ W`, then `h @ W.T` (`Facts.transposes`)
                members[leaf] = (dim, "column and row")
            members.setdefault(leaf, (dim, text))
            reached.setdefault(leaf, set()).add(seed)
        has_rows = any("row" in t for _, t in members.values())
        if why_not is None and not has_rows and not any(s in facts.normalized for s in good):
            why_not = next((f"its output {facts.reduced[s]}, and reaches no layer that contracts it"
                            for s in good if s in facts.reduced), "its output reaches no layer that contracts it")
        kind = "block" if has_rows else "head"
        whole = {facts.uses[facts.seed_use[s]].leaf: why for s, why in bad.items() if not _spared(facts, s)}
        mirrored = has_rows and any(s in facts.normalized for s in good) and all(
            t == "column and row" and leaf in transposed for leaf, (_, t) in members.items() if "row" in t)
        out.append(Group(good or seeds, members, reached, why_not, kind, sum(facts.size(leaf) for leaf in members),
                         whole, mirrored))
    out.sort(key=lambda g: (-g.size, g.seeds[0]))
    return out


def _seed_refusal(facts: Facts, seed: int, n: int) -> str | None:
    """Why ``seed``'s own output cannot be split ``n`` ways (its heads or groups), or None."""
    for whole in facts.wholes.get(seed, []):
        if not whole.holds(n):
            return (f"{whole.text} {facts.paths[facts.uses[facts.seed_use[seed]].leaf]}: "
                    f"{whole.count} {whole.unit} not divisible by n_model_shards={n}" + (
                        f" nor dividing it (a device's channels would straddle {whole.unit})" if whole.shared else
                        f" ({whole.unit} are never split)"))
    count = facts.group_counts.get(seed)
    if count is not None and count % n:
        return f"{count} conv groups not divisible by n_model_shards={n} (groups are never split)"
    return None


def _refusal(facts: Facts, group: Group, n: int) -> str | None:
    for leaf, (dim, _) in group.members.items():
        size = facts.shapes[leaf][dim]
        if size % n:
            return f"{facts.paths[leaf]} dim {dim} ({size}) not divisible by n_model_shards={n}"
    return None


def _without(group: Group, dropped: set[int]) -> Group:
    """``group`` less the members only ``dropped`` seeds reached: K/V with fewer heads than
    devices stay whole (each device keeps every kv head) while Q and the output split."""
    keep = {leaf for leaf, seeds in group.reached.items() if seeds - dropped}
    return Group([s for s in group.seeds if s not in dropped], {k: v for k, v in group.members.items() if k in keep},
                 {k: v for k, v in group.reached.items() if k in keep}, group.why_not, group.kind, group.size,
                 mirrored=group.mirrored)


def _listed(paths: list[str], most: int) -> str:
    return ", ".join(paths[:most]) + ("..." if len(paths) > most else "")


def _describe(facts: Facts, group: Group, leaf: int, dim: int, text: str) -> Role:
    """The leaf's role in its group, naming only the weights that made it a member: its own
    heads' reshape, the columns whose output it contracts or follows (not a neighbour's)."""
    own = [s for s in group.seeds if facts.uses[facts.seed_use[s]].leaf == leaf]
    seeds = own or sorted(group.reached.get(leaf, ()))
    heads = sorted(((w, s) for s in seeds for w in facts.wholes.get(s, [])), key=lambda e: e[0].unit == "heads")
    extra = f"; {heads[0][0].unit}: {heads[0][0].text} {facts.paths[facts.uses[facts.seed_use[heads[0][1]]].leaf]}" \
        if heads and text != "follows" else ""  # a GroupNorm's groups before the reshape that made them
    if group.kind == "head":
        return Role(dim, f"program: vocabulary parallel on dim {dim}: its output is split and the loss reduces "
                         f"over it{extra}", short=f"vocabulary parallel, dim {dim}")
    partners = sorted({facts.paths[m] for m, (_, t) in group.members.items() if t == "row"})
    sources = sorted({facts.paths[facts.uses[facts.seed_use[s]].leaf] for s in group.reached.get(leaf, ())})
    if text == "column and row":
        return Role(dim, f"program: column parallel on dim {dim}, and row parallel on it where its transposed "
                         f"product contracts that split output (one weight, two uses: a tied decoder, or the "
                         f"model's gradient taken in its loss){extra}", short=f"column and row parallel, dim {dim}")
    if text == "column":
        return Role(dim, f"program: column parallel on dim {dim}; feeds {_listed(partners, 3)}{extra}",
                    short=f"column parallel, dim {dim}")
    if text == "row":
        return Role(dim, f"program: row parallel on dim {dim} (contracts the split output of {_listed(sources, 3)})",
                    short=f"row parallel, dim {dim}")
    return Role(dim, f"program: dim {dim}, follows the split output of {_listed(sources, 2)}",
                short=f"follows its layer's split, dim {dim}")


def experts(facts: Facts, n: int, decided: dict[int, Role], pricing: Pricing | None = None) -> None:
    stacks = {}
    for use in facts.uses:
        if use.batch and use.leaf not in decided:
            axis = use.batch[0]
            e = facts.shapes[use.leaf][axis]
            if e % n == 0:
                decided[use.leaf] = Role(axis, f"program: expert axis dim {axis} (a batch dim of its contraction): "
                                               f"{e} experts -> {e // n} per device",
                                         short=f"expert parallel, dim {axis}: {e // n} of {e} per device")
                stacks[use.leaf] = axis
    _expert_producers(facts, n, decided, stacks)


def _expert_producers(facts: Facts, n: int, decided: dict[int, Role], stacks: dict[int, int]) -> None:
    """The weights whose products yield the expert axis that an expert stack (``stacks``: leaf ->
    its expert dim) then takes as a batch dim: a dense mixture's up stack
    (``einsum("td,efd->tef", x, w_in)``, then ``einsum("tef,edf->ted", h, w_out)``) is split on
    its expert dim like the stack it feeds, and so are the biases beside its output. Each expert
    then runs on one device, and the gates' sum over experts (a contraction with an activation)
    is the one all-reduce, of ``(T, D)``, as expert parallelism has it. Their seeds are blocked
    by that sum, which the block rule cannot price; without this the up stack stayed whole (2.5x
    the collective bytes, `test_rules_moe`)."""
    fed: dict[int, str] = {}  # group root -> the stack its split feeds on its expert dim
    for seed, leaf, dim, _ in facts.follows:
        if stacks.get(leaf) == dim:
            fed.setdefault(facts.find(seed), facts.paths[leaf])
    for seed in range(len(facts.seed_use)):
        leaf, dim = facts.uses[facts.seed_use[seed]].leaf, facts.seed_dim.get(seed)
        if facts.find(seed) in fed and dim is not None and leaf not in decided and facts.shapes[leaf][dim] % n == 0:
            e = facts.shapes[leaf][dim]
            decided[leaf] = Role(dim, f"program: expert axis dim {dim} (its product yields the expert axis that "
                                      f"{fed[facts.find(seed)]} takes as a batch dim): {e} experts -> {e // n} "
                                      "per device", short=f"expert parallel, dim {dim}: {e // n} of {e} per device")
    for seed, leaf, dim, _ in facts.follows:
        if facts.find(seed) in fed and leaf not in decided and _follows(facts, leaf) and \
                facts.shapes[leaf][dim] % n == 0:
            decided[leaf] = Role(dim, f"program: dim {dim}, follows an expert-split output",
                                 short=f"follows its layer's split, dim {dim}")


class _Fit(NamedTuple):
    """A group fitted to ``n`` shards: what splits, what stays whole for a count ``n`` does not divide."""

    group: Group
    kept: Group
    dropped: dict[int, Role]
    refusal: str | None

    def wants(self) -> dict[int, int | None]:
        return {**{leaf: None for leaf in self.dropped}, **{leaf: d for leaf, (d, _) in self.kept.members.items()}}


def _fit(facts: Facts, group: Group, n: int) -> _Fit:
    failing = {s: why for s in group.seeds if (why := _seed_refusal(facts, s, n)) is not None}
    kept = _without(group, set(failing)) if failing and len(failing) < len(group.seeds) else group
    if kept is not group and not any("row" in t for _, t in kept.members.values()) and kept.kind == "block":
        kept = group
    refusal = _refusal(facts, kept, n) or (next(iter(failing.values())) if kept is group and failing else None)
    dropped: dict[int, Role] = {}
    for leaf in set(group.members) - set(kept.members):
        why = next(failing[s] for s in group.reached[leaf] if s in failing)
        dropped[leaf] = Role(None, f"program: {group.members[leaf][1]}, replicated", refused=why)
    return _Fit(group, kept, dropped, refusal)


def _conflict(a: _Fit, b: _Fit) -> bool:
    wa, wb = a.wants(), b.wants()
    return any(wa[leaf] != wb[leaf] for leaf in wa.keys() & wb.keys())


def _choose(fits: list[_Fit], cost=None) -> list[_Fit]:
    """The groups to split: no weight in two with different splits. Exact over each small set of
    groups that compete (a chain of layers, a layer and its adapter): the most weight split, or with
    ``cost`` (`Cost`) the set that costs least; else in program order (which, for a long chain of
    layers, alternates from the first, as Megatron pairs them)."""
    chosen, seen = [], set()
    for i in range(len(fits)):
        if i in seen:
            continue
        component, todo = [], [i]
        seen.add(i)
        while todo:
            j = todo.pop()
            component.append(j)
            for k in range(len(fits)):
                if k not in seen and _conflict(fits[j], fits[k]):
                    seen.add(k)
                    todo.append(k)
        chosen += _best(sorted(component, key=lambda j: fits[j].group.seeds[0]), fits, cost)
    return [fits[j] for j in sorted(chosen)]


def _best(component: list[int], fits: list[_Fit], cost=None) -> list[int]:
    """The groups of one component of competing groups to split: among its maximal conflict-free
    sets, the heaviest (on ties, the first in program order), or with ``cost`` the one that costs
    least (`Cost.cheapest`). Those are all of them where there are at most `MAXIMAL_SETS`, else
    those taken in program order from each group on (each group taken unless it conflicts with one
    taken before: for a chain of layers, the alternations from each of its first two). Taken in
    program order from the first alone, as once past 12 groups, a MobileNetV2's stem was paired with
    its first block and each block's projection with the next block's expansion (the narrow stream
    split, its wide activations summed): 4.2-4.5x the bytes and 1.8-4.6x the peak memory of
    Megatron's pairs at 2-8 shards."""
    rivals = {j: {k for k in component if k != j and _conflict(fits[j], fits[k])} for j in component}
    order = {j: b for b, j in enumerate(component)}
    sets = _maximal_sets(rivals, set(), set(component), set(), [])
    if sets is None:
        sets = []
        for start in range(len(component)):
            picked: set[int] = set()
            for j in component[start:] + component[:start]:
                if not rivals[j] & picked:
                    picked.add(j)
            if sorted(picked) not in sets:
                sets.append(sorted(picked))
    sets.sort(key=lambda pick: sum(1 << order[j] for j in pick))
    heaviest = max(sets, key=lambda pick: sum(fits[j].kept.size for j in pick))  # the first of the heaviest
    if cost is None or len(sets) == 1:  # one group, or none that compete
        return heaviest
    return cost.cheapest(sets, heaviest, component, fits)


MAXIMAL_SETS = 4096
"""The most maximal conflict-free sets of one component of competing groups `_best` weighs
(a chain of k layers has about 1.32^k: 49 for 14 groups, 265 for 20, over 4,096 for 30)."""


def _maximal_sets(rivals: dict[int, set], chosen: set, free: set, excluded: set, out: list) -> list | None:
    """Every maximal set of groups no two of which are ``rivals`` (Bron and Kerbosch's search, with a
    pivot), each sorted, in ``out``; None past `MAXIMAL_SETS`."""
    if not free and not excluded:
        out.append(sorted(chosen))
        return out if len(out) <= MAXIMAL_SETS else None
    pivot = min(free | excluded, key=lambda u: len(free & (rivals[u] | {u})))
    for v in sorted(free & (rivals[pivot] | {pivot})):
        if _maximal_sets(rivals, chosen | {v}, free - rivals[v] - {v}, excluded - rivals[v] - {v}, out) is None:
            return None
        free, excluded = free - {v}, excluded | {v}
    return out


def _whole_role(role: Role, split: float, whole: float) -> Role:
    saved = f"{human_bytes(split - whole)} less a step than split"
    return Role(None, f"{role.reason}; but kept whole: it costs {saved} (estimated in bytes moved, FLOPs at "
                      f"{FLOPS_PER_BYTE} a byte: split {human_bytes(split)}, whole {human_bytes(whole)}, its kind "
                      "of block together)", short=f"whole: {saved} in bytes and FLOPs (estimated)", priced=True)


def blocks(facts: Facts, n: int, decided: dict[int, Role], pricing: Pricing | None = None) -> None:
    fits = []
    for group in _groups(facts):
        if group.why_not is None and not any(
                leaf in decided and decided[leaf].dim != dim for leaf, (dim, _) in group.members.items()):
            fits.append(_fit(facts, group, n))
    chosen = _choose([f for f in fits if f.refusal is None], None if pricing is None else Cost(facts, n, pricing))
    whole = {} if pricing is None else price(pricing, facts, n, [
        (tuple(f.kept.members), *block_costs(facts, f, n, pricing), held_whole(facts, f, n, pricing))
        for f in chosen if priced(facts, f, pricing)])
    for fit in chosen:
        decided.update(fit.dropped)
        for leaf, (dim, text) in fit.kept.members.items():
            decided[leaf] = _describe(facts, fit.group, leaf, dim, text)
            if leaf in whole:
                decided[leaf] = _whole_role(decided[leaf], *whole[leaf])
    for fit in fits:  # a block no n_model_shards split fits: whole, and said so
        if fit.refusal is not None:
            for leaf, (dim, text) in fit.group.members.items():
                decided.setdefault(leaf, Role(None, f"program: {text}, replicated", refused=fit.refusal))


def lookups(facts: Facts, n: int, decided: dict[int, Role], pricing: Pricing | None = None) -> None:
    tables = []
    for leaf, found in facts.lookups.items():
        dim, positional = found[0]
        if leaf not in facts.gathered:  # one-hot products alone: split where the estimate says so, else `read`
            # (not where it also contracts an activation on that dim: the partitioner sums each use's
            # gradient apart, `l(l(x))` moved 1.6x the bytes of its weight whole; nor in a loop that reads
            # it every trip, a recurrent LM's one-hot input: a collective a token)
            alone = all(i in facts.one_hot_uses for i, u in enumerate(facts.uses)
                        if u.leaf == leaf and dim in u.contracted)
            if leaf not in decided and alone and leaf not in facts.looped and not positional and \
                    facts.shapes[leaf][dim] % n == 0:
                decided[leaf] = Role(dim, f"program: embedding, looked up by a product with a one-hot of data on dim "
                                          f"{dim} (vocab): each device's part of the product is summed over 'model'",
                                     short=f"one-hot embedding, dim {dim} (vocab)")
                tables.append(leaf)
            continue
        if leaf in decided:
            if decided[leaf].dim == dim or decided[leaf].priced:
                decided[leaf] = dataclasses.replace(decided[leaf], reason=decided[leaf].reason + "; also looked up "
                                                    "(tied embedding)", short=f"{decided[leaf].short}, tied embedding")
            continue
        if all(p for _, p in found):
            decided[leaf] = Role(None, "program: looked up at positions the program computes: replicated",
                                 short="replicated: looked up at computed positions")
        elif facts.shapes[leaf][dim] % n:
            decided[leaf] = Role(None, "program: embedding", refused=(
                f"dim {dim} ({facts.shapes[leaf][dim]}) not divisible by n_model_shards={n}"))
        else:
            decided[leaf] = Role(dim, f"program: embedding, looked up by data on dim {dim} (vocab)",
                                 short=f"embedding, dim {dim} (vocab)")
            tables.append(leaf)
    if pricing is not None:  # split on vocab, each lookup's rows are summed over 'model' (forward)
        summed = {k: facts.activation_bytes(k)[1] if k in facts.gathered else facts.summed_if_split(k, decided[k].dim)
                  for k in tables}
        costs = [((k,), summed[k] / pricing.n_batch + pricing.gradient(facts, [k]) / n,
                  pricing.gradient(facts, [k]), 0.0) for k in tables]  # the rows looked up: whole either way
        for k, (split, whole) in price(pricing, facts, n, costs).items():
            decided[k] = _whole_role(decided[k], split, whole)


def read(facts: Facts, n: int, decided: dict[int, Role], pricing: Pricing | None = None) -> None:
    groups = _groups(facts)
    for use in facts.uses:
        if use.leaf in decided:
            continue
        mine = [g for g in groups if use.leaf in g.members]
        why = next((g.left_whole[use.leaf] for g in groups if use.leaf in g.left_whole), None)
        why = why or next((g.why_not for g in mine if g.why_not), None)
        short = why
        if why is None and not use.contracted:  # `g` of `g * v / |v|`: it scales the output its layer gives
            decided[use.leaf] = Role(None, "program: a gain on a layer's output features (as weight normalisation's g "
                                           "is), replicated: that output stays whole (a row-parallel or whole layer's)",
                                     short="replicated: a gain on a whole output")
            continue
        if why is None and mine:
            why, short = ("its block would split it another way than a block chosen over it (more weight split, or "
                          "fewer bytes and FLOPs a step)", "a competing block's split was chosen")
        elif why is None:
            why = short = "no output dim to split (its product yields no feature of its own)"
        decided[use.leaf] = Role(None, f"program: {use.kind} contracting dims {use.contracted} with its input, "
                                       f"replicated: {why}", short=f"replicated: {short}")


RULES = (experts, blocks, lookups, read)


def decide_read(facts: Facts, n: int, pricing: Pricing | None = None
                ) -> tuple[Facts, dict[int, Role], Pricing | None]:
    """`decide` on the program's first reading, or on its second (`Facts.alternative`: a weight with
    several output dims seeded on its last, an expert stack's ``(E, F, D)`` on its hidden units
    rather than its experts) where that splits more bytes of weights: where ``n`` does not divide the
    experts, the first keeps the stacks whole, and the second splits their hidden units, as
    Megatron does each expert (on ties, the first: experts split). Returns the reading chosen, its
    roles and its ``pricing`` (each reading spends a copy)."""
    readings = [facts] if facts.alternative is None else [facts, facts.alternative]
    options = []
    for reading in readings:
        spent = copy.deepcopy(pricing)
        options.append((reading, decide(reading, n, spent), spent))
    return max(options, key=lambda o: sum(o[0].nbytes(k) for k, role in o[1].items() if role.dim is not None))


def decide(facts: Facts, n: int, pricing: Pricing | None = None) -> dict[int, Role]:
    """Each leaf the program decides, by the first rule in `RULES` that does; with ``pricing``, a
    proven split that moves more bytes than its weights whole is kept whole (`Pricing`)."""
    decided: dict[int, Role] = {}
    for rule in RULES:
        rule(facts, n, decided, pricing)
    return decided
