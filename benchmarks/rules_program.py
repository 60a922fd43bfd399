"""The rules read from the program (issue 29) against the name rules alone.

    python -m benchmarks.rules_program            # writes its RESULTS.md section
    python -m benchmarks.rules_program --models 2 --no-write   # the first 2 models only

For every model of the tests and the six ways of writing a model issue 29
lists: the collective bytes of one training step as an accelerator moves them
(tests/accelerator_count.py) with the specs of ``sharding_rules(model, mesh)``
and of ``sharding_rules(model, mesh, loss_fn=..., batch=...)``, at 2 and 4
model shards; and how long reading a 70B-shaped and a 1B program takes.
"""

import itertools
import os
import time

from benchmarks._common import cpu_devices, parser, report

cpu_devices(8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import redeqx  # noqa: E402
from redeqx import models  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")


def step_bytes(model, loss, data, n, **rules) -> int:
    from test_rules_program import step_bytes as measured  # the tests' own measure

    return measured(model, loss, data, n, **rules)[0]


def cases():
    import test_models_stacked as zoo
    import test_rules_cells_convs as cells
    import test_rules_fused_qkv as fused
    import test_rules_moe as moe
    import test_users_models as users
    import written_otherwise as w
    from tiny_transformer import TinyLM, collate_tokens, lm_loss, token_examples
    from user_gpt import collate_fn, loss_fn, make_examples

    key = jax.random.key(0)
    rng = np.random.default_rng(0)
    gpt_batch = collate_fn(make_examples(16, seq=16, vocab=64))
    images = {"x": rng.normal(size=(16, 3, 16, 16)).astype(np.float32), "y": rng.integers(0, 10, 16).astype(np.int32)}
    small_images = {"x": rng.normal(size=(16, 1, 8, 8)).astype(np.float32),
                    "y": rng.integers(0, 10, 16).astype(np.int32)}
    vectors = {"x": rng.normal(size=(16, 16)).astype(np.float32), "y": rng.integers(0, 10, 16).astype(np.int32)}
    tokens = {"tokens": rng.integers(0, 64, (16, 17)).astype(np.int32)}
    yield "user GPT (eqx.nn.Linear, tests/user_gpt.py)", w.reference_gpt(key), loss_fn, gpt_batch
    for kind, what in (("raw", "raw (out, in) arrays named W*"), ("flax", "Flax (in, out) kernels, x @ w"),
                       ("scan", "unannotated stack under lax.scan")):
        yield f"GPT, {what}", w.OtherGPT(kind, key=key), w.gpt_loss, gpt_batch
    yield "ViT with a conv patch embedding", w.ViT(key=key), w.image_loss, images
    yield "Meta-style GQA LM (8 heads, 2 KV)", w.MetaLM(key=key), w.gpt_loss, tokens
    yield "nested eqx.nn.Sequential", w.nested_mlp(key), w.vector_loss, vectors
    lm_batch = collate_tokens(token_examples(16, seq_len=16, vocab=128))
    yield "TinyLM (tests/tiny_transformer.py)", TinyLM(vocab=128, dim=32, n_heads=4, hidden=128, n_layers=2,
                                                        key=key), lm_loss, lm_batch
    yield "eqx.nn.MLP", __import__("equinox").nn.MLP(16, 10, 64, depth=3, key=key), w.vector_loss, vectors
    yield "CNN (tests/test_users_models.py)", users.CNN(key), users.image_loss, small_images
    yield "ViT (tests/test_users_models.py)", users.ViT(key), users.image_loss, small_images
    moe_batch = collate_tokens(token_examples(16, seq_len=8, vocab=moe.VOCAB))
    yield "MoE LM, stacked experts (tests/test_rules_moe.py)", moe.MoELM(moe.MoE, 4, key=key), lm_loss, moe_batch
    yield "MoE LM, SparseMoeBlock", moe.MoELM(moe.SparseMoeBlock, 4, key=key), lm_loss, moe_batch
    fused_batch = collate_fn(make_examples(16, seq=fused.SEQ, vocab=fused.VOCAB))
    for attention in (fused.TimmAttention, fused.LucidAttention, fused.InterleavedAttention):
        yield f"GPT with fused QKV, {attention.__name__}", fused.gpt_with(attention), loss_fn, fused_batch
    convs = {"x": rng.normal(size=(16, 4, 8, 8)).astype(np.float32), "y": rng.integers(0, 4, 16).astype(np.int32)}
    yield "MobileNet block (depthwise + grouped convs)", cells.MobileBlock(key=key), cells.loss_fn, convs
    ids = {"x": np.asarray(zoo.ids(n=16))}
    for family in sorted(zoo.CONFIGS):
        for stacked in (False, True):
            def zoo_loss(m, batch, key, family=family):
                labels = batch["x"] if family not in zoo.ENC_DEC else batch["x"][:, :6]
                logits = zoo.forward(m, family, batch["x"])
                return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
            yield f"zoo {family}, {'stacked' if stacked else 'listed'}", zoo.build(family, stacked), zoo_loss, ids


def bytes_table(limit: int | None) -> str:
    rows = ["| model | n | names (KiB) | program (KiB) | program / names |", "|---|---|---|---|---|"]
    for name, model, loss, batch in itertools.islice(cases(), limit):
        for n in (2, 4):
            try:
                by_names = step_bytes(model, loss, batch, n)
                by_program = step_bytes(model, loss, batch, n, loss_fn=loss, batch=batch)
            except Exception as e:  # say it in the table rather than stop the run
                rows.append(f"| {name} | {n} | error: {type(e).__name__}: {str(e)[:120]} | | |")
                continue
            ratio = by_program / by_names if by_names else float("nan")
            rows.append(f"| {name} | {n} | {by_names / 1024:.1f} | {by_program / 1024:.1f} | {ratio:.3f} |")
            print(rows[-1], flush=True)
    return "\n".join(rows)


def read_times() -> str:
    def llama(layers, stacked, **shape):
        return models.LlamaConfig(num_hidden_layers=layers, scan_layers=stacked, **shape)

    def loss(model, batch, key):
        logits = jax.vmap(model)(batch["ids"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["ids"][:, 1:]).mean()

    shapes = {
        "LLaMA-70B-shaped, 80 layers stacked": (llama(80, True, vocab_size=32000, hidden_size=8192,
                                                      intermediate_size=28672, num_attention_heads=64,
                                                      num_key_value_heads=8), 8),
        "LLaMA-1B (TinyLlama shape), 22 layers listed": (llama(22, False, vocab_size=32000, hidden_size=2048,
                                                               intermediate_size=5632, num_attention_heads=32,
                                                               num_key_value_heads=4), 8),
    }
    batch = {"ids": jax.ShapeDtypeStruct((8, 2049), jnp.int32)}
    rows = ["| model | n_model_shards | names alone (s) | with the program (s) | same specs |", "|---|---|---|---|---|"]
    for name, (config, n) in shapes.items():
        abstract = __import__("equinox").filter_eval_shape(lambda k: models.LlamaForCausalLM(config, key=k),
                                                           jax.random.key(0))
        mesh = redeqx.make_mesh(n)
        t0 = time.perf_counter()
        by_names = redeqx.sharding_rules(abstract, mesh)
        t1 = time.perf_counter()
        by_program = redeqx.sharding_rules(abstract, mesh, loss_fn=loss, batch=batch)
        t2 = time.perf_counter()
        same = jax.tree.leaves(by_names, is_leaf=lambda x: x is None or hasattr(x, "index")) == \
            jax.tree.leaves(by_program, is_leaf=lambda x: x is None or hasattr(x, "index"))
        rows.append(f"| {name} | {n} | {t1 - t0:.2f} | {t2 - t1:.2f} | {same} |")
        print(rows[-1], flush=True)
    return "\n".join(rows)


def main():
    p = parser(__doc__)
    p.add_argument("--models", type=int, default=None, help="only the first this many models of the bytes table")
    args = p.parse_args()
    times = read_times()
    table = bytes_table(args.models)
    report(args, "Rules read from the program (issue 29)", f"""
Reading the program: `sharding_rules` with `loss_fn=` and
`batch=` (a `jax.ShapeDtypeStruct` batch of 8 x 2048 tokens) traces the loss on abstract shapes (nothing
computed) and walks its jaxpr once; the 70B model's scan body is walked once for its 80 layers.

{times}

Collective bytes of one SGD training step, as an accelerator's XLA moves them (`tests/accelerator_count.py`),
per device, with the specs of the name rules alone and of the rules reading the program; tiny configs of
every model the tests train, and the six ways of writing a model issue 29 lists.

{table}
""")


if __name__ == "__main__":
    main()
