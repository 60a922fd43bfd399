"""Step-time overhead of redeqx.make_train_step vs a hand-written jax.jit + optax step.

    python -m benchmarks.overhead            # writes the numbers to benchmarks/RESULTS.md
    python -m benchmarks.overhead --rounds 1 --steps 2 --no-write

The same small transformer, batch and placement, on 1 device and on 8
simulated CPU devices (n_model_shards=2), the steps alternating step by step.
A third runner calls the jitted program inside redeqx's step directly, which
splits the ratio into the program's difference and the wrapper's Python.
"""

from benchmarks._common import alternate, cpu_devices, parser, report

cpu_devices(8)

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import optax  # noqa: E402
from tiny_transformer import TinyLM, collate_tokens, lm_loss, token_examples  # noqa: E402

import redeqx  # noqa: E402


def hand_written_step(optimizer, static):
    def step(params, opt_state, batch, key):
        key, sub = jax.random.split(key)

        def loss(p):
            return lm_loss(eqx.combine(p, static), batch, sub)

        (value, aux), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        metrics = {"loss": value, "grad_norm": optax.tree.norm(grads), **aux}
        return optax.apply_updates(params, updates), opt_state, key, metrics

    return jax.jit(step, donate_argnums=(0, 1))


def measure(devices, n_model_shards, args):
    mesh = redeqx.make_mesh(n_model_shards, devices=devices)
    model = TinyLM(vocab=args.vocab, dim=args.dim, n_heads=8, hidden=4 * args.dim, n_layers=args.layers,
                   key=jax.random.key(0))
    specs = redeqx.sharding_rules(model, mesh)
    optimizer = optax.adamw(1e-3)
    batch = next(redeqx.batches(token_examples(args.batch, seq_len=args.seq, vocab=args.vocab), collate_tokens,
                                args.batch // mesh.shape["data"], mesh))
    state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1))
    ours = redeqx.make_train_step(lm_loss, optimizer, mesh, specs)

    def hand_runner():
        params, static = eqx.partition(redeqx.shard(model, specs, mesh), eqx.is_array)
        params = jax.tree.map(lambda x: x.copy(), params)  # own buffers: every step donates its own
        hand = hand_written_step(optimizer, static)
        other = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1))
        hand_state = [params, other.opt_state, other.key]

        def run():
            *hand_state[:], metrics = hand(hand_state[0], hand_state[1], batch, hand_state[2])
            return metrics

        return run

    def run_ours():
        nonlocal state
        state, metrics = ours(state, batch)
        return metrics

    def program_runner():  # redeqx's compiled program without the wrapper around it
        own = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(1))
        jitted, arrays, *_ = ours._compiled._lookup(own, abstract=False)
        args, held = ours._compiled._args((batch,)), [arrays]

        def run():
            held[0], metrics = jitted(held[0], args)
            return metrics

        return run

    medians = alternate({"ours": run_ours, "hand": hand_runner(), "program": program_runner()},
                        args.rounds, args.steps)
    return medians["ours"], medians["hand"], medians["program"]


def main():
    p = parser(__doc__, dim=128, layers=2, vocab=512, seq=64, batch=16, steps=20, rounds=10)
    args = p.parse_args()

    rows = []
    for name, devices, k in [("1 device", jax.devices()[:1], 1), ("8 devices, n_model_shards=2", jax.devices(), 2)]:
        ours, hand, program = measure(devices, k, args)
        rows.append((name, ours, hand, program))
        print(f"{name}: redeqx {ours * 1e3:.2f} ms, hand-written {hand * 1e3:.2f} ms (ratio {ours / hand:.3f}), "
              f"redeqx's program alone {program * 1e3:.2f} ms")

    lines = [
        f"TinyLM dim={args.dim} layers={args.layers} vocab={args.vocab}, batch {args.batch} x {args.seq} tokens, "
        f"AdamW; medians over {args.rounds} rounds x {args.steps} strictly alternating steps "
        f"({jax.devices()[0].platform}).",
        "",
        "| setting | redeqx step | hand-written jax.jit + optax | ratio: overhead (target <= 1.03) "
        "| redeqx's jitted program called directly | its ratio to hand-written |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| {n} | {o * 1e3:.2f} ms | {h * 1e3:.2f} ms | {o / h:.3f} | {g * 1e3:.2f} ms | {g / h:.3f} |"
              for n, o, h, g in rows]
    report(args, "Step overhead (benchmarks/overhead.py)", "\n".join(lines))


if __name__ == "__main__":
    main()
