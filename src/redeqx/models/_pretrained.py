"""Hugging Face checkpoints in and out: `from_pretrained` and `save_pretrained`,
for every family, in either layout of its layers (a list, or stacked).

Only JSON and the safetensors format are read (no pickle). Each tensor is
read on its own and placed straight into the shards each device holds (for
stacked layers, into its layer's slice), so the host never holds more than
one full tensor beyond the model.
"""

from __future__ import annotations

import ctypes
import dataclasses
import fnmatch
import functools
import glob
import json
import math
import os
import re
import shutil
import uuid
import warnings
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from safetensors import SafetensorError

from ..sharding import sharding_rules
from .._trees import leaves_with_specs, named_leaves, replace_array_leaves
from ._bart import BartConfig, BartForConditionalGeneration
from ._gpt2 import GPT2Config, GPT2LMHeadModel
from ._gptj import GPTJConfig, GPTJForCausalLM
from ._llama import LlamaConfig, LlamaForCausalLM
from ._lora import LoRALinear
from ._mixtral import MixtralConfig, MixtralForCausalLM
from ._moe import LoRAExperts
from ._opt import OPTConfig, OPTForCausalLM
from ._qwen2 import Qwen2Config, Qwen2ForCausalLM
from ._qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM
from ._safetensors import Entry, HFTensor, leaf_tensors, read_entries, read_json, write_checkpoint
from ._t5 import T5Config, T5ForConditionalGeneration
from ..sharding import sharding_of

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "gpt2": (GPT2Config, GPT2LMHeadModel),
    "t5": (T5Config, T5ForConditionalGeneration),
    "opt": (OPTConfig, OPTForCausalLM),
    "gptj": (GPTJConfig, GPTJForCausalLM),
    "bart": (BartConfig, BartForConditionalGeneration),
    "mixtral": (MixtralConfig, MixtralForCausalLM),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
}


def hf_tensors(model) -> list[HFTensor]:
    """The checkpoint tensors of a model of the zoo, in its layout: the
    family's own ``hf_tensors()`` (written for listed layers) if it has one,
    else each array leaf under its own path; for stacked layers, each layer's
    tensor is a slice of the stacked leaves (``HFTensor.stacked``)."""
    config = model.config
    if not getattr(config, "scan_layers", False):
        return _listed_tensors(model)
    listed = eqx.filter_eval_shape(type(model), dataclasses.replace(config, scan_layers=False), key=jax.random.key(0))
    stacked = getattr(model, "hf_stacked", None) or (lambda t: t.stacked(model.hf_stacks))
    return [stacked(t) for t in _listed_tensors(listed)]


def _listed_tensors(model) -> list[HFTensor]:
    own = getattr(model, "hf_tensors", None)
    return own() if own is not None else leaf_tensors(model)


def _skeleton(cls, config, dtype):
    """The model with every array a zero-stride NumPy array: right shapes, no memory."""
    abstract = eqx.filter_eval_shape(lambda: cls(config, key=jax.random.key(0)))
    return jax.tree.map(
        lambda s: np.broadcast_to(np.zeros((), dtype or s.dtype), s.shape) if isinstance(s, jax.ShapeDtypeStruct) else s,
        abstract,
    )


def _leaf_shape(leaf, tensor: HFTensor) -> tuple[int, ...]:
    """The shape a tensor's part must have: the leaf's, or one layer's (one expert's) slice of it."""
    return tuple(leaf.shape[len(tensor.at):])


@functools.lru_cache(maxsize=None)
def _zeros(shape, dtype, sharding):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _write_at(sharding):
    """``stack`` with ``part`` written at leading indices ``at`` (a layer, an expert), in place (donated)."""

    def write(stack, part, at):
        starts = (*at, *(jnp.zeros((), jnp.int32) for _ in part.shape))
        return jax.lax.dynamic_update_slice(stack, part.reshape((1,) * len(at) + part.shape), starts)

    return jax.jit(write, out_shardings=sharding, donate_argnums=0)


def from_pretrained(local_dir: str | os.PathLike, mesh: Mesh, specs=None, *, dtype=None, scan_layers: bool | None = None,
                    scan_unroll: int | bool | None = None, loss_fn=None, batch=None):
    """Load a Hugging Face checkpoint from a local directory, sharded over ``mesh``.

    Reads ``config.json`` and ``*.safetensors`` (one file, or several with
    ``model.safetensors.index.json``). Each tensor goes straight to its place
    under ``specs`` (default: `redeqx.sharding_rules` of the model, reading
    the program of ``loss_fn`` on ``batch`` when both are given), one tensor
    at a time: each process reads and places only the shards its devices hold.
    ``dtype`` casts floating tensors (e.g. ``jnp.bfloat16``); by default all
    take the checkpoint's dtype (the one most of its values are in, as
    Transformers casts to its model's: a stray float16 tensor in a float32
    checkpoint comes back float32). ``scan_layers`` overrides the family's
    default layout (True: the layers stacked, for ``lax.scan``; False: a
    list), and ``scan_unroll`` how that scan is compiled (the config's
    ``scan_unroll``; None leaves the family's per-platform default).
    Missing, unexpected or mis-shaped tensors raise an error listing them.

    Supported ``model_type``: ``llama``, ``mistral``, ``qwen2``, ``gpt2``, ``t5``, ``opt``, ``gptj``,
    ``bart``, ``mixtral``, ``qwen3_moe``.

    **Example:**

    ```python
    mesh = redeqx.make_mesh(n_model_shards=2)
    model = redeqx.models.from_pretrained("checkpoints/llama-3.2-1b", mesh, dtype=jnp.bfloat16)
    specs = redeqx.sharding_rules(model, mesh)
    ```
    """
    local_dir = Path(local_dir)
    config_path = local_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(
            f"local_dir={str(local_dir)!r} has no config.json; pass the directory written by save_pretrained "
            "(redeqx's or Transformers')."
        )
    hf_config = read_json(config_path)
    model_type = hf_config.get("model_type")
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise ValueError(
            f"config.json in {str(local_dir)!r} has model_type={model_type!r}; redeqx.models supports "
            f"{sorted(FAMILIES)}."
        )
    config_cls, model_cls = FAMILIES[model_type]
    with ExitStack() as files:
        entries = read_entries(local_dir, files)
        config = _config(config_cls, hf_config, entries, config_path)
        if scan_layers is not None:
            config = dataclasses.replace(config, scan_layers=scan_layers)
        if scan_unroll is not None:
            config = dataclasses.replace(config, scan_unroll=scan_unroll)
        _check_sizes(model_cls, config, entries, config_path)
        dtype = dtype or _checkpoint_dtype(entries)  # one dtype for every floating tensor
        skeleton = _skeleton(model_cls, config, dtype)
        if specs is None:
            specs = sharding_rules(skeleton, mesh, loss_fn=loss_fn, batch=batch)
        tensors = hf_tensors(skeleton)
        by_path = {path: (leaf, spec) for path, leaf, spec in leaves_with_specs(skeleton, specs)}
        _check_tensors(tensors, entries, by_path, getattr(model_cls, "hf_ignore", ()), local_dir)

        placed = _place(tensors, entries, by_path, mesh, dtype)
    return replace_array_leaves(skeleton, [placed[path] for path in by_path])


def _checkpoint_dtype(entries: dict[str, Entry]):
    """The floating dtype most of a checkpoint's values are in, which all its floating tensors are
    cast to, as Transformers casts to its model's dtype: one float16 tensor in a float32 checkpoint
    must not make a model of mixed dtypes. None for a checkpoint with no floating tensor."""
    sizes: dict = {}
    for e in entries.values():
        if jnp.issubdtype(e.dtype, jnp.floating):
            sizes[e.dtype] = sizes.get(e.dtype, 0) + math.prod(e.shape)
    return max(sizes, key=sizes.get) if sizes else None


def _place(tensors: Sequence[HFTensor], entries: dict[str, Entry], by_path, mesh: Mesh, dtype) -> dict[str, jax.Array]:
    """Each model leaf's global array, read tensor by tensor from the checkpoint into its shards."""
    placed: dict[str, jax.Array] = {}
    for t in tensors:
        entry = entries[t.name]
        # A tensor that is one leaf as stored is read one device's shard at a time; one that is
        # cut or transposed into leaves (GPT-2's fused c_attn) is read whole first.
        reads = [entry.read] if t.whole else [functools.partial(_at, part) for part in t.split(entry.read())]
        for path, read in zip(t.paths, reads):
            leaf, spec = by_path[path]
            target = entry.dtype if dtype is None and np.issubdtype(entry.dtype, np.floating) else np.dtype(leaf.dtype)
            sharding = sharding_of(spec, mesh)
            at = t.at
            if not at:
                placed[path] = _placed(read, leaf.shape, sharding, target, entry)
                continue
            if path not in placed:  # the first slice (layer, expert) of this stacked leaf
                placed[path] = _zeros(tuple(leaf.shape), target, sharding)()
            piece = _placed(read, leaf.shape[len(at):], NamedSharding(mesh, P(*spec[len(at):])), target, entry)
            placed[path] = _write_at(sharding)(placed[path], piece, tuple(jnp.int32(i) for i in at))
    return placed


def _config(config_cls, hf_config: dict, entries: dict[str, Entry], config_path: Path):
    """The family's config from ``config.json``; a missing or ill-typed field is an error naming the file."""
    # A family whose config.json does not say everything (T5 under Transformers 5
    # marks every head tied) also reads which tensors the checkpoint holds.
    try:
        return config_cls.from_hf_checkpoint(hf_config, frozenset(entries))
    except KeyError as e:
        raise ValueError(f"{config_path} has no field {e}; download or save it again.") from e
    except ValueError as e:  # a value redeqx refuses says why (an option its blocks do not implement)
        raise ValueError(f"{config_path}: {hf_config['model_type']} config redeqx cannot build: {e}") from e
    except (TypeError, AttributeError) as e:
        raise ValueError(f"{config_path} is not a valid {hf_config['model_type']} config: {str(e).rstrip('.')}; "
                         "download or save it again.") from e


def _at(array: np.ndarray, index: tuple[slice, ...]) -> np.ndarray:
    return array[index]


def _check_sizes(model_cls, config, entries: dict[str, Entry], config_path: Path) -> None:
    """Refuse a config whose sizes the checkpoint cannot fill, before the model
    is built (building 10,000 listed layers takes a minute): each layer stack's
    depth against the layers the checkpoint holds, and a model larger than the
    checkpoint with sizes no checkpoint tensor has (``hidden_size=1048576``).
    The model is read in its stacked layout, on shapes alone, which costs the
    same at any depth; a smaller mismatch is listed tensor by tensor later."""
    ints = [(f.name, v) for f in dataclasses.fields(config)
            if isinstance(v := getattr(config, f.name), int) and not isinstance(v, bool)]
    held = {stack: _layers_held(stack, entries) for stack in model_cls.hf_stacks}
    try:
        probe, stacked = _abstract(model_cls, dataclasses.replace(config, scan_layers=True), config_path), True
    except ValueError:  # a config one stack cannot hold (Qwen3-MoE's dense layers among sparse): list them,
        most = max(map(len, held.values()), default=0)  # at a cost bounded by the checkpoint's depth
        for k, v in ints:
            if "layer" in k and v > most:
                raise ValueError(f"{config_path}: {k}={v}, but the checkpoint holds {most} layers; "
                                 "check that config.json belongs to these weights.") from None
        probe, stacked = _abstract(model_cls, dataclasses.replace(config, scan_layers=False), config_path), False
    leaves = [(path, x) for path, x in named_leaves(probe) if isinstance(x, jax.ShapeDtypeStruct)]
    for stack, layers in held.items():
        if stacked:
            depth = next((x.shape[0] for path, x in leaves if path.startswith(stack + ".")), 0)
        else:
            depth = len(_layers_held(stack, dict(leaves)))
        if depth != len(layers):
            named = " / ".join(f"{k}={v}" for k, v in ints if "layer" in k and v == depth) or f"{depth} layers"
            raise ValueError(
                f"{config_path}: {named} (the layers of {stack}), but the checkpoint holds {len(layers)} of them; "
                "check that config.json belongs to these weights."
            )
    in_stack = [stacked and any(path.startswith(s + ".") for s in model_cls.hf_stacks) for path, _ in leaves]
    sizes = {d for (_, x), lead in zip(leaves, in_stack) for d in x.shape[lead:]}  # not the layer axis
    dims = {d for e in entries.values() for d in e.shape}
    odd = [f"{k}={v}" for k, v in ints if v in sizes and v not in dims]
    need, values = sum(math.prod(x.shape) for _, x in leaves), sum(math.prod(e.shape) for e in entries.values())
    if need > values and odd:
        raise ValueError(
            f"{config_path}: {', '.join(odd)} (no checkpoint tensor has such a dimension) makes a model of "
            f"{need:,} parameters, but the checkpoint holds {values:,}; check that config.json belongs to these "
            "weights."
        )


def _abstract(model_cls, config, config_path: Path):
    """The model of ``config`` on shapes alone; a config it refuses is an error naming ``config_path``."""
    try:
        return eqx.filter_eval_shape(lambda: model_cls(config, key=jax.random.key(0)))
    except (TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"{config_path} describes no {model_cls.__name__} (scan_layers={config.scan_layers}): "
                         f"{e}") from e


def _layers_held(stack: str, entries: dict) -> set[str]:
    """The layer indices the checkpoint's names hold under ``stack`` (``model.layers.3.*``), or under
    the stack's name less a leading prefix (the hub's OPT files name ``decoder.layers.3.*``)."""
    parts = stack.split(".")
    for k in range(len(parts)):
        pattern = re.compile(re.escape(".".join(parts[k:])) + r"\.(\d+)\.")
        if held := {m.group(1) for name in entries if (m := pattern.match(name))}:
            return held
    return set()


def _placed(read, shape, sharding: NamedSharding, dtype, entry: Entry) -> jax.Array:
    """A global array whose every shard this process holds is ``read(index)``,
    read once per distinct shard (a replicated leaf is read once)."""
    shards: dict[tuple, np.ndarray] = {}

    def shard(index):
        key = tuple((s.start, s.stop, s.step) for s in index)
        if key not in shards:
            try:
                shards[key] = np.ascontiguousarray(read(index), dtype=dtype)
            except (SafetensorError, OSError, ValueError) as e:
                raise ValueError(f"{entry.file}: tensor {entry.name!r} could not be read: {e}") from e
        return shards[key]

    return jax.make_array_from_callback(tuple(shape), sharding, shard)


def _check_tensors(tensors: Sequence[HFTensor], entries, by_path, ignore, local_dir) -> None:
    missing, wrong = [], []
    for t in tensors:
        if t.name not in entries:
            missing.append(t.name)
            continue
        e = entries[t.name]
        parts = t.split(np.broadcast_to(np.zeros((), e.dtype), e.shape))
        for path, part in zip(t.paths, parts):
            want = _leaf_shape(by_path[path][0], t)
            if tuple(part.shape) != want:
                wrong.append(f"{t.name} ({e.file.name}): checkpoint {e.shape} gives {path} {tuple(part.shape)}, model needs {want}")
    known = {t.name for t in tensors}
    unexpected = [n for n in entries if n not in known and not any(re.fullmatch(rx, n) for rx in ignore)]
    if missing or unexpected or wrong:
        lines = [f"checkpoint in {str(local_dir)!r} does not match the model built from its config.json:"]
        if missing:
            lines.append(f"  missing ({len(missing)}): " + ", ".join(missing))
        if unexpected:
            lines.append(f"  unexpected ({len(unexpected)}): " + ", ".join(sorted(unexpected)))
        if wrong:
            lines.append(f"  wrong shape ({len(wrong)}):\n    " + "\n    ".join(wrong))
        lines.append("Check that config.json belongs to these weights (sizes, tie_word_embeddings, biases).")
        raise ValueError("\n".join(lines))


def _to_host(x) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x)


_GENERATION_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


def save_pretrained(model, local_dir: str | os.PathLike, *, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write ``model`` as a Hugging Face checkpoint that Transformers loads as is,
    from either layout of its layers (a stacked layer's slices are written
    under the per-layer names Transformers expects).

    ``config.json`` plus ``model.safetensors``, or several
    ``model-0000i-of-0000n.safetensors`` files and an index when the weights
    exceed ``max_shard_bytes``, and ``generation_config.json`` when the config
    names special tokens (BOS, EOS, padding, decoder start). Tensors are
    gathered to the host one at a time; on several hosts every process must
    call this, and process 0 writes.

    The model is written into a new directory beside ``local_dir``, which
    then replaces it whole: ``local_dir`` holds this model only (an earlier
    save's shards and index are gone; loose files such as a tokenizer's are
    kept), and a save that fails leaves the earlier model as it was. A
    ``local_dir`` holding sub-directories is refused.

    **Example:**

    ```python
    redeqx.models.save_pretrained(state.model, "out/finetuned")
    hf = transformers.AutoModelForCausalLM.from_pretrained("out/finetuned")
    ```
    """
    _check_savable(model)
    local_dir = Path(local_dir)
    writer = jax.process_index() == 0
    leaves = dict(named_leaves(model))
    tensors = hf_tensors(model)

    def parts(t: HFTensor, abstract: bool):
        for p in t.paths:
            x = leaves[p]
            if abstract:
                yield jax.ShapeDtypeStruct(_leaf_shape(x, t), x.dtype)
            else:
                yield _to_host(x[t.at] if t.at else x)

    shapes = [(t.name, jax.eval_shape(lambda *xs, t=t: t.join(*xs), *parts(t, abstract=True))) for t in tensors]
    # Process 0 writes into a new directory beside local_dir, then swaps it in: a load never sees a
    # half-written model, nor the last save's files beside this one's.
    target = Path(os.path.realpath(local_dir))
    _check_target(target)  # on every process, so that none waits on a writer that refused
    staging = _staging_dir(target) if writer else None
    try:
        if staging is not None:
            _write_configs(staging, model.config.to_hf())
        write_checkpoint(staging, shapes, lambda i: np.asarray(tensors[i].join(*parts(tensors[i], abstract=False))),
                         max_shard_bytes=max_shard_bytes, writer=writer)
        if staging is not None:
            _swap_in(staging, target)
    finally:
        if staging is not None and staging.exists():
            shutil.rmtree(staging)


def _check_savable(model) -> None:
    if not hasattr(model, "config") or not hasattr(model.config, "to_hf"):
        raise TypeError(f"model must be a redeqx.models model (with a config), got {type(model).__name__}.")
    adapted = (LoRALinear, LoRAExperts)
    if any(isinstance(x, adapted) for x in jax.tree.leaves(model, is_leaf=lambda x: isinstance(x, adapted))):
        raise ValueError(
            "model has LoRA adapters, which a Hugging Face checkpoint of this family has no place for: fold them "
            "into the weights first, save_pretrained(redeqx.models.merge_lora(model), ...)."
        )


def _write_configs(staging: Path, config: dict) -> None:
    """``config.json``, and ``generation_config.json`` when the config names special tokens."""
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    generation = {k: config[k] for k in _GENERATION_FIELDS if config.get(k) is not None}
    if generation:  # what Transformers' generate() reads for its defaults
        (staging / "generation_config.json").write_text(json.dumps({**generation, "_from_model_config": True}, indent=2))


# What a model save writes, or an older one (PyTorch, TensorFlow, Flax weights) left: replaced as a whole.
_MODEL_FILES = ("config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
                "pytorch_model*.bin", "pytorch_model.bin.index.json", "tf_model*.h5", "flax_model*.msgpack")


def _check_target(target: Path) -> None:
    """``target`` is new, or a directory whose every entry a model save may replace or keep."""
    if target.exists() and not target.is_dir():
        raise ValueError(f"local_dir={str(target)!r} is a file; pass a directory (new, or holding a model).")
    if target.is_dir() and (subdirs := sorted(p.name for p in target.iterdir() if p.is_dir())):
        raise ValueError(
            f"local_dir={str(target)!r} holds directories ({', '.join(subdirs)}): save_pretrained replaces the "
            "directory's model as a whole and keeps only its loose files (a tokenizer's); pass a new directory."
        )


def _staging_dir(target: Path) -> Path:
    """A new empty directory beside ``target`` for the save to fill."""
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f".{glob.escape(target.name)}.saving-*"):  # an earlier save, interrupted
        warnings.warn(f"redeqx.models.save_pretrained: removing {stale}, left by an interrupted save of {target}.",
                      stacklevel=4)
        shutil.rmtree(stale, ignore_errors=True)
    staging = target.parent / f".{target.name}.saving-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    return staging


def _swap_in(staging: Path, target: Path) -> None:
    """Make ``staging`` (a full model) ``target``, keeping ``target``'s files that are
    not a model's (a tokenizer's, a README), and leave the old directory at ``staging``.
    One atomic exchange where the OS has it (Linux's ``renameat2``), else two renames
    (``target`` is briefly absent, never half-written)."""
    if not target.exists():
        os.rename(staging, target)
        return
    shutil.copymode(target, staging)
    for entry in target.iterdir():
        if not any(fnmatch.fnmatch(entry.name, pattern) for pattern in _MODEL_FILES):
            try:
                os.link(entry, staging / entry.name, follow_symlinks=False)
            except OSError:  # a file system without hard links
                shutil.copy2(entry, staging / entry.name, follow_symlinks=False)
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    at_cwd, exchange = -100, 2  # AT_FDCWD, RENAME_EXCHANGE
    if renameat2 is None or renameat2(at_cwd, os.fsencode(staging), at_cwd, os.fsencode(target), exchange) != 0:
        old = target.parent / f"{staging.name}.old"
        os.rename(target, old)
        try:
            os.rename(staging, target)
        except OSError:
            os.rename(old, target)
            raise
        os.rename(old, staging)
