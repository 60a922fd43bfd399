"""Hugging Face checkpoints: ``config.json`` + ``*.safetensors`` in, and out.

Only JSON and the safetensors format are read (no pickle). The safetensors
format is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the raw bytes; we read it directly
so that each tensor is read on its own, split into the shards each device
holds, and dropped before the next: the host never holds more than one full
tensor beyond the model itself.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .._rules import sharding_rules
from .._trees import path_str

_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """One tensor of a Hugging Face checkpoint and the model leaves it feeds.

    ``split`` turns the checkpoint array into one array per path in ``paths``
    (views where possible: a transpose, a column slice); ``join`` is its
    inverse, used by `save_pretrained`. Most tensors map one to one.
    """

    name: str
    paths: tuple[str, ...]
    split: Callable[[np.ndarray], tuple[np.ndarray, ...]] = lambda a: (a,)
    join: Callable[..., Any] = lambda a: a


@dataclasses.dataclass(frozen=True)
class _Entry:
    file: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int
    stop: int


def _read_header(path: Path) -> tuple[dict[str, _Entry], dict]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path} is not a safetensors file (shorter than 8 bytes).")
        (n,) = struct.unpack("<Q", raw)
        header = json.loads(f.read(n))
    meta = header.pop("__metadata__", {}) or {}
    entries = {}
    for name, info in header.items():
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has dtype {info['dtype']}, which redeqx cannot read.")
        begin, end = info["data_offsets"]
        entries[name] = _Entry(path, _DTYPES[info["dtype"]], tuple(info["shape"]), 8 + n + begin, 8 + n + end)
    return entries, meta


def _read_tensor(e: _Entry) -> np.ndarray:
    with open(e.file, "rb") as f:
        f.seek(e.start)
        buf = bytearray(e.stop - e.start)
        f.readinto(buf)
    return np.frombuffer(buf, dtype=e.dtype).reshape(e.shape)


def _checkpoint_files(local_dir: Path) -> list[Path]:
    index = local_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [local_dir / f for f in sorted(set(weight_map.values()))]
    files = sorted(local_dir.glob("*.safetensors"))
    if not files:
        found = sorted(p.name for p in local_dir.iterdir())
        hint = " (PyTorch .bin files are pickles, which redeqx never loads)" if any(
            f.endswith(".bin") for f in found) else ""
        raise FileNotFoundError(
            f"no *.safetensors in {str(local_dir)!r}{hint}; found {found}. Convert the checkpoint with "
            "Transformers: model.save_pretrained(dir, safe_serialization=True)."
        )
    return files


def _families() -> dict[str, Any]:
    from ._llama import LlamaConfig, LlamaForCausalLM

    families = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "mistral": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (LlamaConfig, LlamaForCausalLM),
    }
    try:
        from ._gpt2 import GPT2Config, GPT2LMHeadModel

        families["gpt2"] = (GPT2Config, GPT2LMHeadModel)
    except ImportError:
        pass
    try:
        from ._t5 import T5Config, T5ForConditionalGeneration

        families["t5"] = (T5Config, T5ForConditionalGeneration)
    except ImportError:
        pass
    from ._bart import BartConfig, BartForConditionalGeneration
    from ._gptj import GPTJConfig, GPTJForCausalLM
    from ._opt import OPTConfig, OPTForCausalLM

    families["opt"] = (OPTConfig, OPTForCausalLM)
    families["gptj"] = (GPTJConfig, GPTJForCausalLM)
    families["bart"] = (BartConfig, BartForConditionalGeneration)
    return families


def hf_tensors(model) -> list[HFTensor]:
    """The checkpoint tensors of ``model``: the model's own ``hf_tensors()``
    if it has one, else each array leaf under its own path."""
    custom = getattr(model, "hf_tensors", None)
    if custom is not None:
        return custom()
    leaves = jax.tree_util.tree_flatten_with_path(eqx.filter(model, eqx.is_array))[0]
    return [HFTensor(path_str(kp), (path_str(kp),)) for kp, _ in leaves]


def _skeleton(cls, config, dtype):
    """The model with every array a zero-stride NumPy array: right shapes, no memory."""
    abstract = eqx.filter_eval_shape(lambda: cls(config, key=jax.random.key(0)))
    return jax.tree.map(
        lambda s: np.broadcast_to(np.zeros((), dtype or s.dtype), s.shape) if isinstance(s, jax.ShapeDtypeStruct) else s,
        abstract,
    )


def from_pretrained(local_dir: str | os.PathLike, mesh: Mesh, specs=None, *, dtype=None):
    """Load a Hugging Face checkpoint from a local directory, sharded over ``mesh``.

    Reads ``config.json`` and ``*.safetensors`` (one file, or several with
    ``model.safetensors.index.json``). Each tensor goes straight to its place
    under ``specs`` (default: `redeqx.sharding_rules` of the model), one tensor
    at a time. ``dtype`` casts floating tensors (e.g. ``jnp.bfloat16``); by
    default each keeps the checkpoint's dtype. Missing, unexpected or
    mis-shaped tensors raise an error listing them.

    Supported ``model_type``: ``llama``, ``mistral``, ``qwen2``, ``gpt2``, ``t5``, ``opt``, ``gptj``,
    ``bart``.

    **Example:**

    ```python
    mesh = redeqx.make_mesh(n_model_shards=2)
    model = redeqx.models.from_pretrained("checkpoints/llama-3.2-1b", mesh, dtype=jnp.bfloat16)
    specs = redeqx.sharding_rules(model, mesh)
    ```
    """
    local_dir = Path(local_dir)
    if not (local_dir / "config.json").is_file():
        raise FileNotFoundError(
            f"local_dir={str(local_dir)!r} has no config.json; pass the directory written by save_pretrained "
            "(redeqx's or Transformers')."
        )
    hf_config = json.loads((local_dir / "config.json").read_text())
    families = _families()
    model_type = hf_config.get("model_type")
    if model_type not in families:
        raise ValueError(
            f"config.json in {str(local_dir)!r} has model_type={model_type!r}; redeqx.models supports "
            f"{sorted(families)}."
        )
    config_cls, model_cls = families[model_type]
    entries: dict[str, _Entry] = {}
    for f in _checkpoint_files(local_dir):
        entries.update(_read_header(f)[0])
    # A family whose config.json does not say everything (T5 under Transformers 5
    # marks every head tied) also reads which tensors the checkpoint holds.
    from_checkpoint = getattr(config_cls, "from_hf_checkpoint", None)
    config = config_cls.from_hf(hf_config) if from_checkpoint is None else from_checkpoint(hf_config, frozenset(entries))
    skeleton = _skeleton(model_cls, config, dtype)
    if specs is None:
        specs = sharding_rules(skeleton, mesh)
    tensors = hf_tensors(skeleton)
    # None fields (a Linear without bias) are leaves on both sides, as in redeqx.shard
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(skeleton, is_leaf=lambda x: x is None)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P) or x is None)
    if len(spec_leaves) != len(leaves_with_path):
        raise ValueError(
            f"specs has {len(spec_leaves)} leaves but the {model_cls.__name__} has {len(leaves_with_path)}; "
            "pass specs=None, or specs from redeqx.sharding_rules on this model."
        )
    by_path = {path_str(kp): (i, leaf, spec) for i, ((kp, leaf), spec) in enumerate(zip(leaves_with_path, spec_leaves))}
    _check_tensors(tensors, entries, by_path, getattr(model_cls, "hf_ignore", ()), local_dir)

    out = [leaf for _, leaf in leaves_with_path]
    for t in tensors:
        full = _read_tensor(entries[t.name])
        for path, part in zip(t.paths, t.split(full)):
            i, leaf, spec = by_path[path]
            target = np.dtype(leaf.dtype) if dtype is not None or not np.issubdtype(part.dtype, np.floating) else part.dtype
            sharding = NamedSharding(mesh, P() if spec is None else spec)
            out[i] = jax.make_array_from_callback(
                leaf.shape, sharding, lambda idx, part=part, target=target: np.ascontiguousarray(part[idx], dtype=target)
            )
        del full
    return jax.tree.unflatten(treedef, out)


def _check_tensors(tensors: Sequence[HFTensor], entries, by_path, ignore, local_dir) -> None:
    missing, wrong = [], []
    for t in tensors:
        if t.name not in entries:
            missing.append(t.name)
            continue
        e = entries[t.name]
        parts = t.split(np.broadcast_to(np.zeros((), e.dtype), e.shape))
        for path, part in zip(t.paths, parts):
            want = by_path[path][1].shape
            if tuple(part.shape) != tuple(want):
                wrong.append(f"{t.name}: checkpoint {e.shape} gives {path} {tuple(part.shape)}, model needs {tuple(want)}")
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
    """Write ``model`` as a Hugging Face checkpoint that Transformers loads as is.

    ``config.json`` plus ``model.safetensors``, or several
    ``model-0000i-of-0000n.safetensors`` files and an index when the weights
    exceed ``max_shard_bytes``, and ``generation_config.json`` when the config
    names special tokens (BOS, EOS, padding, decoder start). Tensors are gathered to the host one at a
    time; on several hosts every process must call this, and process 0 writes.

    **Example:**

    ```python
    redeqx.models.save_pretrained(state.model, "out/finetuned")
    hf = transformers.AutoModelForCausalLM.from_pretrained("out/finetuned")
    ```
    """
    if not hasattr(model, "config") or not hasattr(model.config, "to_hf"):
        raise TypeError(f"model must be a redeqx.models model (with a config), got {type(model).__name__}.")
    from ._lora import LoRALinear

    if any(isinstance(x, LoRALinear) for x in jax.tree.leaves(model, is_leaf=lambda x: isinstance(x, LoRALinear))):
        raise ValueError(
            "model has LoRA adapters, which a Hugging Face checkpoint of this family has no place for: fold them "
            "into the weights first, save_pretrained(redeqx.models.merge_lora(model), ...)."
        )
    local_dir = Path(local_dir)
    writer = jax.process_index() == 0
    leaves = {path_str(kp): leaf for kp, leaf in jax.tree_util.tree_flatten_with_path(model)[0]}
    tensors = hf_tensors(model)
    # Shapes and dtypes first (for the headers), without computing anything.
    shapes = [jax.eval_shape(lambda *xs, t=t: t.join(*xs), *(jax.ShapeDtypeStruct(leaves[p].shape, leaves[p].dtype)
                                                             for p in t.paths)) for t in tensors]
    sizes = [int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for s in shapes]
    groups: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(sizes):
        if groups[-1] and used + n > max_shard_bytes:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += n
    if writer:
        local_dir.mkdir(parents=True, exist_ok=True)
        config = model.config.to_hf()
        (local_dir / "config.json").write_text(json.dumps(config, indent=2))
        generation = {k: config[k] for k in _GENERATION_FIELDS if config.get(k) is not None}
        if generation:  # what Transformers' generate() reads for its defaults
            (local_dir / "generation_config.json").write_text(json.dumps({**generation, "_from_model_config": True},
                                                                         indent=2))
    names = ["model.safetensors"] if len(groups) == 1 else [
        f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))
    ]
    weight_map = {}
    for fname, group in zip(names, groups):
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for i in group:
            header[tensors[i].name] = {
                "dtype": _NAMES[np.dtype(shapes[i].dtype)], "shape": list(shapes[i].shape),
                "data_offsets": [offset, offset + sizes[i]],
            }
            offset += sizes[i]
            weight_map[tensors[i].name] = fname
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        f = open(local_dir / fname, "wb") if writer else None
        try:
            if f:
                f.write(struct.pack("<Q", len(raw)) + raw)
            for i in group:
                t = tensors[i]
                arr = np.ascontiguousarray(t.join(*(_to_host(leaves[p]) for p in t.paths)))
                if f:
                    f.write(arr.tobytes())
                del arr
        finally:
            if f:
                f.close()
    if writer and len(names) > 1:
        index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
        (local_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
