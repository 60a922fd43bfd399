"""Collective bytes of a train step with ``accumulate=k`` micro-batches, by the compiler that runs it.

    python -m benchmarks.accumulate_bytes            # writes its RESULTS.md section
    python -m benchmarks.accumulate_bytes --no-write

An MLP (64 -> 256 x 3 -> 10, AdamW, a global batch of 64) on 8 devices, at 1 and 2 model shards and
k = 1, 2, 4: the all-reduce bytes per device of the compiled step, as XLA:CPU (8 simulated devices),
libtpu (8 TPU v4 chips, none attached: benchmarks/.venv-tpu) and XLA:GPU (8 H100s, none attached:
benchmarks/.venv-gpu) compile it. XLA:CPU all-reduces the gradients once per micro-batch; the
accelerators' compilers move that all-reduce out of the micro-batches' loop. `redeqx.plan` run on CPU
devices says so where a plan uses accumulation.
"""

from benchmarks._common import compiler, gpu_compiler, parser, report, serve, worker

KS = (1, 2, 4)


def step_bytes(platform: str) -> dict:
    """``{"n_model=..., k=...": all-reduce bytes}`` of the step compiled for ``platform``'s devices."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    import redeqx
    from benchmarks._common import gpu_devices, tpu_v4_devices
    from redeqx.planner._hlo import collectives, summarise
    from redeqx.planner._plan import _abstract_batch

    devices = {"tpu": tpu_v4_devices, "gpu": gpu_devices}.get(platform, lambda n: jax.devices()[:n])(8)

    def loss_fn(model, batch, key):
        logits = jax.vmap(model)(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    model = eqx.filter_eval_shape(lambda: eqx.nn.MLP(64, 10, 256, depth=3, key=jax.random.key(0)))
    batch = {"x": jax.ShapeDtypeStruct((64, 64), jnp.float32), "y": jax.ShapeDtypeStruct((64,), jnp.int32)}
    optimizer, out = optax.adamw(1e-3), {}
    for n in (1, 2):
        mesh = redeqx.make_mesh(n, devices=devices)
        specs = redeqx.sharding_rules(model, mesh)
        state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(0))
        for k in KS:
            step = redeqx.make_train_step(loss_fn, optimizer, mesh, specs, accumulate=k)
            with jax.set_mesh(mesh):
                text = step.trace(state, _abstract_batch(batch, mesh)).lower().compile().as_text()
            out[f"n_model={n}, k={k}"] = summarise(collectives(text)).get("all-reduce", {}).get("bytes", 0)
    return out


def main() -> None:
    args = parser(__doc__).parse_args()
    runs = {"XLA:CPU (8 simulated devices)": worker(__file__, "step_bytes", platform="cpu")}
    python, env = compiler(tpu=True)
    runs["libtpu (8 v4 chips)"] = worker(__file__, "step_bytes", python=python, env=env, platform="tpu")
    python, env = gpu_compiler()
    runs["XLA:GPU (8 H100s)"] = worker(__file__, "step_bytes", python=python, env=env, platform="gpu")
    header = "| compiler | model shards | " + " | ".join(f"accumulate={k}" for k in KS) + " |"
    rows = [header, "|---|---|" + "---|" * len(KS)]
    for name, found in runs.items():
        for n in (1, 2):
            rows.append(f"| {name} | {n} | " + " | ".join(f"{found[f'n_model={n}, k={k}']:,}" for k in KS) + " |")
    body = ("All-reduce bytes per device of one train step of an MLP (64 -> 256 x 3 -> 10, AdamW, 64 rows), "
            "by the compiler that runs it:\n\n" + "\n".join(rows))
    report(args, "Accumulated steps' collective bytes by compiler (benchmarks/accumulate_bytes.py)", body)


if __name__ == "__main__" and not serve(globals()):
    main()
