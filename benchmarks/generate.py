"""Cached greedy decoding vs recomputing the whole prefix, and the peak host
memory of from_pretrained.

    python -m benchmarks.generate          # ~2 minutes on a laptop CPU; writes its section of RESULTS.md
    python -m benchmarks.generate --new 8 --no-write
"""

import os
import subprocess
import sys
import tempfile

from benchmarks._common import parser, report, timed

import jax
import jax.numpy as jnp
import numpy as np

from redeqx.models import LlamaConfig, LlamaForCausalLM, generate

BATCH, PROMPT = 4, 64


def decode_speed(new: int):
    config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4)
    model = LlamaForCausalLM(config, key=jax.random.key(0))
    prompt = jax.random.randint(jax.random.key(1), (BATCH, PROMPT), 0, config.vocab_size)

    cached = jax.jit(lambda m, p: generate(m, p, max_new_tokens=new))

    @jax.jit
    def recompute(m, p):
        # the same greedy decoding without a cache: each step runs the whole
        # (fixed-size, causally masked) buffer and reads the logits at the end
        buf = jnp.concatenate([p, jnp.zeros((BATCH, new), p.dtype)], axis=1)

        def body(i, buf):
            logits = jax.vmap(m)(buf)  # (B, PROMPT + new, V)
            nxt = jnp.argmax(logits[:, PROMPT - 1 + i], axis=-1).astype(buf.dtype)
            return buf.at[:, PROMPT + i].set(nxt)

        return jax.lax.fori_loop(0, new, body, buf)[:, PROMPT:]

    def tokens_per_s(fn):
        best = min(timed(lambda: fn(model, prompt), 4)[1:])  # the first compiles
        return BATCH * new / best, fn(model, prompt)

    fast, a = tokens_per_s(cached)
    slow, b = tokens_per_s(recompute)
    assert np.array_equal(np.asarray(a), np.asarray(b)), "cached and recomputed greedy tokens differ"
    return fast, slow


_LOAD = """
import sys, jax, redeqx
from redeqx.models import from_pretrained

def kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1])

redeqx.make_mesh(1)
base = kib("VmRSS:")  # resident memory now, with jax and XLA started
model = from_pretrained(sys.argv[1], redeqx.make_mesh(1))
jax.block_until_ready(model)
print(base, kib("VmHWM:"))  # high-water mark of resident memory
"""


def load_memory():
    from redeqx.models import save_pretrained

    config = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                         num_attention_heads=8)
    with tempfile.TemporaryDirectory() as d:
        save_pretrained(LlamaForCausalLM(config, key=jax.random.key(0)), d)
        size = os.path.getsize(os.path.join(d, "model.safetensors"))
        env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
        out = subprocess.run([sys.executable, "-c", _LOAD, d], capture_output=True, text=True, env=env, check=True)
        base_kib, peak_kib = map(int, out.stdout.split()[-2:])
    return size, (peak_kib - base_kib) * 1024


def main():
    p = parser(__doc__)
    p.add_argument("--new", type=int, default=64, help="new tokens per row")
    args = p.parse_args()
    fast, slow = decode_speed(args.new)
    size, extra = load_memory()
    report(args, "Generation (benchmarks/generate.py)", "\n".join([
        f"Machine: {os.cpu_count()} CPU cores, jax {jax.__version__}, backend {jax.default_backend()}.",
        f"LLaMA 4 layers, hidden 256, GQA 8/4 heads, vocab 1024; batch {BATCH}, prompt {PROMPT}, {args.new} new "
        "tokens.",
        "",
        "| greedy decoding | tokens/s |",
        "|---|---|",
        f"| KV cache (redeqx.models.generate) | {fast:,.0f} |",
        f"| recompute the prefix each step | {slow:,.0f} |",
        f"| **ratio** | **{fast / slow:.1f}x** |",
        "",
        f"from_pretrained of a {size / 2**20:.0f} MiB float32 checkpoint (one file): peak host memory "
        f"above the process's footprint before loading = {extra / 2**20:.0f} MiB, "
        f"**{extra / size:.2f}x the checkpoint** (on CPU the loaded model itself lives in host memory, "
        "so 1.0x is the floor)."]))


if __name__ == "__main__":
    main()
