"""Set-ups many test files share: a script run in a fresh Python process (an
example, a worker, `python -m redeqx.launch`), and the small MLP most
single-process tests train, and the pieces every test of a model family
against Transformers' PyTorch reference uses.

    from _helpers import run_example, run_python, mlp, mse_loss, sharded_state
    from _helpers import hf_checkpoints, random_ids, torch_logits, redeqx_logits

`tests/` is on ``sys.path`` under pytest (the directory has no ``__init__.py``),
so a test imports this module by its name.
"""

import os
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import redeqx

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


COLLECTIVES = """
    # every process: redeqx.initialize(), a mesh, an array over it and a jitted sum (a collective)
    import jax, jax.numpy as jnp, numpy as np
    import redeqx
    redeqx.initialize()
    mesh = redeqx.make_mesh()
    x = jax.make_array_from_callback((8,), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")),
                                     lambda idx: np.ones(8, np.float32)[idx])
    total = jax.jit(jnp.sum)
"""


def script_env(**extra) -> dict:
    """The environment a script runs in: this process's, whose ``XLA_FLAGS``
    (set by conftest.py) give 8 CPU devices and the suite's cheaper compiles
    (``FAST_COMPILE``). The examples keep both (they set their device count
    only where ``XLA_FLAGS`` is unset), `redeqx.launch` replaces the device
    count with its split, and a script that sets ``XLA_FLAGS`` itself wins.
    ``extra`` adds or replaces variables."""
    return {**os.environ, **extra}


def run_python(*args, launch=None, env=None, timeout=300, cwd=None, check=True) -> subprocess.CompletedProcess:
    """``python *args``, or ``python -m redeqx.launch *launch *args`` when
    ``launch`` lists the launcher's flags (``launch=("-n", "2")``), in
    :func:`script_env` unless ``env`` is given. With ``check`` (the default) a
    non-zero exit status fails the test, showing the ends of stdout and stderr."""
    cmd = [sys.executable, *(["-m", "redeqx.launch", *map(str, launch)] if launch else []), *map(str, args)]
    done = subprocess.run(cmd, env=script_env() if env is None else env, capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)
    if check:
        assert done.returncode == 0, (done.returncode, done.stdout[-2000:] + done.stderr[-3000:])
    return done


def run_example(script, *flags, launch=None, timeout=300) -> str:
    """Runs ``examples/<script>`` with ``flags`` from the repository root (on 8
    devices, as the script sets by default) and returns its stdout; a failure fails the test."""
    return run_python(EXAMPLES / script, *flags, launch=launch, timeout=timeout, cwd=ROOT).stdout


# --- a small model: an MLP on 8 features, a loss, and its state on a mesh


def mlp(in_size=8, out_size=4, width=16, depth=2, key=0) -> eqx.nn.MLP:
    """``eqx.nn.MLP(in_size, out_size, width, depth)`` from ``jax.random.key(key)``."""
    return eqx.nn.MLP(in_size, out_size, width, depth=depth, key=jax.random.key(key))


def mse_loss(model, batch, key):
    """Mean squared error of ``model`` on ``batch["x"]`` against ``batch["y"]``."""
    return jnp.mean((jax.vmap(model)(batch["x"]) - batch["y"]) ** 2)


def xent_loss(model, batch, key):
    """Cross-entropy of ``model``'s logits on ``batch["x"]`` against integer labels ``batch["y"]``."""
    logits = jax.vmap(model)(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def next_token_loss(model, batch, key):
    """Next-token cross-entropy of a language model on ``batch["ids"]`` ``(B, T+1)``, mean over every position."""
    logits = jax.vmap(model)(batch["ids"][:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["ids"][:, 1:]).mean()


def sharded_state(model, optimizer, mesh, key=1):
    """``model``'s sharding rules on ``mesh`` and a train state built with them: ``(specs, state)``."""
    specs = redeqx.sharding_rules(model, mesh)
    return specs, redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(key))


# --- damage that leaves a checkpoint's files valid


DAMAGES = ("pieces swapped", "values swapped", "signs flipped", "bit flipped")


def damaged(w, damage: str) -> np.ndarray:
    """``w`` (a matrix, split over ``model`` on dim 1) with one of `DAMAGES`;
    a sum of words misses all but the bit flip."""
    w = np.array(w)
    n = w.shape[1]
    if damage == "pieces swapped":  # the two halves a dim-1 split gives
        out = np.concatenate([w[:, n // 2:], w[:, :n // 2]], axis=1)
    elif damage == "values swapped":  # across the two halves
        out = w.copy()
        out[0, 0], out[0, n - 1] = w[0, n - 1], w[0, 0]
    elif damage == "signs flipped":
        out = w.copy()
        out[0, 0], out[3, 5] = -w[0, 0], -w[3, 5]
    elif damage == "bit flipped":
        out = w.copy()
        out.view(np.uint32)[2, 2] ^= 1 << 20
    else:
        raise ValueError(f"damage must be one of {DAMAGES}, got {damage!r}")
    assert not np.array_equal(out, w)
    return out


def ragged(rows, w, sizes):
    """XLA's grouped matmul, rows ``(n, in)`` by ``w`` ``(E, out, in)``: the reference for the kernels."""
    from redeqx.models import _grouped

    return jax.lax.ragged_dot_general(rows, w, sizes, _grouped._ROWS_BY_OUT_IN)


def values_and_grads(f, rows, w, sizes, ct):
    """``f(rows, w, sizes)`` and its gradients with respect to ``rows`` and ``w`` for the cotangent ``ct``."""
    out, vjp = jax.vjp(lambda r, w: f(r, w, sizes), rows, w)
    return (out, *vjp(ct))


def grouped_operands(sizes, dtype):
    """Rows, weights ``(E, 20, 24)`` and an output cotangent for groups of ``sizes`` (rows past their
    sum: 40 rows when they sum to 30, else 37), and the sizes as int32: the grouped-matmul tests' case."""
    m, k, n = (40 if sum(sizes) == 30 else 37), 24, 20
    ks = jax.random.split(jax.random.key(0), 3)
    rows = jax.random.normal(ks[0], (m, k), jnp.float32).astype(dtype)
    w = jax.random.normal(ks[1], (len(sizes), n, k), jnp.float32).astype(dtype)
    ct = jax.random.normal(ks[2], (m, n), jnp.float32).astype(dtype)
    return rows, w, ct, jnp.asarray(sizes, jnp.int32)


# --- a model family against Transformers' PyTorch reference (torch is imported by the test files that use these)


def one_device():
    """A mesh of the first device alone: the single-device run a sharded one is checked against."""
    return redeqx.make_mesh(1, devices=jax.devices()[:1])


def hf_checkpoints(tmp_path_factory, build, kinds) -> dict:
    """``build(kind)`` (a Transformers model) for each of ``kinds``, saved by its ``save_pretrained``
    in a temp dir of its own: ``kind -> (dir, model)``. A test module's ``checkpoints`` fixture."""
    out = {}
    for kind in kinds:
        d = tmp_path_factory.mktemp(str(kind))
        hf = build(kind)
        hf.save_pretrained(d)
        out[kind] = (d, hf)
    return out


def nudged(hf, norms=("norm",), scale=lambda name, p: 1):
    """``hf`` (a Transformers model) with N(0, 0.1²) added to its biases and to the parameters named with one of
    ``norms``, and every other parameter multiplied by ``scale(name, p)``, in place from torch's random state:
    non-trivial biases and norms, and logits large enough, that a wrong mapping shows."""
    import torch

    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or any(n in name for n in norms):
                p.add_(0.1 * torch.randn_like(p))
            elif (factor := scale(name, p)) != 1:
                p.mul_(factor)
    return hf


def random_ids(vocab, batch=2, seq=12, seed=0, low=0) -> np.ndarray:
    """Token ids ``(batch, seq)`` drawn from ``[low, vocab)`` (``low`` above a family's special tokens)."""
    return np.random.RandomState(seed).randint(low, vocab, (batch, seq))


def seq2seq_inputs(vocab, low, pad_id, n_pad, batch=2, src=14, tgt=9, seed=0):
    """An encoder-decoder's batch: source ids ``(batch, src)`` whose second row ends in ``n_pad``
    ``pad_id`` tokens, their mask (1 on real tokens) and decoder ids ``(batch, tgt)``, ids from ``[low, vocab)``."""
    rs = np.random.RandomState(seed)
    ids = rs.randint(low, vocab, (batch, src))
    mask = np.ones_like(ids)
    mask[1, src - n_pad:] = 0  # the second input is right-padded
    ids[1, src - n_pad:] = pad_id
    return ids, mask, rs.randint(low, vocab, (batch, tgt))


def torch_output(hf, ids, mask=None, dec=None, **kw):
    """Transformers' ``hf`` on numpy ``ids`` under ``torch.no_grad()``: with the ``attention_mask``
    ``mask`` (1 or True on real tokens) and, for an encoder-decoder, ``decoder_input_ids`` ``dec``;
    ``kw`` go to the call as they are."""
    import torch

    if dec is not None:
        kw["decoder_input_ids"] = torch.tensor(dec)
    with torch.no_grad():
        return hf(input_ids=torch.tensor(ids),
                  attention_mask=None if mask is None else torch.tensor(np.asarray(mask).astype(np.int64)), **kw)


def torch_logits(hf, ids, mask=None, dec=None) -> np.ndarray:
    """:func:`torch_output`'s logits as numpy."""
    return torch_output(hf, ids, mask, dec).logits.numpy()


@eqx.filter_jit
def _batched_logits(model, ids, mask, dec):
    if dec is None:
        return jax.vmap(model)(ids)
    return jax.vmap(lambda i, a, d: model(i, d, attention_mask=a))(ids, mask.astype(bool), dec)


def redeqx_logits(model, ids, mask=None, dec=None) -> np.ndarray:
    """A redeqx model's logits for a batch, jitted and vmapped: a decoder's of ``ids``, or an
    encoder-decoder's of ``ids`` (``mask``: 1 on real tokens) and decoder ids ``dec``."""
    return np.asarray(_batched_logits(model, jnp.asarray(ids), None if mask is None else jnp.asarray(mask),
                                      None if dec is None else jnp.asarray(dec)))


def logits_match_transformers(checkpoint, hf, *inputs, shards=(1, 2, 4), atol=1e-4) -> np.ndarray:
    """Asserts the model saved in ``checkpoint``, loaded over each of ``shards`` model shards, gives
    Transformers' logits (of ``hf``) for ``inputs`` (:func:`redeqx_logits`'s); returns them."""
    ref = torch_logits(hf, *inputs)
    for n in shards:
        model = redeqx.models.from_pretrained(checkpoint, redeqx.make_mesh(n))
        np.testing.assert_allclose(redeqx_logits(model, *inputs), ref, atol=atol, rtol=0, err_msg=f"{n} shards")
    return ref


def hf_shapes(model) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> shape, as save_pretrained would write ``model`` (built abstractly or not)."""
    from redeqx._trees import path_str
    from redeqx.models._pretrained import hf_tensors

    leaves = {path_str(kp): leaf for kp, leaf in jax.tree_util.tree_flatten_with_path(model)[0]}
    return {t.name: tuple(jax.eval_shape(t.join, *(jax.ShapeDtypeStruct(leaves[p].shape, leaves[p].dtype)
                                                   for p in t.paths)).shape) for t in hf_tensors(model)}


def export_matches_transformers(hf_dir: Path, text: str):
    """An example's exported directory loads in Transformers and in redeqx with
    the same logits on ``text``; returns Transformers' model and the tokenizer."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    import redeqx.models

    ours = redeqx.models.from_pretrained(hf_dir, redeqx.make_mesh(1, devices=jax.devices()[:1]))
    tokenizer = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    ids = np.array(tokenizer.encode(text).ids)
    with torch.no_grad():
        want = hf(torch.tensor(ids[None])).logits[0].numpy()
    np.testing.assert_allclose(np.asarray(ours(ids)), want, rtol=1e-4, atol=1e-4)
    return hf, tokenizer


def torch_lm_loss(hf, blocks) -> float:
    """Transformers' next-token cross-entropy over ``blocks`` (a (rows, length) LongTensor)."""
    import torch

    with torch.no_grad():
        logits = hf(blocks[:, :-1]).logits
        return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), blocks[:, 1:].reshape(-1)))
