"""fp8 matrix products: `fp8_matmuls`, what ``make_train_step(..., fp8=True)`` does to ``loss_fn``.

Every ``dot_general`` of the loss that multiplies a weight (a model leaf, or a value computed from
weights alone: a cast to the compute dtype, a LoRA update) by an activation runs as `fp8_dot`: both
operands scaled into float8_e4m3fn by their current absolute maximum (per tensor, per step: no
scale state anywhere), multiplied with ``preferred_element_type`` the product's own dtype, the two
scales applied to the output; in the backward pass the output's gradient is scaled into
float8_e5m2 the same way and both gradients are fp8 products. This is the "direct" form a GPU's
compiler turns into cuBLAS fp8 GEMMs (a quantize-dequantize pattern would run them in bf16).

Left as they are: products of two activations (attention scores and their values), grouped products
(``ragged_dot``), and the output layer, the weight products whose result feeds no other weight
product (an LM's vocabulary projection, tied or not; a classifier's last layer). fp8 recipes keep
the output layer in the compute dtype: a tiny LLaMA's loss after 50 steps is 1.02x bf16's with its
head in fp8, 1.006x without. The output layer is found from the program, not from sizes: an earlier
rule by the rows of the tables the loss looks up also kept every weight with a dim the size of a
position table (all of GPT-2 medium's, 1,024 positions and width 1,024). "Feeds no other" rather than
"reaches the loss through no other": with the head out of sight (in a ``custom_vjp``, a fused
cross-entropy), the residual stream reaches the loss through adds alone, and the second rule kept
every layer's output projections. The model's code is untouched: the loss is traced once and
evaluated with those products replaced, in scans (stacked layers), jitted calls and
``jax.checkpoint`` bodies too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import equinox as eqx
import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

from ..mesh import DATA
from ._remat import plain_checkpoints
from .._rewrite import bind, call_body, derived_from, inner_seed, source_of, traced

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def _amax(x):
    """``x``'s absolute maximum over the whole tensor. Inside a ``shard_map`` manual over ``data`` (a
    pipeline's stages, `shard_mean_loss`) a value holds one data shard's rows: its shards' maxima are
    combined, so the scale is the one a single device computes for the same rows. (Over ``stage`` each
    device holds other layers: nothing to combine.)"""
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    return jax.lax.pmax(amax, DATA) if DATA in jax.sharding.get_abstract_mesh().manual_axes else amax


def _quantized(x, dtype):
    """``x`` scaled into ``dtype`` by its absolute maximum: ``(x / scale as dtype, scale)``."""
    top = float(jnp.finfo(dtype).max)
    amax = _amax(x)
    scale = jnp.where(amax > 0, amax / top, 1.0)
    return jnp.clip(x.astype(jnp.float32) / scale, -top, top).astype(dtype), scale


def _kept(n: int, contract, batch) -> list[int]:
    return [i for i in range(n) if i not in contract and i not in batch]


def _grad_lhs(g, y, x_ndim: int, dims, out_dtype):
    """The gradient of ``dot_general(x, y, dims)``'s lhs from the output's ``g``, as a product in ``out_dtype``."""
    (xc, yc), (xb, yb) = dims
    x_kept, y_kept = _kept(x_ndim, xc, xb), _kept(y.ndim, yc, yb)
    nb = len(xb)
    ans_y = tuple(range(nb + len(x_kept), nb + len(x_kept) + len(y_kept)))
    out = jax.lax.dot_general(g, y, ((ans_y, tuple(y_kept)), (tuple(range(nb)), tuple(yb))),
                              preferred_element_type=out_dtype)
    unsorted = list(xb) + x_kept + list(np.take(xc, np.argsort(yc)))
    return jnp.transpose(out, tuple(np.argsort(unsorted)))


def _grad_rhs(g, x, y_ndim: int, dims, out_dtype):
    """The gradient of ``dot_general(x, y, dims)``'s rhs from the output's ``g``."""
    (xc, yc), (xb, yb) = dims
    x_kept, y_kept = _kept(x.ndim, xc, xb), _kept(y_ndim, yc, yb)
    nb = len(yb)
    ans_x = tuple(range(nb, nb + len(x_kept)))
    out = jax.lax.dot_general(g, x, ((ans_x, tuple(x_kept)), (tuple(range(nb)), tuple(xb))),
                              preferred_element_type=out_dtype)
    unsorted = list(yb) + y_kept + list(np.take(yc, np.argsort(xc)))
    return jnp.transpose(out, tuple(np.argsort(unsorted)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def fp8_dot(x, y, dims, out_dtype):
    """``jax.lax.dot_general(x, y, dims)`` with both operands in float8_e4m3fn (current per-tensor
    scaling), the output in ``out_dtype``; its gradients are fp8 products too (the output's
    gradient in float8_e5m2)."""
    return _fwd(x, y, dims, out_dtype)[0]


def _accumulator(out_dtype):
    """The product's dtype before its scales: ``out_dtype`` where it has float32's range (bfloat16,
    the form cuBLAS's fp8 GEMMs take), else float32: unscaled e4m3 products reach 448² a term, past
    float16's 65,504."""
    return out_dtype if jnp.finfo(out_dtype).maxexp >= jnp.finfo(jnp.float32).maxexp else jnp.float32


def _fwd(x, y, dims, out_dtype):
    xq, sx = _quantized(x, E4M3)
    yq, sy = _quantized(y, E4M3)
    acc = _accumulator(out_dtype)
    out = jax.lax.dot_general(xq, yq, dims, preferred_element_type=acc) * (sx * sy).astype(acc)
    # the operands' dtypes ride along as empty arrays (a residual must be an array)
    return out.astype(out_dtype), (xq, yq, sx, sy, jnp.zeros((0,), x.dtype), jnp.zeros((0,), y.dtype))


def _bwd(dims, out_dtype, saved, g):
    xq, yq, sx, sy, x_like, y_like = saved
    gq, sg = _quantized(g, E5M2)
    dx = _grad_lhs(gq, yq, xq.ndim, dims, jnp.float32) * (sg * sy)
    dy = _grad_rhs(gq, xq, yq.ndim, dims, jnp.float32) * (sg * sx)
    return dx.astype(x_like.dtype), dy.astype(y_like.dtype)


fp8_dot.defvjp(_fwd, _bwd)


# ----------------------------------------------------------------------------- the rewrite


def _floating(v) -> bool:
    return jnp.issubdtype(v.aval.dtype, jnp.floating)


def _weight_product(eqn, weights: set) -> bool:
    """Whether ``eqn`` multiplies exactly one weight (a value of ``weights``) by an activation."""
    if eqn.primitive.name != "dot_general" or not all(map(_floating, eqn.invars)):
        return False  # most equations: both passes ask of every one
    return sum(not isinstance(v, jex.Literal) and v in weights for v in eqn.invars) == 1


def _body(eqn):
    """The program ``eqn`` runs inside (a call's, a ``jax.checkpoint``'s, a scan's), else None. A
    cond's branches are `_branches`."""
    if (closed := call_body(eqn)) is not None:
        return closed.jaxpr
    if eqn.primitive.name in ("checkpoint", "remat2", "scan"):
        inner = eqn.params["jaxpr"]
        return inner.jaxpr if isinstance(inner, jex.ClosedJaxpr) else inner
    return None


def _branches(eqn, weights: set) -> list[tuple[jex.ClosedJaxpr, set]]:
    """A cond's branches, each with its invars that are weights (``weights`` outside)."""
    if eqn.primitive.name != "cond":
        return []
    ops = eqn.invars[1:]
    return [(b, {iv for iv, ov in zip(b.jaxpr.invars, ops) if not isinstance(ov, jex.Literal) and ov in weights})
            for b in eqn.params["branches"]]


class _OutputLayer:
    """The weight products whose result feeds no other weight product, by any path: it only reaches
    the loss (an LM's vocabulary projection, tied or not; a classifier's last layer). fp8 recipes keep
    the output layer in the compute dtype. Read back from the program's outputs; a product the
    rewrite cannot see (one inside a ``custom_vjp``: a fused cross-entropy) hides nothing: the
    products before it still feed it, and only a product whose result no other reads is kept.
    ``found`` holds their equations' places: the index of each equation on the way in, from the
    loss's program down (one jitted function called at two places is two places)."""

    def __init__(self):
        self.found: set[tuple[int, ...]] = set()

    def walk(self, jaxpr, feeding: list[bool], seed: set, place: tuple[int, ...] = ()) -> list[bool]:
        """Which invars of ``jaxpr`` feed a weight product, given which of its outvars do."""
        weights = derived_from(jaxpr, seed)
        feeds = {v for v, f in zip(jaxpr.outvars, feeding) if f and not isinstance(v, jex.Literal)}
        for i in reversed(range(len(jaxpr.eqns))):
            eqn = jaxpr.eqns[i]
            outs = [v in feeds for v in eqn.outvars]
            if _weight_product(eqn, weights):
                if not outs[0]:
                    self.found.add((*place, i))
                ins = [True] * len(eqn.invars)
            elif (body := _body(eqn)) is not None:  # its products' inputs feed, whatever its outputs do
                ins = self._inner(eqn, body, outs, inner_seed(body, eqn, weights), (*place, i))
            elif branches := _branches(eqn, weights):  # an input feeds if it does in some branch
                fed = [self.walk(b.jaxpr, outs, seed, (*place, i, k)) for k, (b, seed) in enumerate(branches)]
                ins = [any(outs), *map(any, zip(*fed))]
            else:  # any other equation: each input reaches each output
                ins = [any(outs)] * len(eqn.invars)
            feeds.update(v for v, f in zip(eqn.invars, ins) if f and not isinstance(v, jex.Literal))
        return [v in feeds for v in jaxpr.invars]

    def _inner(self, eqn, body, outs: list[bool], seed: set, place: tuple[int, ...]) -> list[bool]:
        if eqn.primitive.name != "scan":
            return self.walk(body, outs, seed, place)
        nc, nk = eqn.params["num_consts"], eqn.params["num_carry"]
        carry, kept = outs[:nk], self.found
        while True:  # a carry feeds what the next iteration does with it: to a fixed point, then record
            self.found = set()
            ins = self.walk(body, carry + outs[nk:], seed, place)
            grown = [a or b for a, b in zip(carry, ins[nc:nc + nk])]
            if grown == carry:
                self.found = kept | self.found
                return ins
            carry = grown


class _Fp8:
    """Evaluates a jaxpr equation by equation, weight-by-activation products as `fp8_dot`."""

    def __init__(self, output_layer: set[tuple[int, ...]]):
        self.converted, self.output_layer = 0, output_layer

    def eval(self, jaxpr, consts, args, seed: set, place: tuple[int, ...] = ()):
        env = {}
        read = lambda v: v.val if isinstance(v, jex.Literal) else env[v]  # noqa: E731
        env.update(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))
        weights = derived_from(jaxpr, seed)
        for i, eqn in enumerate(jaxpr.eqns):
            invals = [read(v) for v in eqn.invars]
            outs = self._eqn(eqn, invals, weights, (*place, i))
            for v, x in zip(eqn.outvars, outs):
                if not isinstance(v, jex.DropVar):
                    env[v] = x
        return [read(v) for v in jaxpr.outvars]

    def _eqn(self, eqn, invals, weights, place: tuple[int, ...]) -> list:
        name, p = eqn.primitive.name, eqn.params
        fp8 = _weight_product(eqn, weights) and place not in self.output_layer
        inner = functools.partial(inner_seed, eqn=eqn, found=weights)
        if (body := call_body(eqn)) is not None:  # each of its equations keeps its own source
            return self.eval(body.jaxpr, body.consts, invals, inner(body.jaxpr), place)
        branches = _branches(eqn, weights)
        if not fp8 and not branches and name not in ("scan", "checkpoint", "remat2"):
            return bind(eqn, invals)  # as it was, with its source
        with source_of(eqn):  # a product made fp8, a loop rebuilt: still the user's code in the program
            if fp8:
                self.converted += 1
                return [fp8_dot(*invals, p["dimension_numbers"], eqn.outvars[0].aval.dtype)]
            if name == "scan":
                return self._scan(eqn, invals, inner, place)
            if branches:
                runs = [self._branch(b, seed, (*place, k)) for k, (b, seed) in enumerate(branches)]
                return jax.lax.switch(invals[0], runs, *invals[1:])
            body = p["jaxpr"]
            run = jax.checkpoint(lambda *a: self.eval(body, (), a, inner(body), place), prevent_cse=p["prevent_cse"],
                                 policy=p["policy"])
            return run(*invals)

    def _branch(self, branch: jex.ClosedJaxpr, seed: set, place: tuple[int, ...]) -> Callable:
        return lambda *ops: self.eval(branch.jaxpr, branch.consts, list(ops), seed, place)

    def _scan(self, eqn, invals, inner, place: tuple[int, ...]) -> list:
        p = eqn.params
        body, nc, nk = p["jaxpr"], p["num_consts"], p["num_carry"]
        seed = inner(body.jaxpr)
        consts, carry, xs = invals[:nc], invals[nc:nc + nk], invals[nc + nk:]

        def step(c, x):
            out = self.eval(body.jaxpr, body.consts, [*consts, *c, *x], seed, place)
            return out[:nk], out[nk:]

        carry, ys = jax.lax.scan(step, list(carry), list(xs), length=p["length"], reverse=p["reverse"],
                                 unroll=p["unroll"], _split_transpose=p.get("_split_transpose", False))
        return [*carry, *ys]


def _in_custom_rules(jaxpr, seed: set, inside: bool = False) -> int:
    """How many weight products run inside ``jax.custom_jvp``/``custom_vjp`` functions: functions with
    their author's gradient, which a rewrite of the body would break."""
    weights, n = derived_from(jaxpr, seed), 0
    for eqn in jaxpr.eqns:
        n += inside and _weight_product(eqn, weights)
        custom = eqn.primitive.name in ("custom_jvp_call", "custom_vjp_call")
        body = eqn.params["call_jaxpr"].jaxpr if custom else _body(eqn)
        if body is not None:
            n += _in_custom_rules(body, inner_seed(body, eqn, weights), inside or custom)
        n += sum(_in_custom_rules(b.jaxpr, s, inside) for b, s in _branches(eqn, weights))
    return n


def fp8_matmuls(fn: Callable) -> Callable:
    """``fn(model, ...)`` with each product of a weight and an activation as `fp8_dot` (see the module's
    text); an error when there is none, as fp8 would then change nothing."""

    @functools.wraps(fn)
    def run(*args):
        with plain_checkpoints():  # redeqx.remat's blocks as jax.checkpoint: the rewrite sees into them
            closed, leaves, rebuild = traced(fn, *args)
        n_model = len(jax.tree.leaves(eqx.filter(args[0], eqx.is_array)))
        seed = set(closed.jaxpr.invars[:n_model])
        output = _OutputLayer()
        output.walk(closed.jaxpr, [False] * len(closed.jaxpr.outvars), seed)
        rewrite = _Fp8(output.found)
        outs = rewrite.eval(closed.jaxpr, closed.consts, leaves, seed)
        if rewrite.converted == 0:
            hidden = _in_custom_rules(closed.jaxpr, seed)
            raise ValueError(
                f"fp8=True, but loss_fn {getattr(fn, '__name__', '?')!r} multiplies no weight of the model by an "
                "activation with jax.lax.dot_general (a Linear layer, x @ W) outside its output layer (the products "
                f"whose result feeds no other weight product: {len(output.found)} here, kept in the compute dtype): "
                "there is nothing to run in fp8." + (
                    f" {hidden} weight products are inside jax.custom_jvp or jax.custom_vjp functions, whose "
                    "gradients are their author's rules: the rewrite leaves those in the compute dtype. Call the "
                    "layers outside such a function to run them in fp8." if hidden else ""))
        return rebuild(outs)

    return run
