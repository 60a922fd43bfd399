"""FFTs, ``top_k``, grouped convolutions and convolutions grouped by example in a train step, before
and after they ran on each data shard's rows (`redeqx.steps._per_shard`), by the compiler that runs
the step.

    python -m benchmarks.per_shard_ops --before /path/to/old/src   # writes its RESULTS.md section
    python -m benchmarks.per_shard_ops --no-write

For each model, one SGD training step per device with the specs ``sharding_rules(model, mesh,
loss_fn=..., batch=...)`` reads from the program (`plans_vs_hand.figures`: collective bytes as the
compiler moves them, the compiled program's FLOPs and peak bytes per device), on 8 devices at 1 and
2 model shards (data 8; data 4 x model 2), compiled (nothing run) by XLA:CPU (8 simulated devices),
libtpu (8 TPU v4 chips, none attached: benchmarks/.venv-tpu) and XLA:GPU (8 H100s of one host, none
attached: benchmarks/.venv-gpu), each with this tree's redeqx and with the one at ``--before``. Each
compile runs in its own process: one the compiler aborts (XLA's partitioner did, on a convolution
grouped by example) is reported as such.
"""

import os
import signal

from benchmarks._common import WorkerFailed, compiler, gpu_compiler, parser, report, serve, source_named, worker


def cases():
    """``(name, model, loss, abstract batch)``."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from _helpers import mse_loss, next_token_loss, xent_loss  # the tests' losses (tests/ is on the path)

    from redeqx.models import MixtralConfig, MixtralForCausalLM

    class Spectral(eqx.Module):  # a Fourier neural operator's layer, as neuraloperator writes it
        weights: jax.Array  # (in, out, modes), complex64
        bypass: eqx.nn.Conv1d

        def __init__(self, width, modes, key):
            k1, k2, k3 = jax.random.split(key, 3)
            shape = (width, width, modes)
            self.weights = (jax.random.uniform(k1, shape) + 1j * jax.random.uniform(k2, shape)) / width ** 2
            self.bypass = eqx.nn.Conv1d(width, width, 1, key=k3)

        def __call__(self, x):  # (C, N)
            modes = self.weights.shape[-1]
            low = jnp.einsum("im,iom->om", jnp.fft.rfft(x)[:, :modes], self.weights)
            full = jnp.zeros((x.shape[0], x.shape[1] // 2 + 1), low.dtype).at[:, :modes].set(low)
            return jax.nn.gelu(jnp.fft.irfft(full, n=x.shape[1]) + self.bypass(x))

    class FNO(eqx.Module):
        lift: eqx.nn.Conv1d
        layers: list
        head: eqx.nn.MLP

        def __init__(self, width, modes, depth, key):
            ks = jax.random.split(key, depth + 2)
            self.lift = eqx.nn.Conv1d(2, width, 1, key=ks[0])
            self.layers = [Spectral(width, modes, k) for k in ks[1:-1]]
            self.head = eqx.nn.MLP(width, 1, 128, 1, key=ks[-1])

        def __call__(self, x):  # (2, N) -> (N,)
            x = self.lift(x)
            for layer in self.layers:
                x = layer(x)
            return jax.vmap(self.head, in_axes=1)(x)[:, 0]

    class Bottleneck(eqx.Module):  # ResNeXt's block: 1x1, a grouped 3x3 (32 groups), 1x1
        reduce: eqx.nn.Conv2d
        grouped: eqx.nn.Conv2d
        expand: eqx.nn.Conv2d

        def __init__(self, width, inner, key):
            k1, k2, k3 = jax.random.split(key, 3)
            self.reduce = eqx.nn.Conv2d(width, inner, 1, key=k1)
            self.grouped = eqx.nn.Conv2d(inner, inner, 3, padding=1, groups=32, key=k2)
            self.expand = eqx.nn.Conv2d(inner, width, 1, key=k3)

        def __call__(self, x):
            return jax.nn.relu(x + self.expand(jax.nn.relu(self.grouped(jax.nn.relu(self.reduce(x))))))

    class ResNeXt(eqx.Module):
        stem: eqx.nn.Conv2d
        blocks: list
        head: eqx.nn.Linear

        def __init__(self, key):
            ks = jax.random.split(key, 4)
            self.stem = eqx.nn.Conv2d(3, 256, 3, padding=1, key=ks[0])
            self.blocks = [Bottleneck(256, 128, k) for k in ks[1:3]]
            self.head = eqx.nn.Linear(256, 100, key=ks[3])

        def __call__(self, x):
            x = self.stem(x)
            for block in self.blocks:
                x = block(x)
            return self.head(x.mean((1, 2)))

    class PointwiseCNN(eqx.Module):  # a 1x1 lift, a 3x3 and a depthwise 3x3 convolution, pooled
        lift: eqx.nn.Conv2d
        conv: eqx.nn.Conv2d
        depthwise: eqx.nn.Conv2d
        head: eqx.nn.Linear

        def __init__(self, key):
            ks = jax.random.split(key, 4)
            self.lift = eqx.nn.Conv2d(3, 64, 1, key=ks[0])
            self.conv = eqx.nn.Conv2d(64, 64, 3, padding=1, key=ks[1])
            self.depthwise = eqx.nn.Conv2d(64, 64, 3, padding=1, groups=64, key=ks[2])
            self.head = eqx.nn.Linear(64, 10, key=ks[3])

        def __call__(self, x):
            x = jnp.tanh(self.depthwise(jnp.tanh(self.conv(jnp.tanh(self.lift(x))))))
            return self.head(x.mean((1, 2)))

    def scored_loss(model, batch, key):  # the loss, and each example's gradient norm (GraNd, DP-SGD's clip)
        one = lambda m, x, y: xent_loss(m, {"x": x[None], "y": y[None]}, key)
        grads = jax.vmap(eqx.filter_grad(one), in_axes=(None, 0, 0))(model, batch["x"], batch["y"])
        norms = jnp.sqrt(sum(jnp.sum(g.reshape(len(g), -1) ** 2, axis=1) for g in jax.tree.leaves(grads)))
        return xent_loss(model, batch, key), {"grad_norm_per_example": jnp.mean(norms)}

    key, f32 = jax.random.key(0), jnp.float32
    yield ("FNO 1-D (64 wide, 16 modes, 4 layers), 64 fields of 1,024 points", FNO(64, 16, 4, key), mse_loss,
           {"x": jax.ShapeDtypeStruct((64, 2, 1024), f32), "y": jax.ShapeDtypeStruct((64, 1024), f32)})
    yield ("ResNeXt bottlenecks (256 -> 128 in 32 groups, 2 blocks), 32 images of 32 x 32", ResNeXt(key), xent_loss,
           {"x": jax.ShapeDtypeStruct((32, 3, 32, 32), f32), "y": jax.ShapeDtypeStruct((32,), jnp.int32)})
    config = MixtralConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2)
    yield ("the zoo's Mixtral (256 wide, 4 layers, 8 experts, top 2), 16 x 512 tokens",
           eqx.filter_eval_shape(MixtralForCausalLM, config, key=key), next_token_loss,
           {"ids": jax.ShapeDtypeStruct((16, 513), jnp.int32)})
    yield ("a CNN (1x1, 3x3, depthwise 3x3; 64 channels) scoring each example's gradient, 32 images of 16 x 16",
           PointwiseCNN(key), scored_loss,
           {"x": jax.ShapeDtypeStruct((32, 3, 16, 16), f32), "y": jax.ShapeDtypeStruct((32,), jnp.int32)})


def names() -> list:
    """The cases' names, in order."""
    return [name for name, *_ in cases()]


def measure(platform: str, index: int, n: int) -> dict:
    """The figures of case ``index`` at ``n`` model shards, compiled for ``platform``'s 8 devices."""
    import itertools

    import jax

    from benchmarks._common import gpu_devices, tpu_v4_devices
    from benchmarks.plans_vs_hand import figures

    jax.config.update("jax_numpy_rank_promotion", "raise")
    devices = {"tpu": tpu_v4_devices, "gpu": gpu_devices}.get(platform, lambda n: jax.devices()[:n])(8)
    name, model, loss, batch = next(itertools.islice(cases(), index, None))
    found = figures(model, loss, batch, n, devices, loss_fn=loss, batch=batch)
    print(platform, name, n, found, flush=True)
    return found


def measured(python: str, env: dict, platform: str, index: int, n: int) -> dict | None:
    """`measure` in its own process; None where the compiler aborted the process (SIGABRT)."""
    try:
        return worker(__file__, "measure", python=python, env=env, platform=platform, index=index, n=n)
    except WorkerFailed as e:
        if e.returncode != -signal.SIGABRT:
            raise
        print(e, flush=True)
        return None


def main():
    p = parser(__doc__)
    p.add_argument("--before", default=None, help="a redeqx src directory to compile the steps with first")
    args = p.parse_args()
    compilers = {"XLA:CPU": (*compiler(False), "cpu"), "libtpu": (*compiler(True), "tpu"),
                 "XLA:GPU": (*gpu_compiler(), "gpu")}
    rows = ["| compiler | model | model shards | before: bytes / FLOPs / peak (MiB, G, MiB) | now | now / before: "
            "bytes | FLOPs | peak |", "|---|---|---|---|---|---|---|---|"]
    text = lambda f: "aborted" if f is None else (
        f"{f['bytes'] / 2**20:.2f} / " + (f"{f['flops'] / 1e9:.2f}" if f["flops"] else "n/a") + f" / {f['peak'] / 2**20:.1f}")
    for label, (python, env, platform) in compilers.items():
        old = args.before and dict(env, PYTHONPATH=os.pathsep.join([os.path.abspath(args.before), env["PYTHONPATH"]]))
        for index, name in enumerate(worker(__file__, "names")):
            for n in (1, 2):
                was = measured(python, old, platform, index, n) if old else None
                fig = measured(python, env, platform, index, n)
                ratios = " | ".join(f"{fig[x] / was[x]:.2f}" if was and fig and was[x] and fig[x] is not None
                                    else "n/a" for x in ("bytes", "flops", "peak"))
                rows.append(f"| {label} | {name} | {n} | {text(was) if args.before else ''} | {text(fig)} | {ratios} |")
    report(args, "FFTs, top_k and grouped convolutions on each data shard (benchmarks/per_shard_ops.py)", f"""
One SGD training step per device on 8 devices (model shards 1: data 8; 2: data 4 x model 2), compiled by
each compiler with the specs the rules read from the program: collective bytes per device as that compiler
moves them (on XLA:CPU, as an accelerator's XLA would: `tests/accelerator_count.py`), the compiled program's
FLOPs and its peak bytes per device. "before": redeqx at {source_named(args.before)}, whose steps left
these operations to XLA's partitioner, which all-gathers their operand (the global batch) onto every device
(or, for a convolution grouped by example, aborted the process compiling it on XLA:CPU and XLA:GPU).

{chr(10).join(rows)}
""")


if __name__ == "__main__" and not serve(globals()):
    main()
