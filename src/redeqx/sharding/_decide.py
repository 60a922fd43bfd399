"""`leaf_specs`: every array leaf's spec and reason, in three passes.

1. weights (rank >= 2, floating): an override, else the program's role, else
   the name rules (whose unknown layers alternate 0, 1, 0, ... under their
   parent; an override does not interrupt the alternation);
2. the other leaves: an override, else the program's role (a bias beside a
   split activation), else they follow their layer's weight;
3. overrides that never applied are an error.

Then `advice`: what the plan leaves on the table, said as warnings (blocks with
matmuls the program left wholly replicated; Flax-style ``kernel``s the names
split as if stored ``(out, in)``).
"""

from __future__ import annotations

import collections
import dataclasses
import math

import jax
from jax.sharding import Mesh, PartitionSpec as P

from ..mesh import MODEL, STAGE
from .._trees import human_bytes, is_array_like, path_parts
from ._name_rules import UNPLACED, classify
from ._names import _ancestors
from ._ops import CUTS_FEATURES
from ._pricing import CLEARLY_CHEAPER, COLLECTIVE_BYTES, Pricing, work
from ._roles import Role, decide_read
from ._specs import (
    LeafSpec, Overrides, axes_of, brief, check_mesh_model, fsdp_spec, is_weight, lifted, plain_why, small_leaf_spec,
    split_spec, stacked_leaves, vocab_sizes, weight_layer,
)

def staged(spec: P, shape, mesh: Mesh, reason: str, short: str) -> tuple[P, str, str]:
    """A stacked leaf on a mesh with pipeline stages: its layer axis (dim 0) split over ``stage``, each
    stage holding its own layers (`redeqx.steps._pipeline`). A layer count the stages do not divide is
    left whole here; the step that pipelines its scan says what to change."""
    n = dict(mesh.shape).get(STAGE, 1)
    if n == 1 or not shape or shape[0] % n:
        return spec, reason, short
    entries = list(spec) + [None] * (len(shape) - len(spec))
    if entries[0] is not None:
        return spec, reason, short
    entries[0] = STAGE
    return P(*entries), f"{reason}; layers over {n} pipeline stages", f"{short} + stages"


# A leaf replicated because n_model_shards does not divide it is warned about unless it holds under
# this share of the model's parameters (a 10-class head): its copy costs each device under 1 % more
# memory, and no choice of n_model_shards would help it. `explain` says it either way.
QUIET_SHARE = 0.01


class _Decider:
    def __init__(self, model, mesh: Mesh, overrides, fsdp: bool, name: str | None, facts):
        self.model, self.fsdp, self.name, self.facts = model, fsdp, name, facts
        self.mesh, self.n_model = check_mesh_model(mesh)
        self.prefix = f"{name}." if name else ""
        self.overrides = Overrides(overrides, self.mesh, self.prefix)
        # one model shard splits nothing: nothing to price
        self.pricing = Pricing(self.mesh.size // self.n_model, memory_budget(self.mesh)) if self.n_model > 1 else None
        self.roles: dict[int, Role] = {}
        if facts is not None:
            facts, self.roles, self.pricing = decide_read(facts, self.n_model, self.pricing)
            self.facts = facts
        self.leaves = stacked_leaves(model, facts)
        self.arrays = [x for x in jax.tree_util.tree_leaves(model) if is_array_like(x)]
        self.size = sum(math.prod(x.shape) for x in self.arrays)
        self.vocab = vocab_sizes(model, self.leaves, self.n_model)
        self.counters: dict[str, int] = {}
        self.weight_dims: dict[str, int] = {}  # layer path -> dim split by 'model' (for its bias and adapters)
        self.fallbacks: list[tuple[str, str, bool]] = []  # (leaf, why, loud)
        self.unplaced: list[str] = []
        # the program split none of the weights it contracts: (how many, the first's reason, advice)
        self.unread: tuple[int, str, str] | None = None
        self.decided: dict[int, LeafSpec] = {}
        self.program_layers: set[str] = set()  # layers whose weight the program placed
        self.kernels: list[str] = []  # (in, out)-named weights the names split as (out, in)
        self.used = set(facts.traffic) if facts is not None else set()  # weights in a product or lookup
        self.cost_notes: dict[int, str] = {}  # weight -> the estimate behind a split the names made

    # -- recording ------------------------------------------------------------------
    def finish(self, k: int, spec: P, reason: str, *, whole: bool = False, short: str | None = None) -> None:
        """``spec`` is one layer's (lifted over the layer axes) unless ``whole``; ``short``: the
        reason in a few words (by default ``reason`` cut short)."""
        i, kp, one, n = self.leaves[k]
        full = self._full(k)
        short = brief(reason if short is None else short)
        if not whole:
            spec = lifted(spec, n)
        if self.fsdp and not reason.startswith("override"):
            spec, did = fsdp_spec(spec, full.shape, self.mesh, keep=set(range(n)))
            if did:
                reason, short = reason + " + fsdp over data", short + " + fsdp"
        if n:
            layers = " x ".join(map(str, full.shape[:n]))
            reason, short = f"layer axis (L={layers}), each layer: {reason}", f"L={layers} stacked: {short}"
            spec, reason, short = staged(spec, full.shape, self.mesh, reason, short)
        self.decided[i] = LeafSpec(".".join(path_parts(kp)), tuple(full.shape), full.dtype, spec, reason, short)

    def _full(self, k: int):
        return self.arrays[k]

    def fall_back(self, k: int, loud: bool, reason: str, why: str, *, whole: bool = False) -> None:
        """Replicated, as ``n_model_shards`` cannot split the leaf as the rules would: warned unless
        the leaf is small (`QUIET_SHARE`: a classifier head's few classes), said in `explain` either way."""
        _, kp, one, _ = self.leaves[k]
        shape = tuple(self._full(k).shape) if whole else tuple(one.shape)
        short = f"replicated: {plain_why(why)}"
        if loud and math.prod(self._full(k).shape) < QUIET_SHARE * self.size:
            loud, why = False, f"{why}; under {QUIET_SHARE:.0%} of the model's parameters, so not warned"
            short = f"replicated (small): {short[len('replicated: '):]}"
        elif loud and self.facts is not None and k in self.used and \
                math.prod(self._full(k).shape) <= QUIET_WHOLE_SHARE * self.size and (c := self._estimate(k))[1] <= c[0]:
            loud = False  # whole is what it would cost least anyway: nothing lost
            why = f"{why}; whole it costs {human_bytes(c[0] - c[1])} less a step than split (estimated), so not warned"
            short = f"replicated (cheaper whole): {short[len('replicated: '):]}"
        self.fallbacks.append((f"{self.prefix}{'.'.join(path_parts(kp))} {shape}", why, loud))
        self.finish(k, P(), f"{reason}: replicated, {why}", whole=whole, short=short)

    # -- passes ---------------------------------------------------------------------
    def run(self) -> None:
        later = []
        for k, (i, kp, one, n) in enumerate(self.leaves):
            parts = path_parts(kp)
            hit = self.overrides.find(".".join(parts), self._full(k))
            if not is_weight(parts, one):
                if hit is not None:
                    self.finish(k, hit[0], hit[1], whole=True)
                else:
                    later.append(k)
                continue
            self.weight(k, parts, one, hit)
        for k in later:
            self.small(k)
        self.overrides.check_all_used([".".join(path_parts(kp)) for _, kp, _, _ in self.leaves], self.name)
        self.check_program_placed()

    def check_program_placed(self) -> None:
        """With a program, at least one weight it contracts is split, or a warning says why none is."""
        if self.facts is None or self.n_model == 1:
            return
        used = sorted({u.leaf for u in self.facts.uses})
        roles = [self.roles[k] for k in used if k in self.roles]
        if not (roles and all(r.dim is None and r.refused is None for r in roles)) or \
                any(_splits(self, k) for k in used):  # one split alone (`_split_alone`)
            return
        costs, cut = {}, False
        for leaves in _blocks(self, [k for k in used if k in self.roles]).values():
            found, _, fused = _block_costs(self, leaves)
            costs, cut = costs | found, cut or fused
        dearer = [k for k, (split, whole) in costs.items() if whole > split and not _overridden(self, k)]
        if not dearer:
            return  # replication moves the fewest bytes (a small recurrent cell, one conv): nothing lost
        k = max(dearer, key=lambda k: costs[k][1] - costs[k][0])
        split, whole = costs[k]
        self.unread = (len(roles), f"{self.facts.paths[k]}: {self.roles[k].short or self.roles[k].reason}; split, it "
                                   f"would cost {human_bytes(whole - split)} less a step (estimated)",
                       FUSED if cut else "")

    def weight(self, k: int, parts, one, hit) -> None:
        role = self.roles.get(k)
        layer = ".".join(weight_layer(parts))
        rule = classify(parts, _ancestors(self.model, self.leaves[k][1]), tuple(one.shape), self.vocab, self.n_model)
        dim, reason = self._alternate(rule, parts)
        if role is not None and hit is None:
            return self.from_program(k, self._against_names(k, role, dim, reason), layer)
        if hit is not None:
            n = self.leaves[k][3]  # the override names the whole leaf: its out dim follows the layer axes
            if len(hit[0]) > n and hit[0][n] is not None and MODEL in axes_of(hit[0][n]):
                self.weight_dims[layer] = 0  # its bias and adapters follow the override
            return self.finish(k, hit[0], f"{hit[1]} (rules: {role.reason if role else reason})", whole=True,
                               short=hit[1])
        if rule.refuse is not None:
            return self.fall_back(k, self.n_model > 1, reason, rule.refuse)
        if dim == -1:
            if reason == UNPLACED and self.facts is None and sum(d > 1 for d in one.shape) >= 2:
                self.unplaced.append(f"{self.prefix}{'.'.join(parts)} {tuple(one.shape)}")
            return self.finish(k, P(), reason)
        if rule.whole is not None and rule.whole[0] % self.n_model:
            count, what = rule.whole
            return self.fall_back(k, True, reason.split(":")[0], f"{count} {what} not divisible by "
                                  f"n_model_shards={self.n_model} ({what} are never split)")
        if one.shape[dim] % self.n_model:  # a dim of 1 (a value head's output) has nothing to split: quiet
            return self.fall_back(k, one.shape[dim] >= self.n_model, reason,
                                  f"dim {dim} ({one.shape[dim]}) not divisible by n_model_shards={self.n_model}")
        if role is None and self.facts is not None and self._whole_is_cheaper(k, one, dim, reason):
            return
        self.weight_dims[layer] = dim
        if parts[-1] == "kernel" and one.ndim == 2 and self.facts is None:
            self.kernels.append(f"{self.prefix}{'.'.join(parts)} {tuple(one.shape)}")
        self.finish(k, split_spec(one.ndim, dim), reason + self.cost_notes.get(k, ""))

    def _estimate(self, k: int, paired: bool = False) -> tuple[float, float, int]:
        """`split_cost` of weight ``k`` on this mesh (``paired``: as one of a column/row pair) with
        `COLLECTIVE_BYTES` for each collective the split adds, and how many: each run of its product
        (a scan's body runs once a trip), the output's sum, and, alone, its input's gradient gathered
        where it has one. A recurrent cell split would sum its state every token. Every estimate of
        a split without a proven partner is this one: the names' split weighed against whole, a
        weight split alone, and the warnings'."""
        split, whole = split_cost(self.facts, k, self.mesh.size // self.n_model, self.n_model, paired)
        runs = self.facts.runs(k) * (2 if self.facts.activation_bytes(k)[0] and not paired else 1)
        return split + runs * COLLECTIVE_BYTES, whole, runs

    def _whole_is_cheaper(self, k: int, one, dim: int, reason: str) -> bool:
        """For a weight the program contracts but whose split it does not prove (the names split it):
        the split or the whole weight, whichever costs less a step by `_estimate`, said in the
        reason; True when it finished the leaf (whole)."""
        if k not in self.used or self.pricing is None:
            return False
        split, whole, _ = self._estimate(k)
        if whole <= split and self.pricing.affords(self.facts, [k], self.n_model):
            self.pricing.taken.append(((k,), split, whole))
            self.finish(k, P(), f"{reason} by the names, but kept whole: it costs {human_bytes(split - whole)} less "
                                f"a step than split (estimated in bytes and FLOPs: split {human_bytes(split)}, whole "
                                f"{human_bytes(whole)})",
                        short=f"whole: {human_bytes(split - whole)} less than split on dim {dim} (estimated)")
            return True
        if whole > split:
            self.cost_notes[k] = (f"; split: it costs {human_bytes(whole - split)} less a step than whole "
                                  f"(estimated in bytes and FLOPs: split {human_bytes(split)}, whole "
                                  f"{human_bytes(whole)})")
        return False

    def _alternate(self, rule, parts) -> tuple[int, str]:
        layer = weight_layer(parts)
        group = ".".join(layer[:-1])
        dim, reason = rule.dim, rule.reason
        if dim is None:
            dim = rule.alternation[self.counters.get(group, 0) % 2]
            self.counters[group] = self.counters.get(group, 0) + 1
            where = f" under '{group}'" if group else ""
            role = "column (dim 0)" if dim == 0 else f"row (dim {dim})"
            reason = f"{reason + ': ' if reason else ''}unnamed layers{where} alternate column/row: {role}"
        elif rule.counts and dim in rule.alternation:
            self.counters[group] = rule.alternation.index(dim) + 1  # a named layer advances its parent's too
        return dim, reason

    def _against_names(self, k: int, role: Role, dim: int, reason: str) -> Role:
        """The program's role, saying so where the names would have split the leaf otherwise."""
        n = self.leaves[k][3]
        by_names = None if dim == -1 else dim + n
        if role.dim == by_names or not reason:
            return role
        said = "replicated" if by_names is None else f"dim {by_names}"
        return dataclasses.replace(role, reason=f"{role.reason} (names said {said}: {reason}; the program wins)")

    def from_program(self, k: int, role: Role, layer: str) -> None:
        full = self._full(k)
        self.program_layers.add(layer)
        if role.refused is not None:
            return self.fall_back(k, True, role.reason.rsplit(", replicated", 1)[0], role.refused, whole=True)
        if role.dim is None:
            if self._split_alone(k, role):
                return
            return self.finish(k, P(), role.reason, whole=True, short=role.short)
        self.finish(k, split_spec(full.ndim, role.dim), role.reason, whole=True, short=role.short)

    def _split_alone(self, k: int, role: Role) -> bool:
        """A weight the program keeps whole for want of a partner (its output needed whole), split
        alone on the dim it contracts where that costs clearly less a step than whole: `split_cost`
        plus `COLLECTIVE_BYTES` for each collective it adds (each run of its product: the output's
        all-reduce, and its input's gradient gathered where it has one), under `CLEARLY_CHEAPER` of
        whole. Its input is sliced where it is, its output summed over ``model`` (whole again, so no
        split reaches what reads it); the weight, its update and its FLOPs are divided. (Split on its
        output dim instead, the partitioner carries the split into what reads the output: 1.4-1.8x
        the bytes for a small DiT.)

        Only where the weight outweighs its activations (all the batch's, in and out) `OUTWEIGHS`
        times over: a large matrix applied to a vector an example, as DiT's adaLN modulation is (cut
        by jnp.split into shifts, scales and gates for a stream that is not split). Over every
        token's activations (DiT's fused QKV, sliced into q, k and v) the partitioner carries the
        input's slicing back into the residual stream that makes it, which the estimate does not
        see: split alone, it moved 1.13x / 1.09x the bytes of it whole at 2 / 4 shards. Not for a
        weight with several uses or a lookup (a tied embedding), one a loop's body reads every trip
        (a recurrent cell), a conv, or one under `QUIET_SHARE` of the model. True when it finished
        the leaf."""
        if self.pricing is None or role.refused is not None or role.priced or k in self.facts.looped \
                or k in self.facts.lookups:
            return False
        uses = [u for u in self.facts.uses if u.leaf == k]  # one product, read once or per fixed-point round
        full, (act_in, act_out) = self._full(k), self.facts.activation_bytes(k)
        if len(self.facts.traffic.get(k, {})) != 1 or any(u.kind != "matmul" for u in uses) or \
                math.prod(full.shape) < QUIET_SHARE * self.size or \
                OUTWEIGHS * (act_in + act_out) > self.facts.nbytes(k):
            return False
        dims = [d for d in uses[0].contracted if full.shape[d] % self.n_model == 0]
        split, whole, runs = self._estimate(k)
        if not dims or split > CLEARLY_CHEAPER * whole:
            return False
        saved = human_bytes(whole - split)
        self.finish(k, split_spec(full.ndim, dims[0]),
                    f"{role.reason}; but split alone on dim {dims[0]}, the input features it contracts (its "
                    f"output summed over 'model', whole again): it costs {saved} less a step than whole "
                    f"(estimated in bytes, FLOPs and {runs} collective(s) more: split {human_bytes(split)}, "
                    f"whole {human_bytes(whole)})",
                    whole=True, short=f"row parallel alone: {saved} less than whole (estimated)")
        return True

    def small(self, k: int) -> None:
        _, kp, one, n = self.leaves[k]
        parts = path_parts(kp)
        role = self.roles.get(k)
        if role is not None:
            return self.from_program(k, role, ".".join(parts[:-1]))
        if ".".join(parts[:-1]) in self.program_layers:  # not beside its layer's split output
            return self.finish(k, P(), "replicated (the program applies it to an activation that is not split)",
                               short="replicated: its activation is not split")
        dim = self.weight_dims.get(".".join(parts[:-1]))
        spec, reason = small_leaf_spec(parts, one, dim, self.vocab, self.n_model)
        self.finish(k, spec, reason)


def leaf_specs(model, mesh: Mesh, overrides=(), fsdp: bool = False, name: str | None = None, facts=None):
    """Returns ``(treedef, [LeafSpec | None per leaf], fallbacks, unplaced, advice)``;
    ``fallbacks`` are ``(path and shape, why, loud)`` for leaves replicated because
    ``n_model_shards`` cannot split them as the rules would, ``unplaced`` the
    weights names alone could not place (without a program), ``advice`` warnings
    about what the plan leaves on the table (`advice`)."""
    decider = _Decider(model, mesh, overrides, fsdp, name, facts)
    decider.run()
    flat, treedef = jax.tree_util.tree_flatten(model)
    decided = [decider.decided.get(i) for i in range(len(flat))]
    unplaced = decider.unplaced
    if decider.unread is not None:
        count, reason, fused = decider.unread
        unplaced = [f"<program> {count} weights contracted, none split (first: {reason})"] + [fused] * bool(fused)
    return treedef, decided, decider.fallbacks, unplaced, advice(decider)


# A leaf replicated because n_model_shards cannot split it is not warned about when whole is what
# costs least anyway and it holds at most this share of the model's parameters.
QUIET_WHOLE_SHARE = 0.1
# Weights kept whole because that costs less than their split may take this much of each
# device's memory in all (their parameters, gradients and two optimizer moments: 64M float32
# parameters; and the hidden activations a block kept whole holds, `_pricing.held_whole`): a small
# model's convs, embeddings and heads, never a large model's blocks or tables
# (which are why it is split). A constant, not the device's own figure, so that every process of a
# run, whatever its devices report, makes the same plan.
WHOLE_MEMORY_BYTES = 1 << 30


def memory_budget(mesh: Mesh) -> float:
    """`WHOLE_MEMORY_BYTES`, the same on every mesh and process."""
    del mesh
    return float(WHOLE_MEMORY_BYTES)


# A weight split alone (`_Decider._split_alone`) holds at least this many times the bytes of the
# activations its product reads and writes in a step (the whole batch's).
OUTWEIGHS = 8


def split_cost(facts, k: int, n_batch: int, n_model: int, paired: bool = False) -> tuple[float, float]:
    """What weight ``k`` costs one device a step, in bytes, split over ``model`` without a proven
    partner and whole: ``(split, whole)``; its products' FLOPs (forward and backward, ``1 / n_model``
    of them split) count as in `_pricing.block_costs` (`_pricing.work`).

    - Split (its input whole, as the program does not prove it split; its output met by an op that
      needs it whole): each product reads its input sliced (free) and its output is gathered (an
      all-gather or an all-reduce of the output's bytes); backward, the input's gradient is gathered
      too (its bytes). One device holds ``1 / n_batch`` of the batch's activations.
    - ``paired``: split as one of a column/row pair (the layout the program could not prove, as a
      fused Q/K/V or a GLU's value and gate cut by index), so only the narrower side is summed: a
      row's output forward, or a column's input gradient backward.
    - Both: the weight's gradient is summed over the devices that split the batch (``n_batch > 1``),
      whole or ``1 / n_model`` of it.
    """
    act_in, act_out = facts.activation_bytes(k)
    grad = facts.nbytes(k) if n_batch > 1 else 0
    whole = grad + work(facts, [k], n_batch)
    moved = min(act_in, act_out) if paired else act_in + act_out
    return moved / n_batch + whole / n_model, float(whole)


# A block the program leaves wholly replicated is said when its matmul weights hold more than this
# share of the model's bytes and splitting them would cost less (by `split_cost`'s estimate):
# a mixer's fused in_proj cut by jnp.split, not a small recurrent cell that costs least whole.
REPLICATED_SHARE = 0.01


def replicated_blocks(d: _Decider) -> str | None:
    """Modules with matmul weights the program read (`_blocks`), all of them replicated (no
    override), holding over `REPLICATED_SHARE` of the model, that would cost less split: which, what
    that would save, and the first reason. Each weight is priced split alone (`split_cost`), and
    those that would cost less are counted; a block whose features are cut by index (a fused Q/K/V
    of the (3, heads, head_dim) layout, a GLU's chunk(2)) is priced as the column/row pair its other
    layout splits into (`_block_costs`): alone, each of a ViT-B's attention weights costs more split
    than whole at 32 images a step, while the pair per head costs 0.87x whole (estimated; compiled,
    whole moves 0.86x the bytes for 1.33x the FLOPs and 1.25x the peak memory at 2 shards:
    `benchmarks/fused_layouts.py`). A block partly split counts its whole weights where one is cut
    by index: DiT's block as written (its fused QKV whole beside a split MLP; per head, 0.84x / 0.64x
    the bytes at 2 / 4 shards) or raw arrays at the root beside a split head."""
    if d.facts is None or d.n_model == 1 or d.unread is not None:
        return None
    by_block = _blocks(d, [use.leaf for use in d.facts.uses if use.kind == "matmul"])
    sizes = {k: math.prod(x.shape) * x.dtype.itemsize for k, x in enumerate(d.arrays)}
    total = sum(sizes.values())
    whole = {}
    for block, leaves in by_block.items():
        left = [k for k in leaves if not (_splits(d, k) or _overridden(d, k))]
        if len(left) < len(leaves) and not any(_cut(d, k) for k in left):
            continue  # partly split (raw arrays at the root with a split head): said where a piece is cut
        leaves, roles = left, [d.roles.get(k) for k in left]
        if len(leaves) >= 2 and all(r is not None and r.dim is None and r.refused is None for r in roles):
            costs, lost, cut = _block_costs(d, leaves)
            held = sum(sizes[k] for k in leaves)
            if held > REPLICATED_SHARE * total and lost > 0:
                dearest = max(leaves, key=lambda k: costs[k][1] - costs[k][0])
                name = block if block != "<root>" else "+".join(d.facts.paths[k] for k in leaves)
                whole[name] = (held, lost, f"{d.facts.paths[dearest]}: {roles[leaves.index(dearest)].short}", cut)
    if not whole:
        return None
    names = sorted(whole)
    held, lost = sum(w[0] for w in whole.values()), sum(w[1] for w in whole.values())
    cut = [w[3] for w in whole.values()]
    return (f"the program's plan leaves {len(names)} block(s) with matmuls wholly replicated at n_model_shards="
            f"{d.n_model}: {_listed(names)} ({human_bytes(held)} of {human_bytes(total)} of weights; split, they "
            f"would cost about {human_bytes(lost)} less a step (estimated); {whole[names[0]][2]}). Every device "
            "holds and computes them whole" + ("" if all(cut) else "; to split them, pass overrides=[(regex, spec)] "
                                               "(redeqx.explain(..., reasons='full') gives each weight's reason)")
            + "." + (FUSED if any(cut) else ""))


def _blocks(d: _Decider, leaves) -> dict[str, list[int]]:
    """``leaves`` by block: the innermost module that holds a weight's layer and at least one other
    of ``leaves``. A layer alone in its parent joins the module above it, so an attention written
    with its output projection in a ``Sequential`` (vit-pytorch's ``to_out``) is one block with its
    fused Q/K/V."""
    layers = {k: weight_layer(d.facts.paths[k].split(".")) for k in dict.fromkeys(leaves)}
    holding = collections.Counter(tuple(layer[:end]) for layer in layers.values() for end in range(len(layer)))
    by_block: dict[str, list[int]] = {}
    for k, layer in layers.items():
        end = max(len(layer) - 1, 0)
        while end > 0 and holding[tuple(layer[:end])] < 2:
            end -= 1
        by_block.setdefault(".".join(layer[:end]) or "<root>", []).append(k)
    return by_block


def _block_costs(d: _Decider, leaves) -> tuple[dict[int, tuple[float, float]], float, bool]:
    """Each of a block's whole ``leaves`` split and whole (`_Decider._estimate`), what splitting
    them would save, and whether the block is a fused projection cut by index (its features cut
    into pieces): priced as the column/row pair its other layout splits into (the block one choice),
    else each weight split alone (each its own choice, those that would save counted)."""
    cut = any(_cut(d, k) for k in leaves)
    costs = {k: d._estimate(k, paired=cut)[:2] for k in leaves}
    lost = (sum(whole - split for split, whole in costs.values()) if cut else
            sum(max(0.0, whole - split) for split, whole in costs.values()))
    return costs, lost, cut


FUSED = (
    " A projection cut by index into pieces (q, k and v by timm's reshape or a chunk(3); a GLU's value "
    "and gate by a chunk(2) or jnp.split) stores all of one piece's rows, then the next's, so no "
    "PartitionSpec gives a device matching parts of every piece: reshape its output so the pieces are an inner dim, "
    "(..., heads, 3, head_dim) for attention, (..., hidden, 2) for a GLU, and index it, or give each "
    "piece a layer of its own, and the rules split it Megatron's way (the layouts train alike from "
    "scratch; a checkpoint's rows need reordering).")


def _cut(d: _Decider, k: int) -> bool:
    """Whether the program read weight ``k``'s output features cut by index (a fused projection)."""
    return k in d.roles and CUTS_FEATURES in d.roles[k].reason


def _overridden(d: _Decider, k: int) -> bool:
    """Whether the user placed weight ``k`` (an override: said where it goes, nothing to warn about)."""
    return d.decided[d.leaves[k][0]].reason.startswith("override")


def _splits(d: _Decider, k: int) -> bool:
    spec = d.decided[d.leaves[k][0]].spec
    return any(MODEL in axes_of(entry) for entry in spec if entry is not None)


def flax_kernels(d: _Decider) -> str | None:
    """Weights named ``kernel`` (Flax and Haiku store ``(in, out)``) that names split as ``(out, in)``."""
    if not d.kernels or d.n_model == 1:
        return None
    return (f"{len(d.kernels)} weight(s) named 'kernel' are split by their names as Equinox's (out, in) "
            f"weights: {_listed(d.kernels)}. Flax and Haiku store "
            "kernels (in, out), which the names would split transposed (column for row). Pass loss_fn= and "
            "batch= so the program reads which dim each kernel contracts.")


def _listed(items: list[str], most: int = 4) -> str:
    return ", ".join(items[:most]) + (f" and {len(items) - most} more" if len(items) > most else "")


ADVICE = (replicated_blocks, flax_kernels)


def advice(d: _Decider) -> list[str]:
    return [text for rule in ADVICE if (text := rule(d)) is not None]
