"""A mixture-of-experts feed-forward block: dropless top-k routing computed by
grouped matmuls (megablox's kernels on a TPU, JAX's Mosaic GPU kernels on a
Hopper GPU, ``jax.lax.ragged_dot`` elsewhere), never a dense pass of every
token through every expert.

How a block runs on the tokens ``x`` of one sequence (``T`` tokens, ``k``
experts each):

1. the router scores every token against every expert (``(T, E)`` logits, a
   small matmul) and keeps each token's ``k`` best;
2. the ``T * k`` (token, expert) assignments are sorted by expert, so that each
   expert's tokens sit together: their rows of ``x`` are gathered in that
   order and ``bincount`` gives each expert's group size;
3. three grouped matmuls (gate, up, down) multiply each group by its own
   expert's weights only: ``T * k`` rows of FLOPs, not ``T * E``, and no token
   is ever dropped (no capacity factor);
4. the outputs go back to assignment order and each token's ``k`` outputs are
   summed with its routing weights (`mix_experts` does steps 2-4).

(The grouped matmul is chosen in one place, `redeqx.models._grouped`, by
`redeqx.models._grouped.choose`. On a TPU it runs megablox's Pallas kernels
(``jax.experimental.pallas.ops.tpu``, as MaxText does): ``gmm`` for the
products and input gradients, ``tgmm`` for the weight gradients, which
multiplies each expert's gradient by that expert's rows only (XLA's
``ragged_dot`` weight gradient is a product over every expert). On an
NVIDIA Hopper GPU (sm_90 with 132 SMs: H100 SXM, H200) and bfloat16 or
float16 operands it runs JAX's Mosaic GPU kernels, ``ragged_dot_mgpu`` and
``transposed_ragged_dot_mgpu``, the same way. Either runs wherever each device
holds the operands whole (in the ``shard_map`` of `_batched_rule`, or on one
device); elsewhere ``jax.lax.ragged_dot``, which JAX 0.10 lowers on CPUs as a
masked product over every group, E times the FLOPs, as XLA does on NVIDIA
GPUs (its RaggedDotRewriter); on a GPU a warning names why, once per reason.)

``jax.lax.ragged_dot`` cannot be vmapped over its rows here (its batching
rule needs every operand batched, the weights too, which would copy each
expert per sequence). Since nothing in steps 2-4 mixes tokens, a batch of
sequences is routed as one long sequence: under ``jax.vmap`` the expert
computation (`mix_experts`) flattens the batch into its token axis
(``jax.custom_batching.custom_vmap``), and its gradient is written with
``jax.custom_vjp`` (``custom_vmap`` has no reverse mode of its own), the
backward pass recomputing the grouped forward matmuls of the block rather
than storing them. Traced under a mesh (as redeqx's steps are), the run is
one per ``data`` shard (and per ``context`` shard, on a mesh that splits
sequences), and when ``model`` divides the experts (the rules
then split the stacks on E) each device multiplies only its own experts'
rows, one all-reduce over ``model`` of the block's output completing it
(`_batched_rule`).

The load-balancing loss (Switch Transformer, eqs. 4-6; what Mixtral and
Qwen3-MoE train with) and the router z-loss (ST-MoE, eq. 5) come out as
`RouterStats`: sums per sequence that `RouterStats.load_balancing_loss` and
`RouterStats.z_loss` combine over the whole batch, as Transformers'
``load_balancing_loss_func`` does.

Layout: ``gate_proj``/``up_proj`` ``(E, intermediate, hidden)`` and
``down_proj`` ``(E, hidden, intermediate)`` (each expert's PyTorch layout),
under a field named ``experts`` beside a router named ``gate``: the sharding
rules split every stack on its expert axis when ``n_model_shards`` divides
``E`` (on the hidden units otherwise) and replicate the router.
"""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from ..mesh import CONTEXT, DATA, MODEL, traced_platform
from .._typing import positive_int, typechecked
from ._grouped import grouped, provisional
from ._layers import ACTIVATIONS, INIT_STD, Linear

# ----------------------------------------------------------------------------- the grouped expert computation

# The name scope of the backward pass's recompute of the experts' forward (which XLA merges with the
# forward's identical products unless the step is rematerialised).
RECOMPUTE = "moe_backward_recompute"

def _flat(activation: str, shards: int, x, idx, w, gate_w, up_w, down_w):
    """Each token's experts' outputs weighted by ``w`` and summed, ``(T, hidden)``,
    for tokens ``x`` ``(T, hidden)``, their experts ``idx`` and weights ``w``
    ``(T, k)``: the assignments sorted, grouped, unsorted.

    With ``shards > 1`` (inside a ``shard_map`` manual over ``model``) the
    weights are this device's ``E / shards`` experts: only their assignments
    are computed (a contiguous run of the sorted rows, rolled to the front so
    the grouped matmuls start at it), the others come out zero, and a sum over
    ``model`` completes the output."""
    t, k = idx.shape
    local = gate_w.shape[0]
    expert = idx.reshape(-1)  # (T*k,) the expert of each assignment, token-major
    order = jnp.argsort(expert, stable=True)  # assignments grouped by expert
    sizes = jnp.bincount(expert, length=local * shards).astype(jnp.int32)  # (E,)
    rows = jnp.take(x, order // k, axis=0)  # (T*k, H) each assignment's token, in expert order
    if shards > 1:
        first = jax.lax.axis_index(MODEL) * local  # this device's first expert
        start = jnp.sum(jnp.where(jnp.arange(sizes.shape[0]) < first, sizes, 0))  # its first row
        sizes = jax.lax.dynamic_slice_in_dim(sizes, first, local)
        rows = jnp.roll(rows, -start, axis=0)
    h = ACTIVATIONS[activation](grouped(rows, gate_w, sizes)) * grouped(rows, up_w, sizes)  # (T*k, I)
    y = grouped(h, down_w, sizes)  # (T*k, H), zero past this device's groups
    if shards > 1:
        y = jnp.roll(y, start, axis=0)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    y = jnp.take(y, inverse, axis=0).reshape(t, k, -1)  # back to assignment order, (T, k, H)
    return jnp.einsum("tkh,tk->th", y, w.astype(y.dtype))


def _shards(axis: str, n: int) -> int:
    """How many shards of mesh axis ``axis`` (of the mesh a step is traced under:
    `redeqx.make_step` sets it) split ``n`` things: its size when that divides
    ``n`` and the axis is not manual already; else 1."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or axis not in mesh.axis_names or axis in mesh.manual_axes:
        return 1
    size = mesh.shape[axis]
    return size if size > 1 and n % size == 0 else 1


def _psum(x, axes: tuple[str, ...]):
    """``x`` summed over the mesh axes ``axes`` (itself for none)."""
    if not axes:
        return x
    # in float32 on CPU: XLA:CPU aborts on a bfloat16 all-reduce here (AllReducePromotion, JAX 0.10)
    if x.dtype == jnp.float32 or traced_platform() != "cpu":
        return jax.lax.psum(x, axes)
    return jax.lax.psum(x.astype(jnp.float32), axes).astype(x.dtype)


# What each custom_vmap function takes and gives: (how many leading arguments are per token,
# which outputs are per token; the others are the weights' gradients, sums over tokens).
_FORWARD = (3, (True,))
_BACKWARD = (4, (True, True, False, False, False))


def _batched_rule(activation: str, shards: int, kind):
    """A ``custom_vmap`` rule for the forward or backward function (``kind``)
    of `_functions(activation, shards)`, whose first arguments are per token
    and whose others are the expert weights.

    A batch of sequences is one longer run of tokens. Under a mesh, that run is
    cut by a ``shard_map``: over ``data`` (when it divides the batch) each data
    shard routes its own rows, and over ``context`` (when it divides the
    sequence, dim 1: a mesh that splits sequences) each context shard its own
    tokens, so the expert FLOPs divide over both as the rest of the step's do
    (tokens are routed independently: no shard needs another's); over
    ``model`` (when it divides the experts, as the rules then split the stacks) each device computes only its own experts'
    rows and one sum over ``model`` completes the output, as a row-parallel
    layer's all-reduce does. Tokens need no all-to-all: the activations are
    already on every device of a model group. Weights that are themselves
    batched (a vmap over models) go one batch entry at a time."""
    n_tokens, per_token = kind

    def flat(fn, tokens, weights):
        b, t = tokens[0].shape[:2]
        outs = fn(*(a.reshape(b * t, *a.shape[2:]) for a in tokens), *weights)
        return tuple(o.reshape(b, t, *o.shape[1:]) if p else o for o, p in zip(outs, per_token))

    @provisional(False)  # what the rule traces runs
    def rule(axis_size, in_batched, *args):
        fn = _functions(activation, shards)[kind is _BACKWARD]
        tokens, weights = args[:n_tokens], args[n_tokens:]
        if any(in_batched[n_tokens:]):  # per-entry weights: no shared experts to group by
            full = [a if b else jnp.broadcast_to(a, (axis_size, *a.shape)) for a, b in zip(args, in_batched)]
            outs = jax.lax.map(lambda xs: fn(*xs), tuple(full))
            return outs, jax.tree.map(lambda _: True, outs)
        tokens = tuple(a if b else jnp.broadcast_to(a, (axis_size, *a.shape)) for a, b in zip(tokens, in_batched))
        data, context = _shards(DATA, axis_size), _shards(CONTEXT, tokens[0].shape[1])
        model = _shards(MODEL, weights[0].shape[0]) if shards == 1 else 1
        if data == context == model == 1:
            return flat(fn, tokens, weights), per_token
        inner = _functions(activation, model if model > 1 else shards)[kind is _BACKWARD]
        split = tuple(a for a, n in ((DATA, data), (CONTEXT, context)) if n > 1)  # the axes cutting the tokens

        def on_shard(tokens, weights):  # per-token outputs summed over the experts' shards, weights' over the rows'
            outs = flat(inner, tokens, weights)
            return tuple(_psum(o, (MODEL,) if model > 1 else ()) if p else _psum(o, split)
                         for o, p in zip(outs, per_token))

        rows = P(DATA if data > 1 else None, CONTEXT if context > 1 else None)
        stacks = P(MODEL) if model > 1 else P()
        axes = {*split, *((MODEL,) if model > 1 else ())}
        # check_vma=False: custom_vmap_call types its outputs as invariant whatever its inputs, so under
        # checking a psum would read the weights' gradients as already summed and multiply them by the
        # shard count (JAX 0.10). Under jit: called eagerly, a partly manual shard_map trips over the
        # other axis.
        outs = jax.jit(jax.shard_map(on_shard, in_specs=(rows, stacks), axis_names=axes, check_vma=False,
                                     out_specs=tuple(rows if p else stacks for p in per_token)))(tokens, weights)
        return outs, per_token

    return rule


@functools.lru_cache(maxsize=None)
def _functions(activation: str, shards: int):
    """The forward and backward of `mix_experts` for one activation, each a
    ``custom_vmap`` (`_batched_rule`); ``shards > 1``: on one device's share
    of the experts inside a ``shard_map`` over ``model`` (`_flat`)."""

    @jax.custom_batching.custom_vmap
    def forward(x, idx, w, gate_w, up_w, down_w):
        return (_flat(activation, shards, x, idx, w, gate_w, up_w, down_w),)

    forward.def_vmap(_batched_rule(activation, shards, _FORWARD))

    @jax.custom_batching.custom_vmap
    def backward(x, idx, w, ct, gate_w, up_w, down_w):
        with jax.named_scope(RECOMPUTE):  # the FLOP count (redeqx.planner._grouped_flops) knows these by it
            _, vjp = jax.vjp(lambda x, w, g, u, d: _flat(activation, shards, x, idx, w, g, u, d),
                             x, w, gate_w, up_w, down_w)
        return vjp(ct)  # (dx, dw, dgate, dup, ddown): dx, dw per token, the stacks' summed over tokens

    backward.def_vmap(_batched_rule(activation, shards, _BACKWARD))
    return forward, backward


@functools.lru_cache(maxsize=None)
def _mix_experts_fn(activation: str):
    """`mix_experts` for one activation: a ``custom_vjp`` (``custom_vmap``
    has no reverse mode) whose forward and backward are `_functions`'."""
    forward, backward = _functions(activation, 1)

    @jax.custom_vjp
    @provisional()  # under jax.vmap, custom_vmap traces forward's body and then runs its rule instead
    def outputs(x, idx, w, gate_w, up_w, down_w):
        return forward(x, idx, w, gate_w, up_w, down_w)[0]

    def fwd(x, idx, w, gate_w, up_w, down_w):
        return outputs(x, idx, w, gate_w, up_w, down_w), (x, idx, w, gate_w, up_w, down_w)

    def bwd(res, ct):
        x, idx, w, gate_w, up_w, down_w = res
        with provisional():
            dx, dw, dg, du, dd = backward(x, idx, w, ct, gate_w, up_w, down_w)
        return dx, None, dw, dg, du, dd

    outputs.defvjp(fwd, bwd)
    return outputs


@typechecked
def mix_experts(
    x: Float[Array, "seq hidden"],
    expert_index: Int[Array, "seq k"],
    expert_weights: Float[Array, "seq k"],
    gate_proj: Float[Array, "experts intermediate hidden"],
    up_proj: Float[Array, "experts intermediate hidden"],
    down_proj: Float[Array, "experts hidden intermediate"],
    *,
    activation: str = "silu",
) -> Float[Array, "seq hidden"]:
    """``sum_j w[t, j] * down[e] @ (act(gate[e] @ x_t) * (up[e] @ x_t))`` with
    ``e = expert_index[t, j]`` and ``w = expert_weights``, for each token ``t``:
    grouped matmuls over the assignments sorted by expert (dropless: each
    computed, by its own expert only). Differentiable in ``x``, the weights and
    the stacks. Under ``jax.vmap`` the batch is routed as one run of tokens (one
    per data shard under a mesh, each device computing its own experts when
    ``model`` divides them), so no expert's weights are copied per sequence."""
    f = _mix_experts_fn(activation)
    return f(x, expert_index, expert_weights, gate_proj.astype(x.dtype), up_proj.astype(x.dtype),
             down_proj.astype(x.dtype))


# ----------------------------------------------------------------------------- router statistics and auxiliary losses


class RouterStats(eqx.Module):
    """What the auxiliary losses need from the routers, summed over the tokens
    (and mixture-of-experts layers) of one sequence; under ``jax.vmap`` every
    field gains the batch axes, and the losses sum over all of them first.

    - ``tokens_per_expert``: top-k assignments each expert got;
    - ``probs_per_expert``: router probabilities each expert got, summed;
    - ``rows``: tokens routed (padding excluded), once per layer;
    - ``z``: the sum of ``logsumexp(router_logits) ** 2``.
    """

    tokens_per_expert: Float[Array, "*batch experts"]
    probs_per_expert: Float[Array, "*batch experts"]
    rows: Float[Array, "*batch"]
    z: Float[Array, "*batch"]

    @staticmethod
    def zeros(n_experts: int) -> "RouterStats":
        z = jnp.zeros((), jnp.float32)
        return RouterStats(jnp.zeros((n_experts,), jnp.float32), jnp.zeros((n_experts,), jnp.float32), z, z)

    def __add__(self, other: "RouterStats") -> "RouterStats":
        return jax.tree.map(jnp.add, self, other)

    def _totals(self):
        def lead(a, keep):  # sum every leading (batch / layer) axis
            return jnp.sum(a, axis=tuple(range(a.ndim - keep)))

        return (lead(self.tokens_per_expert, 1), lead(self.probs_per_expert, 1), lead(self.rows, 0),
                lead(self.z, 0))

    def load_balancing_loss(self) -> Float[Array, ""]:
        """Switch Transformer's auxiliary loss, ``E * sum_e f_e * P_e``: ``f_e``
        the share of top-k assignments expert ``e`` got, ``P_e`` its mean router
        probability, over every token of the batch and every layer (as
        Transformers' ``load_balancing_loss_func``; 1.0 when balanced at k=1)."""
        counts, probs, rows, _ = self._totals()
        rows = jnp.maximum(rows, 1.0)
        return counts.shape[-1] * jnp.sum((counts / rows) * (probs / rows))

    def z_loss(self) -> Float[Array, ""]:
        """ST-MoE's router z-loss: the mean over tokens (and layers) of
        ``logsumexp(router_logits) ** 2``, which keeps the router's logits small."""
        _, _, rows, z = self._totals()
        return z / jnp.maximum(rows, 1.0)


@typechecked
def route(
    logits: Float[Array, "seq experts"], k: int, *, normalize: bool
) -> tuple[Float[Array, "seq k"], Int[Array, "seq k"]]:
    """Each token's ``k`` most probable experts and their weights: softmax
    probabilities over all experts, renormalised over the ``k`` kept when
    ``normalize`` (Mixtral; Qwen3-MoE's ``norm_topk_prob``)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, index = jax.lax.top_k(probs, k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, index


@typechecked
def router_stats(logits: Float[Array, "seq experts"], index: Int[Array, "seq k"],
                 valid: Bool[Array, " seq"] | None = None) -> RouterStats:
    """The `RouterStats` of one layer's routing of one sequence (``valid``
    False: a padding token, not counted)."""
    logits = logits.astype(jnp.float32)
    w = jnp.ones(logits.shape[:1], jnp.float32) if valid is None else valid.astype(jnp.float32)
    n_experts = logits.shape[-1]
    counts = jnp.einsum("tke,t->e", jax.nn.one_hot(index, n_experts, dtype=jnp.float32), w)
    probs = jnp.einsum("te,t->e", jax.nn.softmax(logits, axis=-1), w)
    z = jnp.sum(w * jnp.square(jax.nn.logsumexp(logits, axis=-1)))
    return RouterStats(jax.lax.stop_gradient(counts), probs, jnp.sum(w), z)


# ----------------------------------------------------------------------------- the block


class Experts(eqx.Module):
    """``E`` SwiGLU experts, each expert's weights a slice of the stacks."""

    gate_proj: Float[Array, "experts intermediate hidden"]
    up_proj: Float[Array, "experts intermediate hidden"]
    down_proj: Float[Array, "experts hidden intermediate"]

    def __init__(self, n_experts: int, hidden: int, intermediate: int, *, key: PRNGKeyArray, dtype=jnp.float32,
                 std: float = INIT_STD):
        kg, ku, kd = jax.random.split(key, 3)
        self.gate_proj = std * jax.random.normal(kg, (n_experts, intermediate, hidden), dtype)
        self.up_proj = std * jax.random.normal(ku, (n_experts, intermediate, hidden), dtype)
        self.down_proj = std * jax.random.normal(kd, (n_experts, hidden, intermediate), dtype)

    def stacks(self):
        """The ``(gate_proj, up_proj, down_proj)`` stacks the experts multiply by."""
        return self.gate_proj, self.up_proj, self.down_proj


class LowRank(eqx.Module):
    """One stack's LoRA adapters, one pair per expert: ``A`` ``(E, rank, in)``, ``B`` ``(E, out, rank)``."""

    lora_a: Float[Array, "*experts rank in"]
    lora_b: Float[Array, "*experts out rank"]


class LoRAExperts(eqx.Module):
    """`Experts` with LoRA adapters (`redeqx.models.lora` puts it in place):
    each expert multiplies by ``W + scale * B A``, its own pair of adapters,
    ``B`` zero at first; the stacks keep their paths, so the rules and
    checkpoint names do not move, and `redeqx.models.merge_lora` folds it back."""

    gate_proj: Float[Array, "experts intermediate hidden"]
    up_proj: Float[Array, "experts intermediate hidden"]
    down_proj: Float[Array, "experts hidden intermediate"]
    gate_proj_lora: LowRank
    up_proj_lora: LowRank
    down_proj_lora: LowRank
    scale: float = eqx.field(static=True)
    base: eqx.Module = eqx.field(static=True)  # the replaced Experts with abstract arrays, for merge_lora

    def _adapted(self, dtype=None):
        def adapted(w, low: LowRank):
            dt = dtype or w.dtype
            delta = jnp.einsum("...eor,...eri->...eoi", low.lora_b.astype(dt), low.lora_a.astype(dt))
            return w.astype(dt) + jnp.asarray(self.scale, dt) * delta

        return (adapted(self.gate_proj, self.gate_proj_lora), adapted(self.up_proj, self.up_proj_lora),
                adapted(self.down_proj, self.down_proj_lora))

    def stacks(self):
        """The adapted stacks, ``W + scale * B A`` per expert (formed per step: the grouped
        matmuls then run once per stack, and the adapters' gradients come through this sum)."""
        return self._adapted()

    def merged(self) -> Experts:
        """The plain `Experts` these adapters fold into, summed in float32 (`redeqx.models.merge_lora`)."""
        owns = (self.gate_proj, self.up_proj, self.down_proj)
        stacks = tuple(w.astype(own.dtype) for w, own in zip(self._adapted(jnp.float32), owns))
        return eqx.tree_at(lambda e: (e.gate_proj, e.up_proj, e.down_proj), self.base, stacks)


def lora_experts(experts: Experts, *, rank: int, alpha: float, key: PRNGKeyArray) -> LoRAExperts:
    """``experts`` with a LoRA pair per expert and stack (``A`` Kaiming-uniform as PEFT, ``B`` zero)."""

    def low(w, k):
        *lead, out_features, in_features = w.shape  # lead: (layers,) experts
        bound = 1.0 / in_features**0.5
        a = jax.random.uniform(k, (*lead, rank, in_features), jnp.float32, -bound, bound).astype(w.dtype)
        return LowRank(a, jnp.zeros((*lead, out_features, rank), w.dtype))

    kg, ku, kd = jax.random.split(key, 3)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype) if eqx.is_array(a) else a, experts)
    return LoRAExperts(experts.gate_proj, experts.up_proj, experts.down_proj, low(experts.gate_proj, kg),
                       low(experts.up_proj, ku), low(experts.down_proj, kd), float(alpha) / rank, abstract)


class MoE(eqx.Module):
    """A mixture-of-experts feed-forward block for one sequence: top-``k``
    routing, dropless, computed by grouped matmuls (the module docstring says
    how). Returns the output and the `RouterStats` of this call, from which
    the load-balancing and z losses are read.

    ``normalize_top_k``: renormalise each token's ``k`` routing weights to sum
    to 1 (Mixtral does; Qwen3-MoE when ``norm_topk_prob``). ``activation``:
    a Hugging Face activation name (``"silu"``: SwiGLU experts).

    **Example** (in a user's own transformer block):

    ```python
    moe = redeqx.models.MoE(hidden=64, intermediate=128, n_experts=8, k=2, key=jax.random.key(0))
    y, stats = moe(x)                                   # x: (seq, 64)
    ys, stats = jax.vmap(moe)(xs)                       # xs: (batch, seq, 64); one routing for the batch
    aux = 0.01 * stats.load_balancing_loss() + 0.001 * stats.z_loss()
    ```
    """

    gate: Linear  # the router, (E, hidden): replicated by the rules
    experts: Experts | LoRAExperts
    k: int = eqx.field(static=True)
    normalize_top_k: bool = eqx.field(static=True)
    activation: str = eqx.field(static=True)

    @typechecked
    def __init__(self, hidden: int, intermediate: int, n_experts: int, k: int, *, key: PRNGKeyArray,
                 normalize_top_k: bool = True, activation: str = "silu", dtype=jnp.float32):
        for name, value in (("hidden", hidden), ("intermediate", intermediate), ("n_experts", n_experts), ("k", k)):
            positive_int(value, f"MoE {name}")
        if k > n_experts:
            raise ValueError(f"MoE k={k} is more experts per token than n_experts={n_experts}; pass k <= n_experts.")
        if activation not in ACTIVATIONS:
            raise ValueError(f"MoE activation={activation!r}; pass one of {sorted(ACTIVATIONS)}.")
        kr, ke = jax.random.split(key)
        self.gate = Linear(hidden, n_experts, bias=False, key=kr, dtype=dtype)
        self.experts = Experts(n_experts, hidden, intermediate, key=ke, dtype=dtype)
        self.k = k
        self.normalize_top_k = normalize_top_k
        self.activation = activation

    @property
    def n_experts(self) -> int:
        return self.gate.weight.shape[-2]

    def __call__(
        self, x: Float[Array, "seq hidden"], *, valid: Bool[Array, " seq"] | None = None
    ) -> tuple[Float[Array, "seq hidden"], RouterStats]:
        """``x`` through each token's ``k`` experts, weighted; ``valid`` marks
        real tokens for the statistics (padding is routed but not counted)."""
        logits = x.astype(jnp.float32) @ self.gate.weight.T.astype(jnp.float32)  # (T, E), in float32
        weights, index = route(logits, self.k, normalize=self.normalize_top_k)  # (T, k) each
        gate_proj, up_proj, down_proj = self.experts.stacks()
        y = mix_experts(x, index, weights, gate_proj, up_proj, down_proj, activation=self.activation)
        return y, router_stats(logits, index, valid)
