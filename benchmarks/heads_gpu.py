"""One context shard's attention at 32k tokens, on one GPU: the heads split against the unsplit
attention and against the blockwise code the gather and the ring run (issue 51, item 2's target).

    python -m benchmarks.heads_gpu --smoke              # tiny shapes on any platform: checks the script
    python -m benchmarks.heads_gpu                      # on a GPU: 8B-shaped attention, 32k tokens, C = 4

With ``C`` context shards, ``redeqx.attention(impl="heads")`` trades q, k and v by all-to-all so
that each device holds every token of ``1 / C`` of the heads, puts them in the sequence's own order,
runs the unsplit path on them (cuDNN's flash attention on a GPU in bf16) and puts the result back in
the layout's order for the trade back. One GPU can run that work for one shard; the all-to-alls
between devices it cannot, so they are left out (their bytes are in RESULTS' "Long context"). Each
variant is the forward and backward of ``sum(attention(q, k, v) * w)``, causal, in bf16:

- ``unsplit``: ``redeqx.attention`` on a mesh without a context axis, every head;
- ``heads shard``: one device's work in the heads split: ``1 / C`` of the query heads and of the KV
  heads (repeated first where ``C`` does not divide them, as the split does), reordered from the
  dual-chunk layout, attended, reordered back (`redeqx.context._context.heads_work`: cuDNN's kernel
  on a GPU). Target: <= 1.1x a quarter of ``unsplit``;
- ``blockwise / C``: the blockwise code of ``impl="gather"`` and ``"ring"`` over the whole sequence
  on a context axis of one device (the same blocks the ``C`` shards compute between them, which the
  dual-chunk order shares out equally), divided by ``C``: a shard's compute in those splits, before
  the gather's or the ring's transfers.

The cuDNN attention calls in each compiled program are counted (``__cudnn$fmha``), so a variant that
did not reach the kernel says so.
"""

from __future__ import annotations

import argparse
import json
import re

C = 4


def _attention_custom_calls(compiled) -> int:
    return len(re.findall(r'custom_call_target="__cudnn\$fmha', compiled.as_text()))


def heads_bench(smoke: bool = False) -> dict:
    """The three variants' seconds per forward + backward, timed side by side, and their cuDNN calls."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import redeqx
    from benchmarks._common import alternate
    from redeqx.context._blockwise import Span
    from redeqx.context._context import heads_work, kv_heads_for_split

    t, hq, hkv, d = (256, 8, 2, 64) if smoke else (32768, 32, 8, 128)
    keys = jax.random.split(jax.random.key(0), 4)
    q, w = (jax.random.normal(k, (1, t, hq, d), jnp.bfloat16) for k in (keys[0], keys[3]))
    k, v = (jax.random.normal(k, (1, t, hkv, d), jnp.bfloat16) for k in keys[1:3])

    def shard_work(q, k, v):  # what a device of the split runs between its all-to-alls
        return heads_work(q[0], k[0], v[0], None, Span(causal=True), d**-0.5, C)[None]

    def grad_of(attend):
        loss = lambda q, k, v, w: jnp.sum((attend(q, k, v) * w).astype(jnp.float32))  # noqa: E731
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

    k_rep, v_rep = (kv_heads_for_split(x[0], C)[None] for x in (k, v))
    shard_args = (q[:, :, : hq // C], k_rep[:, :, : k_rep.shape[2] // C], v_rep[:, :, : v_rep.shape[2] // C],
                  w[:, :, : hq // C])
    one = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "context", "model"))
    compiled = {"unsplit": grad_of(lambda q, k, v: redeqx.attention(q, k, v, causal=True)).lower(q, k, v, w).compile(),
                "heads shard": grad_of(shard_work).lower(*shard_args).compile()}
    with jax.set_mesh(one):  # a context axis of one device: the blockwise code, nothing split
        compiled["blockwise"] = grad_of(lambda q, k, v: redeqx.attention(q, k, v, causal=True)
                                        ).lower(q, k, v, w).compile()
    args = {"unsplit": (q, k, v, w), "heads shard": shard_args, "blockwise": (q, k, v, w)}
    runners = {name: (lambda c=c, a=args[name]: jax.block_until_ready(c(*a))) for name, c in compiled.items()}
    times = alternate(runners, rounds=2 if smoke else 3, steps=2 if smoke else 5)
    return {"tokens": t, "q_heads": hq, "kv_heads": hkv, "head_dim": d, "context_shards": C,
            "platform": jax.devices()[0].platform, **{f"{n}_s": s for n, s in times.items()},
            **{f"{n}_cudnn_calls": _attention_custom_calls(c) for n, c in compiled.items()},
            "heads_over_quarter": times["heads shard"] / (times["unsplit"] / C),
            "blockwise_over_heads": times["blockwise"] / C / times["heads shard"]}


def render(sec: dict) -> list[str]:
    c = sec["context_shards"]
    quarter = sec["unsplit_s"] / c
    rows = [f"**One context shard's attention** ({sec['tokens']:,} tokens, {sec['q_heads']} query / "
            f"{sec['kv_heads']} KV heads of {sec['head_dim']}, causal, bf16, forward and backward; C = {c}, "
            "the all-to-alls or the ring's transfers left out; target: heads <= 1.1x a quarter of unsplit):", "",
            "| variant | time | against unsplit / C | cuDNN attention calls |", "|---|---|---|---|",
            f"| unsplit, every head | {sec['unsplit_s'] * 1e3:.2f} ms | {c:.2f}x | {sec['unsplit_cudnn_calls']} |",
            f"| heads split, one shard | {sec['heads shard_s'] * 1e3:.2f} ms | {sec['heads_over_quarter']:.2f}x | "
            f"{sec['heads shard_cudnn_calls']} |",
            f"| blockwise (gather, ring) / C | {sec['blockwise_s'] / c * 1e3:.2f} ms | "
            f"{sec['blockwise_s'] / c / quarter:.2f}x | {sec['blockwise_cudnn_calls']} |"]
    return rows + ["", f"A shard's attention in the heads split takes {sec['heads_over_quarter']:.2f}x a quarter "
                       f"of the unsplit attention's time; the blockwise code's share, {sec['blockwise_over_heads']:.2f}x "
                       "the heads split's."]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, any platform")
    args = p.parse_args()
    sec = heads_bench(args.smoke)
    print(json.dumps(sec))
    print("\n".join(render(sec)))


if __name__ == "__main__":
    main()
