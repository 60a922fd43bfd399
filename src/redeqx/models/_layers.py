"""Small layers shared by the model families: one unbatched example at a time
(batch with ``jax.vmap``), weights in PyTorch's ``(out, in)`` layout so that
Hugging Face tensors load without a transpose and the sharding rules read
them as Equinox ``Linear`` weights."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from ..mesh import constrain
from .._typing import positive_int
from ..context import attention as split_attention, context_axis, fused_attention, masked_attention, sequence_positions
from ..mesh import CONTEXT, MODEL, traced_platform

INIT_STD = 0.02  # the initializer_range of the Hugging Face configs

# Every family's default layout: its layers stacked (one layer's arrays with a leading layer axis, run
# by a lax.scan) rather than listed. A stack compiles as one layer whatever the depth; its step does
# the same collectives and a few % more FLOPs (a stacked layer recomputes its elementwise
# intermediates in the backward pass) in no more activation memory than listed layers on XLA:CPU,
# and about as much on libtpu (less with redeqx.remat) but for one gradient's bytes, which a scan
# holds whole before the update where listed layers let libtpu update each layer as its gradient
# comes: it shows at small batches (benchmarks/RESULTS.md, "Stacked layers", and History: "A stack's
# extra temporaries on libtpu"); scan_layers=False lists the layers.
SCAN_LAYERS = True

# How a stack's lax.scan is compiled when a config leaves scan_unroll=None: one layer per loop
# iteration (1) on TPUs and CPUs, where the loop keeps compile time flat in depth; every layer
# unrolled (True) on GPUs, where XLA's while loop costs step time: the 1B LLaMA (22 layers, 8 x 2048
# tokens, bf16, cuDNN attention) took 246.5 ms a step as a loop, 247.9 unrolled by 2, 225.5 fully
# unrolled and 228.1 listed on one H200, compiling in 2.0, 2.1, 6.0 and 18.3 s (benchmarks/RESULTS.md,
# History: "Stacked layers on a GPU"). Either way the parameters keep the stacked layout, so a checkpoint,
# a plan's specs and the rules do not depend on where the model runs.
SCAN_UNROLL = {"gpu": True}

# Hugging Face's names for the feed-forward activations.
ACTIVATIONS = {
    "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),  # the tanh form
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "silu": jax.nn.silu,
}


def _last(v: Array, ndim: int) -> Array:
    """A ``(dim,)`` vector shaped to broadcast against the last axis of a rank-``ndim`` array."""
    return v.reshape((1,) * (ndim - 1) + v.shape)


class Linear(eqx.Module):
    """``y = x @ weight.T + bias`` with ``weight`` of shape ``(out, in)``."""

    weight: Float[Array, "out in"]
    bias: Float[Array, " out"] | None

    def __init__(self, n_in: int, n_out: int, *, bias: bool, key: PRNGKeyArray, dtype=jnp.float32,
                 std: float = INIT_STD):
        self.weight = std * jax.random.normal(key, (n_out, n_in), dtype)
        self.bias = jnp.zeros((n_out,), dtype) if bias else None

    def __call__(self, x: Float[Array, "*batch in"]) -> Float[Array, "*batch out"]:
        y = x @ self.weight.T.astype(x.dtype)
        return y if self.bias is None else y + _last(self.bias.astype(x.dtype), y.ndim)


@jax.custom_vjp
def gradients_summed_first(x):
    """``x`` itself, whose gradient from the layers that read this copy is
    summed before any other gradient of ``x`` joins it. Several
    column-parallel layers reading one input (Q, K and V) each give a partial
    sum over ``model``; GPU and TPU compilers reduce added partial sums with
    one all-reduce only when nothing else is added in between, which a
    residual connection around a post-norm block does (benchmarks/RESULTS.md,
    History: "Issue 21, the steps rebuilt")."""
    return x


gradients_summed_first.defvjp(lambda x: (x, None), lambda _, g: (g,))


def summed_linears(pairs: list) -> Float[Array, "seq out"]:
    """``sum(layer(x) for layer, x in pairs)`` for row-parallel layers whose
    outputs are added (GPT-J's attention and MLP outputs). With plain
    `Linear` layers the biases are added after the products' sum, so the
    products' partial sums over ``model`` meet in one add, which GPU and TPU
    compilers reduce with one all-reduce (a bias in between keeps them
    apart: benchmarks/RESULTS.md, History: "Issue 21, the
    steps rebuilt"). Any other module (a LoRA adapter) is called as it is."""
    if not all(type(layer) is Linear for layer, _ in pairs):
        return sum(layer(x) for layer, x in pairs)
    y = sum(x @ layer.weight.T.astype(x.dtype) for layer, x in pairs)
    for layer, _ in pairs:
        if layer.bias is not None:
            y = y + _last(layer.bias.astype(y.dtype), y.ndim)
    return y


def joined_linears(x: Float[Array, "*batch in"], layers: tuple, *, joined: bool = True) -> tuple:
    """``tuple(layer(x) for layer in layers)`` for column-parallel layers
    that read one input (a gated MLP's gate and up projections; an attention
    block's Q, K and V).

    With ``joined``, plain `Linear` layers of one shape and dtype are
    multiplied as one GEMM over their weights stacked, whose gradient is one
    tensor: XLA:GPU computes SwiGLU's two input gradients in one kernel, and
    ``x``'s gradient in one GEMM, where separate products take a GEMM each
    whose outputs are then added, and each GEMM reads ``x`` again
    (benchmarks/RESULTS.md, "XLA:GPU's programs for H100s"). Layers of
    another shape (the query heads of grouped-query attention beside K and
    V) are joined with their own kind or called alone. Under a step's compute
    dtype the stack is written by the weights' cast, at no cost; otherwise it
    is a copy of the weights at every call, which only a backward pass pays
    back: the zoo joins them in passes without a KV cache, and generation's
    passes (the prompt's, a token's) multiply each layer's weights as they
    are (``joined=False``). Any other module (a LoRA adapter) is called as it
    is."""
    groups: dict = {}
    for i, layer in enumerate(layers):
        alone = not joined or type(layer) is not Linear
        groups.setdefault(i if alone else (layer.weight.shape, layer.weight.dtype), []).append(i)
    out: list = [None] * len(layers)
    for members in groups.values():
        if len(members) == 1:
            out[members[0]] = layers[members[0]](x)
            continue
        stacked = jnp.stack([layers[i].weight for i in members]).astype(x.dtype)
        y = jnp.einsum("...i,koi->...ko", x, stacked)
        for k, i in enumerate(members):
            bias = layers[i].bias
            out[i] = y[..., k, :] if bias is None else y[..., k, :] + _last(bias.astype(x.dtype), x.ndim)
    return tuple(out)


class Embedding(eqx.Module):
    """A ``(vocab, dim)`` table; ``__call__`` looks rows up, `attend` is the tied LM head.

    An id outside ``0..vocab-1`` (a ``-1`` pad id left in the inputs, an id of
    another tokenizer) looks up a row of NaN: inside ``jit`` the ids' values
    cannot raise, and NaN makes the loss NaN, which `redeqx.Logger` reports,
    where PyTorch's ``nn.Embedding`` raises ``IndexError``. ``jnp.take`` alone
    would read ``-1`` as the last row (its fill mode wraps negative ids first)
    and train on it with a finite loss. Valid ids' rows and gradients are
    unchanged, and the lookup still runs on a table split over the vocabulary."""

    weight: Float[Array, "vocab dim"]

    def __init__(self, vocab: int, dim: int, *, key: PRNGKeyArray, dtype=jnp.float32, std: float = INIT_STD):
        self.weight = std * jax.random.normal(key, (vocab, dim), dtype)

    def __call__(self, ids: Int[Array, " seq"]) -> Float[Array, "seq dim"]:
        ids = jnp.asarray(ids)
        if jnp.issubdtype(ids.dtype, jnp.signedinteger) and jnp.iinfo(ids.dtype).bits < 32:
            ids = ids.astype(jnp.int32)  # room for the vocabulary's size below
        if jnp.issubdtype(ids.dtype, jnp.signedinteger):
            ids = jnp.where(ids < 0, self.weight.shape[0], ids)  # out of range, not wrapped: a row of NaN below
        return jnp.take(self.weight, ids, axis=0, mode="fill", fill_value=jnp.nan)

    def attend(self, x: Float[Array, "seq dim"]) -> Float[Array, "seq vocab"]:
        return x @ self.weight.T.astype(x.dtype)


class RMSNorm(eqx.Module):
    weight: Float[Array, " dim"]
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, eps: float, dtype=jnp.float32):
        self.weight = jnp.ones((dim,), dtype)
        self.eps = eps

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        x32 = x.astype(jnp.float32)  # statistics in float32, also under bf16 compute
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + self.eps)
        return _last(self.weight.astype(x.dtype), x.ndim) * x32.astype(x.dtype)


class LayerNorm(eqx.Module):
    weight: Float[Array, " dim"]
    bias: Float[Array, " dim"]
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, eps: float, dtype=jnp.float32):
        self.weight = jnp.ones((dim,), dtype)
        self.bias = jnp.zeros((dim,), dtype)
        self.eps = eps

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, -1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), -1, keepdims=True)
        y = ((x32 - mean) * jax.lax.rsqrt(var + self.eps)).astype(x.dtype)
        return y * _last(self.weight.astype(x.dtype), y.ndim) + _last(self.bias.astype(x.dtype), y.ndim)


class KVCache(eqx.Module):
    """Keys and values of one attention layer for ``max_len`` slots (with a
    leading layer axis: of every layer of a stack).

    Decoding a stack layer by layer (`run_layers`), a layer sees the whole
    stack with ``layer`` set to its index: `update_cache` writes its new
    tokens into its layer in place and `read` takes its keys and values at a
    static index. In generate's token loop ``k`` and ``v`` hold each layer's
    own buffer (`LayerSlices`, `caches_by_layer`), which is read without a
    copy where a slice of one stacked buffer may not be. ``stack`` says which
    of `run_layers`' caches the view is of."""

    k: Float[Array, "*layers max_len kv_heads head_dim"]
    v: Float[Array, "*layers max_len kv_heads head_dim"]
    layer: int | None = eqx.field(static=True, default=None)
    stack: int | None = eqx.field(static=True, default=None)

    @staticmethod
    def empty(max_len: int, kv_heads: int, head_dim: int, dtype) -> "KVCache":
        z = constrain(jnp.zeros((max_len, kv_heads, head_dim), dtype), P(None, MODEL, None))
        return KVCache(z, z)

    def read(self, dtype) -> tuple[Float[Array, "max_len kv_heads head_dim"], Float[Array, "max_len kv_heads head_dim"]]:
        """This layer's keys and values, in ``dtype`` (a no-op when the cache holds the compute dtype)."""
        k, v = (self.k, self.v) if self.layer is None else (self.k[self.layer], self.v[self.layer])
        return k.astype(dtype), v.astype(dtype)


def empty_caches(n_layers: int, stacked: bool, max_len: int, kv_heads: int, head_dim: int, dtype):
    """One empty `KVCache` per layer: a list, or one stacked cache for stacked layers."""
    if not stacked:
        return [KVCache.empty(max_len, kv_heads, head_dim, dtype) for _ in range(n_layers)]
    z = constrain(jnp.zeros((n_layers, max_len, kv_heads, head_dim), dtype), P(None, None, MODEL, None))
    return KVCache(z, z)


# ----------------------------------------------------------------------------- a model's layers, listed or stacked


def build_layers(make: Callable[[PRNGKeyArray], eqx.Module], keys: PRNGKeyArray, *, stacked: bool):
    """``make(k)`` for each key of ``keys``: a list of layers, or with
    ``stacked=True`` one layer whose every array has a leading layer axis
    (``eqx.filter_vmap``), which `run_layers` runs in a ``lax.scan`` (one
    layer's program, compiled once, whatever the depth). Both hold the same
    values: layer ``i`` of the stack is the ``i``-th of the list."""
    if stacked:
        return eqx.filter_vmap(make)(keys)
    return [make(k) for k in keys]


def table_and_layers(rows: int, dim: int, make: Callable[[PRNGKeyArray], eqx.Module], n: int, *, stacked: bool,
                     key: PRNGKeyArray) -> tuple[Embedding, list | eqx.Module]:
    """A ``(rows, dim)`` `Embedding` (a model's token table, a stack's position table) and the
    ``n`` layers after it (`build_layers`), from ``key`` split ``n + 1`` ways, the first the table's."""
    keys = jax.random.split(key, n + 1)
    return Embedding(rows, dim, key=keys[0]), build_layers(make, keys[1:], stacked=stacked)


def stack_depth(layer) -> int | None:
    """The number of layers in a zoo stack (one layer whose every array has
    a leading layer axis), or None for one layer: a zoo layer always holds a
    1-D array (a norm's weight, a bias), so in a stack every array is at
    least 2-D, all with the same leading size."""
    arrays = jax.tree.leaves(eqx.filter(layer, eqx.is_array))
    sizes = {a.shape[0] for a in arrays if a.ndim >= 2}
    if not arrays or any(a.ndim < 2 for a in arrays) or len(sizes) != 1:
        return None
    return sizes.pop()


class Stackable(eqx.Module):
    """A zoo layer class, which `build_layers` may stack: a stack (what
    ``model.model.layers`` is with ``scan_layers=True``, the default) is
    indexed like Transformers' layer list, and a changed layer put back.

    ```python
    layer = model.model.layers[3]                      # layer 3: its arrays sliced from the stack
    layer = eqx.tree_at(lambda l: l.mlp.down_proj.weight, layer, new_weight)
    model = eqx.tree_at(lambda m: m.model.layers, model, model.model.layers.with_layer(3, layer))
    ```
    """

    def _depth(self, what: str) -> int:
        n = stack_depth(self)
        if n is None:
            raise TypeError(
                f"{what} of a {type(self).__name__} that is one layer, not a stack of them: index the layer list of "
                "a model built with scan_layers=False, or the stack of one built with scan_layers=True (the default)."
            )
        return n

    def __getitem__(self, i: int):
        n = self._depth("indexing")
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"a stack of {n} {type(self).__name__}s takes one int index (0 to {n - 1}), got {i!r}; "
                            "eqx.tree_at or jax.tree.map over the stacked arrays change several layers at once.")
        if not -n <= i < n:
            raise IndexError(f"layer {i} of a stack of {n} {type(self).__name__}s: use 0 to {n - 1} (or -{n} to -1).")
        return layer_at(self, int(i) % n)

    def with_layer(self, i: int, layer) -> Stackable:
        """This stack with layer ``i`` replaced by ``layer`` (one layer of the
        same structure and shapes, e.g. ``stack[i]`` changed)."""
        n = self._depth("with_layer")
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not -n <= i < n:
            raise IndexError(f"with_layer({i!r}, ...) on a stack of {n} {type(self).__name__}s: use 0 to {n - 1}.")
        stack, one = eqx.filter(self, eqx.is_array), eqx.filter(layer, eqx.is_array)
        if jax.tree.structure(stack) != jax.tree.structure(one) or any(
                s.shape[1:] != a.shape for s, a in zip(jax.tree.leaves(stack), jax.tree.leaves(one))):
            raise ValueError(f"with_layer({i}, layer): layer must be one {type(self).__name__} of this stack's "
                             "structure and shapes, as stack[i] gives it (change it with eqx.tree_at).")
        arrays = jax.tree.map(lambda s, a: s.at[int(i) % n].set(a.astype(s.dtype)), stack, one)
        return eqx.combine(arrays, self)


def is_stacked(layers) -> bool:
    return not isinstance(layers, (list, tuple))


def n_layers(layers) -> int:
    if not is_stacked(layers):
        return len(layers)
    return next(a for a in jax.tree.leaves(layers, is_leaf=_is_sliced) if eqx.is_array(a) or _is_sliced(a)).shape[0]


def layer_at(layers, i: int):
    """Layer ``i`` of a list, or of a stack (its arrays' slice ``i``, or its `LayerSlices`' ``i``-th)."""
    if not is_stacked(layers):
        return layers[i]
    return jax.tree.map(lambda a: a[i] if eqx.is_array(a) or _is_sliced(a) else a, layers, is_leaf=_is_sliced)


def check_scan_unroll(config) -> None:
    """A clear error for a config's ``scan_unroll`` that ``lax.scan`` would not take."""
    u = config.scan_unroll
    if not (u is None or isinstance(u, bool) or (isinstance(u, int) and u >= 1)):
        raise ValueError(
            f"{type(config).__name__}.scan_unroll={u!r}: pass None (unrolled on GPUs, a loop elsewhere), True "
            "(every layer unrolled), or a positive int (that many layers per loop iteration; 1 is a plain loop)."
        )


def check_context_attention(config) -> None:
    """A clear error for a config's ``context_attention`` that `redeqx.attention` would not take."""
    from ..context import IMPLS

    if config.context_attention not in IMPLS:
        raise ValueError(
            f"{type(config).__name__}.context_attention={config.context_attention!r}: choose one of {IMPLS} "
            "(how keys/values cross a sequence split over 'context': all gathered, passed around a ring when "
            "the gathered ones do not fit, or the heads split instead by all-to-all)."
        )


def _default_unroll(prompt: bool) -> int | bool:
    """`SCAN_UNROLL`'s choice for the platform a pass is compiled for (1 where it names none), and
    1 for a prompt's pass with a cache (a generation's prefill) on every platform: unrolled, each
    layer's products read its own offsets in the stack, so XLA:GPU compiled 22 distinct GEMM
    kernels per weight of the 1B's prefill (54 in its generation against 12 listed; 9.3 s of
    compile against 3.8 as a loop and 5.1 listed, and as many kernels for a GPU's autotuner to
    time on the first call), where the loop compiles one. A prompt's pass runs once a generation,
    so a loop's per-layer cost (a training step's 9 % on an H200) is a share of one pass, not of
    every token."""
    return 1 if prompt else SCAN_UNROLL.get(traced_platform(), 1)


def run_layers(layers, x, caches, step: Callable, *, unroll: int | bool | None = 1):
    """``x`` through each layer in turn, ``step(layer, x, cache) -> (x,
    new_cache)``: a Python loop over a list, a ``lax.scan`` over a stack
    (``unroll`` layers per loop iteration; True: all of them, no loop;
    None: by platform and pass, `_default_unroll`),
    each stacked layer keeping only its matrix products (without batch dims)
    for the backward pass and recomputing the rest. ``caches`` has the
    layers' form (a list, a stacked cache) or is None; returns ``x`` and the
    new caches in that form. With caches, a prompt (more than one token)
    runs through the same scan, each layer's cache sliced from the stack
    and stacked back: one layer's program whatever the depth (the 1B
    LLaMA's prefill compiles in 1.2 s on libtpu, against 8.8 s layer by
    layer; where a backend copies a weight sliced at a loop index, XLA:GPU,
    that is one copy of each layer's weights a prompt, not a token). One
    token at a time (decoding) runs layer by layer (`decode_stack`)."""
    if not is_stacked(layers):
        new = []
        for i, layer in enumerate(layers):
            x, cache = step(layer, x, None if caches is None else caches[i])
            new.append(cache)
        return x, new
    if caches is not None and x.shape[0] == 1:  # x: one sequence's (tokens, features)
        return decode_stack(layers, x, caches, step)
    if any(_is_sliced(a) for a in jax.tree.leaves((layers, caches), is_leaf=_is_sliced)):
        raise ValueError("a stack sliced for a token loop (`sliced_for_decoding`, `caches_by_layer`) decodes one "
                         f"token at a time; got {x.shape[0]} tokens.")
    arrays, static = eqx.partition(layers, eqx.is_array)
    unroll = _default_unroll(caches is not None) if unroll is None else unroll

    def body(x, xs):
        layer, cache = xs
        return step(eqx.combine(layer, static), x, cache)

    # A scan stores what each layer's backward reads as stacked arrays, every intermediate JAX
    # chose, where an unrolled compile fuses the elementwise ones away: keep the projections'
    # outputs and recompute the rest (benchmarks/RESULTS.md, "Stacked layers").
    body = jax.checkpoint(body, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable, prevent_cse=False)
    return jax.lax.scan(body, x, (arrays, caches), unroll=unroll)


_is_kv = lambda c: isinstance(c, KVCache)  # noqa: E731


def decode_stack(layers, x, caches, step: Callable):
    """`run_layers` over a stack with caches: a Python loop over the layers
    at static indices, as listed layers run. Decoding is one program per
    token inside a loop over tokens; there a ``lax.scan`` over the stack
    slices each layer's weights at a loop index (a ``dynamic-slice``), and
    the GPU backend copies every layer's weights out of the stack on every
    token (2.11 ms a token for the 1B LLaMA on an H200 against 1.20 listed,
    issue 41), and the scan's stacked outputs rebuild the whole KV cache per
    token. Here each layer reads its weights as static slices of the stack
    (offsets known when compiling: no index arithmetic, nothing to copy where
    the compiler reads the slice in place), and each `KVCache` of
    ``caches`` is handed to the layer as a view of the whole stack
    (``layer=i``), written in place at ``(i, index)`` and read at ``i``
    (`KVCache.read`); generate hands it each layer's own buffer
    (`caches_by_layer`), which no backend copies to read. A cache the layer does not
    return (cross attention's keys and values) is only read. Other per-layer
    outputs (a mixture of experts' router statistics) are stacked. Each
    layer's fused kernels hold its slices' offsets, so a compiler that
    reuses identical kernels across listed layers compiles each stacked
    layer's own (libtpu: 204 distinct fused computations in the 1B LLaMA's
    generation against 101 listed); that whole generation, the prompt's
    scan included, compiles in 8.2 s on libtpu against 10.4 s listed
    (`benchmarks.decode_compile`). A stack whose arrays were sliced before the
    token loop (`sliced_for_decoding`) gives each layer its slices."""
    stacks = jax.tree.leaves(caches, is_leaf=_is_kv)
    if not all(_is_kv(c) for c in stacks):
        raise TypeError("decoding a stack layer by layer needs its caches to be KVCache stacks, got "
                        f"{sorted({type(c).__name__ for c in stacks})}.")
    outs = []
    for i in range(n_layers(layers)):
        views = iter([KVCache(c.k, c.v, i, j) for j, c in enumerate(stacks)])
        view = jax.tree.map(lambda _: next(views), caches, is_leaf=_is_kv)
        x, out = step(layer_at(layers, i), x, view)
        for c in jax.tree.leaves(out, is_leaf=_is_kv):
            if _is_kv(c):  # the stack this layer wrote: the next layer reads and writes it
                stacks[c.stack] = KVCache(c.k, c.v)
        outs.append(out)
    merge = lambda first, *rest: stacks[first.stack] if _is_kv(first) else jnp.stack([first, *rest])  # noqa: E731
    return x, jax.tree.map(merge, *outs, is_leaf=_is_kv)


class LayerSlices:
    """A stacked array's layers as separate arrays, in the array's place in its stack: what
    `sliced_for_decoding` makes and `layer_at` reads (``slices[i]``); ``shape`` is the stack's."""

    def __init__(self, slices):
        self.slices = tuple(slices)

    def __getitem__(self, i: int):
        return self.slices[i]

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.slices), *self.slices[0].shape)


def _by_layer(stack: Array) -> LayerSlices:
    """A stacked array as its layers' own arrays (each a copy, made once)."""
    return LayerSlices(stack[i] for i in range(stack.shape[0]))


jax.tree_util.register_pytree_node(LayerSlices, lambda s: (s.slices, None), lambda _, slices: LayerSlices(slices))
_is_sliced = lambda a: isinstance(a, LayerSlices)  # noqa: E731


def sliced_for_decoding(model):
    """``model`` with each array of each stack of layers replaced by its layers' slices
    (`LayerSlices`), for a token loop that will run on a GPU; elsewhere ``model``.

    XLA:GPU reads a layer's weights as a slice of the stack only where its GEMM kernel takes the
    slice in (a Triton GEMM may; cuBLAS cannot), and copies the slice out every token otherwise:
    compiled for an H100, the stacked 1B LLaMA's token copied 1.9 GiB (the MLP's gate and up
    slices) with Triton's GEMMs and 2.9 GiB (every slice) with cuBLAS's, against 8 MiB listed
    (`benchmarks.gpu_compile`). Sliced before the loop, each slice is copied once a generation and
    the loop reads them as a listed model's weights; the price is a second copy of the layers'
    weights while the loop runs. The stack stays a stack (its caches, its family's code paths);
    `decode_stack` reads layer ``i`` from the slices. On TPUs and CPUs the compilers read the
    slices in place: nothing changes there."""
    if traced_platform() != "gpu":
        return model

    def stack(x) -> bool:
        return isinstance(x, Stackable) and stack_depth(x) is not None

    def sliced(layers):
        return jax.tree.map(lambda a: _by_layer(a) if eqx.is_array(a) else a, layers)

    return jax.tree.map(lambda x: sliced(x) if stack(x) else x, model, is_leaf=stack)


def caches_by_layer(cache):
    """One sequence's decoding ``cache`` with each stacked `KVCache` held as its layers' own
    buffers (`LayerSlices`), for a token loop; other leaves as they are.

    A stacked cache is one buffer, and XLA lays a batch of them out with the layer axis inside
    the batch and heads (``(batch, heads, layers, slots, head_dim)``): a layer's keys are not
    one block, and attention's products take them only as a copy. For 8 sequences of 4,096
    slots, the stacked 1B LLaMA's token copied each layer's K and V out of the stack on an
    H100 (1,409 MiB a token, twice the cache, against 1.4 MiB listed: `benchmarks.gpu_compile`'s
    ``long_decode``), and the whole stack twice a layer on a TPU v4 (30,979 MiB a token
    against 2.7 listed: `benchmarks.decode_compile --batch 8 --slots 4096`). Split once after
    the prompt, each layer's keys and values are written and read in place, as a listed
    model's are, on every platform. The split is one copy of the cache a generation, within
    the temporaries the stacked generation held before (XLA:GPU 2,938 MiB against 2,954)."""

    def split(c):
        if not (_is_kv(c) and c.layer is None and eqx.is_array(c.k) and c.k.ndim == 4):
            return c
        return KVCache(_by_layer(c.k), _by_layer(c.v))

    return jax.tree.map(split, cache, is_leaf=_is_kv)


class Cache(eqx.Module):
    """The decoding state of a decoder-only model for one sequence.

    ``index`` is the next free slot, ``position`` the next token's position
    (they differ by the number of padding slots), ``valid[s]`` whether slot
    ``s`` holds a real token.
    """

    layers: list[KVCache] | KVCache  # a stacked cache for stacked layers
    valid: Bool[Array, " max_len"]
    index: Int[Array, ""]
    position: Int[Array, ""]


def heads(x: Float[Array, "seq features"], n: int) -> Float[Array, "seq heads head_dim"]:
    """Split projected features into heads, the heads split over ``model``
    (and the sequence over ``context``, on a mesh with that axis)."""
    return constrain(x.reshape(x.shape[0], n, -1), P(CONTEXT, MODEL, None))


@dataclasses.dataclass(frozen=True)
class CausalMask:
    """The plain causal mask of ``n`` tokens (no padding, no window), said
    rather than built: `attention` hands it to a fused kernel where one can
    serve, and builds the boolean matrix where not."""

    n: int

    def array(self) -> Bool[Array, "n n"]:
        return jnp.tril(jnp.ones((self.n, self.n), bool))


@dataclasses.dataclass(frozen=True)
class SplitMask:
    """Causal attention over a sequence split over the mesh's ``context``
    axis, in its order: `attention` hands it to `redeqx.attention`, which
    masks by original position, sliding ``window`` and ``segment_ids`` (1
    for real tokens, 0 for padding) block by block, never forming the
    (T, T) mask."""

    segment_ids: Int[Array, " seq"] | None
    impl: str = "gather"
    window: int | None = None


def split_mask(valid: Bool[Array, " seq"], impl: str, window: int | None = None):
    """Positions and mask of a padded sequence split over ``context``:
    positions count real tokens in the original order (as for an unsplit
    one), padding sees only padding."""
    order = sequence_positions(valid.shape[0])
    inverse = jnp.argsort(order)
    counted = jnp.maximum(jnp.cumsum(valid[inverse].astype(jnp.int32)) - 1, 0)  # in the original order
    return counted[order], SplitMask(valid.astype(jnp.int32), impl, window)


def attention(
    q: Float[Array, "q_seq q_heads head_dim"],
    k: Float[Array, "kv_seq kv_heads head_dim"],
    v: Float[Array, "kv_seq kv_heads head_dim"],
    mask: Bool[Array, "q_seq kv_seq"] | CausalMask,
    *,
    scale: float,
    bias: Float[Array, "q_heads q_seq kv_seq"] | None = None,
) -> Float[Array, "q_seq q_heads head_dim"]:
    """Softmax attention with grouped query heads (``q_heads`` a multiple of
    ``kv_heads``; query head ``h`` reads KV head ``h // (q_heads / kv_heads)``).

    With a `CausalMask` and no bias, a fused kernel computes it without
    materialising the scores where one serves (`redeqx.context.fused_attention`:
    cuDNN's flash attention on a GPU in bfloat16/float16, the splash kernel on
    a TPU); otherwise scores and softmax are computed exactly, in float32.
    A `SplitMask` (the sequence split over ``context``) goes to `redeqx.attention`."""
    if isinstance(mask, SplitMask):
        if bias is not None:
            raise ValueError("attention with an additive bias cannot run on a sequence split over 'context' yet.")
        return split_attention(q, k, v, causal=True, segment_ids=mask.segment_ids, scale=scale, window=mask.window,
                               impl=mask.impl)
    if isinstance(mask, CausalMask):
        if bias is None and (out := fused_attention(q, k, v, causal=True, scale=scale)) is not None:
            return out  # cuDNN's kernel on a GPU, splash on a TPU: `redeqx.attention`'s own choice
        mask = mask.array()
    return masked_attention(q, k, v, mask, scale, bias)  # the keys minor on a GPU: one softmax kernel


def update_cache(layer: KVCache, k, v, index) -> KVCache:
    """Write ``k``/``v`` of the new tokens into slots ``index, index + 1, ...``
    (of layer ``layer.layer`` of a stacked cache, in place)."""
    if layer.layer is None:
        put = lambda c, x: jax.lax.dynamic_update_slice_in_dim(c, x.astype(c.dtype), index, axis=0)
    elif _is_sliced(layer.k):  # a stack held as its layers' buffers (`caches_by_layer`): write the layer's own
        put = lambda c, x: LayerSlices(jax.lax.dynamic_update_slice_in_dim(s, x.astype(s.dtype), index, axis=0)
                                       if j == layer.layer else s for j, s in enumerate(c.slices))
    else:
        zero = jnp.zeros((), jnp.int32)
        put = lambda c, x: jax.lax.dynamic_update_slice(
            c, x[None].astype(c.dtype), (jnp.asarray(layer.layer, jnp.int32), jnp.asarray(index, jnp.int32), zero, zero))
    return KVCache(put(layer.k, k), put(layer.v, v), layer.layer, layer.stack)


def attend(q, k, v, mask, cache: KVCache | None, index, *, scale: float | None = None, bias=None):
    """Attention of heads ``q`` (T, Hq, D) over ``k``/``v`` (T, Hkv, D), appended to ``cache``
    at slot ``index`` when given; the heads joined back (T, Hq * D), split over ``model``, as a
    row-parallel output projection reads them. ``scale`` defaults to ``1 / sqrt(D)``."""
    if cache is not None:
        cache = update_cache(cache, k, v, index)
        k, v = cache.read(q.dtype)
    out = attention(q, k, v, mask, scale=inv_sqrt(q.shape[-1]) if scale is None else scale, bias=bias)
    return constrain(out.reshape(out.shape[0], -1), P(CONTEXT, MODEL)), cache


def attend_and_project(o_proj, q, k, v, mask, cache: KVCache | None, index, **kwargs):
    """`attend`, then the output projection ``o_proj`` (row parallel: one all-reduce)."""
    out, cache = attend(q, k, v, mask, cache, index, **kwargs)
    return constrain(o_proj(out), P(CONTEXT)), cache


def feed_forward(fc1: Linear, fc2: Linear, activation: Callable, x: Float[Array, "seq dim"]) -> Float[Array, "seq dim"]:
    """``fc2(activation(fc1(x)))``: ``fc1`` column parallel, ``fc2`` row parallel (one all-reduce)."""
    h = constrain(activation(fc1(x)), P(CONTEXT, MODEL))
    return constrain(fc2(h), P(CONTEXT))


def square_linears(dim: int, n: int, *, bias: bool, key: PRNGKeyArray) -> tuple[Linear, ...]:
    """``n`` ``(dim, dim)`` `Linear` layers, one per key of ``jax.random.split(key, n)``
    (an attention block's Q, K, V and output projections)."""
    return tuple(Linear(dim, dim, bias=bias, key=k) for k in jax.random.split(key, n))


def up_and_down(dim: int, hidden: int, *, bias: bool, key: PRNGKeyArray) -> tuple[Linear, Linear]:
    """An MLP's two `Linear` layers, ``(dim, hidden)`` and ``(hidden, dim)``, one per key of
    ``jax.random.split(key)`` (column parallel, then row parallel)."""
    k1, k2 = jax.random.split(key)
    return Linear(dim, hidden, bias=bias, key=k1), Linear(hidden, dim, bias=bias, key=k2)


class Attention(eqx.Module):
    """Multi-head attention with ``q_proj``, ``k_proj``, ``v_proj`` and
    ``out_proj`` (the fairseq layout of BART and OPT), scores scaled by
    ``1 / sqrt(head_dim)``: self-attention that appends to a `KVCache` when
    given one, or cross attention to keys/values projected once from an
    encoder output (`project_kv`). Q/K/V are column parallel, ``out_proj`` row
    parallel: one all-reduce forward, one backward."""

    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    out_proj: Linear
    n_heads: int = eqx.field(static=True)

    def __init__(self, dim: int, n_heads: int, *, bias: bool, key: PRNGKeyArray):
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = square_linears(dim, 4, bias=bias, key=key)
        self.n_heads = n_heads

    def __call__(
        self,
        x: Float[Array, "seq dim"],
        mask: Bool[Array, "seq kv_seq"],
        *,
        cache: KVCache | None = None,
        index: Int[Array, ""] | None = None,
        kv: KVCache | None = None,
    ) -> tuple[Float[Array, "seq dim"], KVCache | None]:
        """Self-attention over ``x`` (its keys/values written into ``cache`` at
        slot ``index`` when given), or cross attention to ``kv``."""
        h = self.n_heads
        if kv is not None:
            q = heads(self.q_proj(x), h)
            k, v = kv.read(q.dtype)
        else:
            x = gradients_summed_first(x)
            projected = joined_linears(x, (self.q_proj, self.k_proj, self.v_proj), joined=cache is None)
            q, k, v = (heads(y, h) for y in projected)
        return attend_and_project(self.out_proj, q, k, v, mask, cache, index)

    def project_kv(self, source: Float[Array, "src dim"]) -> KVCache:
        """Keys and values of an encoder output, for cross attention."""
        h, source = self.n_heads, gradients_summed_first(source)
        k, v = (heads(proj(source), h) for proj in (self.k_proj, self.v_proj))
        return KVCache(k, v)


# fairseq's learned position tables (BART's, OPT's) keep two rows for padding first: position p reads
# row p + 2 of a table of max_position_embeddings + 2 rows, as fairseq and Hugging Face do.
POSITION_OFFSET = 2


class FairseqLayer(Stackable):
    """The fairseq layout's transformer layer (BART's encoder layer, OPT's decoder layer):
    self-attention, then a two-layer MLP (``fc1``, ``fc2``), each added to the residual stream
    with its LayerNorm before (``pre_norm``) or after the addition."""

    self_attn: Attention
    self_attn_layer_norm: LayerNorm
    fc1: Linear
    fc2: Linear
    final_layer_norm: LayerNorm

    def __init__(self, dim: int, n_heads: int, ffn_dim: int, eps: float, *, bias: bool, key: PRNGKeyArray):
        ka, k1, k2 = jax.random.split(key, 3)
        self.self_attn = Attention(dim, n_heads, bias=bias, key=ka)
        self.self_attn_layer_norm = LayerNorm(dim, eps)
        self.fc1 = Linear(dim, ffn_dim, bias=bias, key=k1)
        self.fc2 = Linear(ffn_dim, dim, bias=bias, key=k2)
        self.final_layer_norm = LayerNorm(dim, eps)

    def _forward(self, x, mask, cache, index, *, activation: Callable, pre_norm: bool):
        a, cache = self.self_attn(self.self_attn_layer_norm(x) if pre_norm else x, mask, cache=cache, index=index)
        x = x + a
        if not pre_norm:
            x = self.self_attn_layer_norm(x)
        y = x + feed_forward(self.fc1, self.fc2, activation, self.final_layer_norm(x) if pre_norm else x)
        return (y if pre_norm else self.final_layer_norm(y)), cache


def causal_mask(
    valid_keys: Bool[Array, " kv_seq"], first_slot, n_queries: int, window: int | None = None
) -> Bool[Array, "q_seq kv_seq"]:
    """Query ``t`` (in slot ``first_slot + t``) sees valid keys in slots up to
    its own, and with a sliding ``window`` only the last ``window`` of them
    (itself included), as Mistral does: the window counts real tokens, not
    slots, so padding between a prompt and its new tokens (a right-padded
    prompt's) or inside a sequence takes no place in it."""
    q_slot = first_slot + jnp.arange(n_queries)[:, None]
    k_slot = jnp.arange(valid_keys.shape[0])[None, :]
    mask = (k_slot <= q_slot) & valid_keys[None, :]
    if window is not None:
        counted = jnp.cumsum(valid_keys.astype(jnp.int32))  # real tokens in the slots up to each one
        mask = mask & (counted[q_slot] - counted[None, :] < window)
    return mask


def write_valid(cache: Cache, valid_new: Bool[Array, " seq"]) -> Bool[Array, " max_len"]:
    return jax.lax.dynamic_update_slice_in_dim(cache.valid, valid_new, cache.index, axis=0)


def check_fits(name: str, n: int, max_len: int) -> None:
    if n > max_len:
        raise ValueError(f"{name}: {n} tokens do not fit a cache of max_len={max_len}; pass a larger max_len.")


def check_positions(name: str, n: int, table: int | None, field: str) -> None:
    """A model with a learned position table cannot read positions past it: ``jnp.take`` would
    return NaN rows (its fill mode) and train on them without a word."""
    if table is not None and n > table:
        raise ValueError(
            f"{name}: {n} positions do not fit the model's learned position table of {table} ({field}={table}); "
            f"use sequences of at most {table} tokens (truncate or split them), or a model with a larger {field}."
        )


def check_positive_ints(config, names: tuple[str, ...]) -> None:
    """A clear error for the first of ``config``'s fields ``names`` that is not a positive int."""
    for name in names:
        positive_int(getattr(config, name), f"{type(config).__name__}.{name}")


def default_head_dim(hidden: int, n_heads: int) -> int:
    if hidden % n_heads:
        raise ValueError(
            f"hidden_size={hidden} is not a multiple of num_attention_heads={n_heads}; set head_dim explicitly."
        )
    return hidden // n_heads


def inv_sqrt(d: int) -> float:
    return 1.0 / math.sqrt(d)


def check_config(config, cls: type) -> None:
    """A clear error for a family built from another family's config (or none)."""
    if not isinstance(config, cls):
        raise TypeError(f"config must be a redeqx.models.{cls.__name__}, got {type(config).__name__}.")


def model_and_head(model_cls: Callable, config, width: int, *, key: PRNGKeyArray):
    """A family's model body ``model_cls(config, key=...)`` and its bias-free LM head ``(width,
    vocab)``: None when ``config.tie_word_embeddings`` (the token embedding serves, `lm_logits`)."""
    km, kh = jax.random.split(key)
    tied = config.tie_word_embeddings
    return model_cls(config, key=km), None if tied else Linear(width, config.vocab_size, bias=False, key=kh)


def lm_logits(embedding: Embedding, lm_head: Linear | None, x: Float[Array, "seq dim"]) -> Float[Array, "seq vocab"]:
    """The LM head's logits, or the token embedding's (``lm_head`` None: tied)."""
    return embedding.attend(x) if lm_head is None else lm_head(x)


class CausalLM(eqx.Module):
    """What every decoder-only family shares: the full forward, the cache and
    cached decoding (`redeqx.models.Decoder`'s protocol), built on the
    family's ``_run(ids, positions, mask, cache) -> (logits, new_layer_caches)``
    and ``_kv_shape() -> (layers, kv_heads, head_dim)``; its config says
    ``scan_layers``."""

    def _run(self, ids, positions, mask, cache):
        raise NotImplementedError

    def _kv_shape(self) -> tuple[int, int, int]:
        raise NotImplementedError

    def _through_layers(self, layers, x, cache: Cache | None, *args):
        """``x`` through ``layers``, each called ``layer(x, *args, layer_cache, index)`` (the
        layer's cache and the cache's ``index`` None without ``cache``): ``x`` and the new caches."""
        index = None if cache is None else cache.index
        return run_layers(layers, x, None if cache is None else cache.layers,
                          lambda layer, x, lc: layer(x, *args, lc, index), unroll=self.config.scan_unroll)

    def _window(self) -> int | None:
        """Sliding-window attention span, or None for full causal attention."""
        return None

    def _max_positions(self) -> tuple[int, str] | None:
        """How many positions a learned position table holds, and the config field
        that sets it; None for rotary models, which have no table."""
        return None

    def _check_positions(self, where: str, n: int) -> None:
        if (table := self._max_positions()) is not None:
            check_positions(f"{type(self).__name__}{where}", n, *table)

    def _dtype(self):
        return jax.tree.leaves(self)[0].dtype

    def __call__(
        self,
        input_ids: Int[Array, " seq"],
        *,
        attention_mask: Bool[Array, " seq"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "seq vocab"]:
        """Logits for every position. ``attention_mask`` marks real tokens
        (``False`` for padding; positions count real tokens only, as Hugging
        Face does for left padding). ``key`` is unused (no dropout)."""
        del key
        positions, mask, _ = self._inputs(input_ids.shape[0], attention_mask)
        return self._run(input_ids, positions, mask, None)[0]

    def _inputs(self, t: int, attention_mask):
        """The positions, mask and real tokens (None: all real) of a forward over
        ``t`` tokens, for ``__call__`` and every other full forward of the family
        (a mixture-of-experts model's ``with_aux``): on a mesh with a ``context``
        axis the sequence arrives in its split order (`redeqx.batches`'
        ``seq_keys``) and attention goes to `redeqx.attention` (`SplitMask`);
        positions count real tokens only (as Hugging Face does for left padding)."""
        self._check_positions("", t)
        if context_axis() is not None:
            return self._split_inputs(t, attention_mask)
        if attention_mask is None and self._window() is None:  # training's case: a kernel may serve it
            return jnp.arange(t), CausalMask(t), None
        valid = jnp.ones((t,), bool) if attention_mask is None else attention_mask.astype(bool)
        return jnp.maximum(jnp.cumsum(valid) - 1, 0), causal_mask(valid, 0, t, self._window()), valid

    def _split_inputs(self, t: int, attention_mask):
        impl = getattr(self.config, "context_attention", "gather")
        if attention_mask is None:
            return sequence_positions(t), SplitMask(None, impl, self._window()), None
        valid = attention_mask.astype(bool)
        positions, mask = split_mask(valid, impl, self._window())
        return positions, mask, valid

    def init_cache(self, max_len: int, dtype=None) -> Cache:
        """An empty decoding cache with ``max_len`` slots (prompt + new tokens)."""
        self._check_positions(".init_cache", max_len)
        n, kv_heads, head_dim = self._kv_shape()
        dtype = dtype or self._dtype()
        return Cache(
            layers=empty_caches(n, self.config.scan_layers, max_len, kv_heads, head_dim, dtype),
            valid=jnp.zeros((max_len,), bool),
            index=jnp.zeros((), jnp.int32),
            position=jnp.zeros((), jnp.int32),
        )

    def prefill(
        self, input_ids: Int[Array, " seq"], attention_mask: Bool[Array, " seq"], max_new_tokens: int
    ) -> tuple[Float[Array, " vocab"], Cache]:
        """Decode a padded prompt into a cache with room for
        ``max_new_tokens`` more: the next token's logits and the cache (what
        `redeqx.models.generate` starts from). Padding (``attention_mask``
        False) may sit anywhere: positions count real tokens only, padded
        slots are never attended to, and the logits are the last real
        token's.

        On a mesh with a ``context`` axis the prompt arrives in its split
        order (`redeqx.batches` or `redeqx.predict` with ``seq_keys``): its
        forward is split over ``context`` as a training step's is (the
        attention `redeqx.attention`'s, the logits never whole), and the
        cache comes out in the original order, whole on every context shard,
        for the decoding steps."""
        t = input_ids.shape[0]
        if context_axis() is not None:
            return self._split_prefill(input_ids, attention_mask, max_new_tokens)
        cache = self.init_cache(t + max_new_tokens)
        logits, cache = self.decode(input_ids, cache, attention_mask=attention_mask)
        return logits[t - 1 - jnp.argmax(attention_mask[::-1])], cache

    def _split_prefill(self, input_ids, attention_mask, max_new_tokens: int):
        """`prefill` of a prompt in the split order: the forward runs over a
        cache of exactly the prompt's slots (written in the split order, so
        attention reads this shard's keys and values as training does); the
        keys and values are then put back in the original order and padded
        to ``max_new_tokens`` more slots."""
        t = input_ids.shape[0]
        self._check_positions(".prefill", t + max_new_tokens)
        positions, mask, valid = self._split_inputs(t, attention_mask)
        valid = jnp.ones((t,), bool) if valid is None else valid
        logits, layers = self._run(input_ids, positions, mask, self.init_cache(t))
        inverse = jnp.argsort(sequence_positions(t))  # inverse[p]: where the split layout holds place p

        def whole(a):  # (..., t, kv_heads, head_dim), split order -> (..., t + new, kv_heads, head_dim), original
            axis = a.ndim - 3
            a = jnp.pad(jnp.take(a, inverse, axis=axis), [(0, max_new_tokens if d == axis else 0) for d in range(a.ndim)])
            return constrain(a, P(*([None] * (axis + 1)), MODEL, None))

        valid = valid[inverse]
        cache = Cache(jax.tree.map(whole, layers), jnp.pad(valid, (0, max_new_tokens)), jnp.asarray(t, jnp.int32),
                      jnp.sum(valid).astype(jnp.int32))
        return logits[inverse[t - 1 - jnp.argmax(valid[::-1])]], cache

    def decode(
        self,
        input_ids: Int[Array, " seq"],
        cache: Cache,
        *,
        attention_mask: Bool[Array, " seq"] | None = None,
    ) -> tuple[Float[Array, "seq vocab"], Cache]:
        """Run ``input_ids`` after what ``cache`` holds: their logits and the
        cache with them appended (a prompt at once, then one token a step)."""
        t = input_ids.shape[0]
        check_fits(f"{type(self).__name__}.decode", t, cache.valid.shape[0])
        valid_new = jnp.ones((t,), bool) if attention_mask is None else attention_mask.astype(bool)
        positions = cache.position + jnp.maximum(jnp.cumsum(valid_new) - 1, 0)
        valid = write_valid(cache, valid_new)
        logits, layers = self._run(input_ids, positions, causal_mask(valid, cache.index, t, self._window()), cache)
        new = Cache(layers, valid, cache.index + t, cache.position + jnp.sum(valid_new).astype(jnp.int32))
        return logits, new
