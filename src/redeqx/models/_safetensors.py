"""The safetensors format, read and written directly, and `HFTensor`: how one
tensor of a Hugging Face checkpoint maps onto a model's leaves.

A safetensors file is an 8-byte little-endian header length, a JSON header
naming each tensor's dtype, shape and byte range, then the raw bytes. Reading
it ourselves lets each tensor be read on its own, placed into the shards each
device holds, and dropped before the next: the host never holds more than one
full tensor beyond the model. Nothing here knows a model family.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np

from .._trees import is_array_like, named_leaves

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
NAMES = {v: k for k, v in DTYPES.items()}


def _one(a):
    return (a,)


def _same(a):
    return a


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """One tensor of a Hugging Face checkpoint and the model leaves it feeds.

    ``split`` turns the checkpoint array into one array per path in ``paths``
    (views where possible: a transpose, a column slice); ``join`` is its
    inverse, for `save_pretrained`. With ``layer=i`` the leaves are stacked
    layers (a leading layer axis) and this tensor is their slice ``i``. A
    non-empty ``index`` says the tensor is only slice ``index`` of each leaf
    (after the layer axis): one expert's weight of an ``(experts, ...)`` stack.
    """

    name: str
    paths: tuple[str, ...]
    split: Callable[[np.ndarray], tuple[np.ndarray, ...]] = _one
    join: Callable[..., Any] = _same
    layer: int | None = None
    index: tuple[int, ...] = ()

    @property
    def at(self) -> tuple[int, ...]:
        """Where in each leaf this tensor sits: its layer (stacked layers), then ``index``."""
        return ((self.layer,) if self.layer is not None else ()) + self.index

    def stacked(self, stacks: Sequence[str]) -> HFTensor:
        """This tensor for a model whose layer lists at paths ``stacks`` are
        stacked: ``model.layers.3.mlp.up_proj.weight`` becomes slice 3 of
        ``model.layers.mlp.up_proj.weight``."""
        paths, layer = [], None
        for path in self.paths:
            for stack in stacks:
                index, _, rest = path[len(stack) + 1:].partition(".") if path.startswith(stack + ".") else ("", "", "")
                if index.isdigit():
                    if layer not in (None, int(index)):
                        raise ValueError(f"{self.name} feeds leaves of two layers: {self.paths}")
                    path, layer = f"{stack}.{rest}", int(index)
                    break
            paths.append(path)
        return dataclasses.replace(self, paths=tuple(paths), layer=layer)


def leaf_tensors(model, rename: Callable[[str], str] = _same) -> list[HFTensor]:
    """One checkpoint tensor per array leaf of ``model``, named
    ``rename(path)``: for a family whose attribute paths are Hugging Face's
    tensor names (up to ``rename``)."""
    return [HFTensor(rename(path), (path,)) for path, x in named_leaves(model) if is_array_like(x)]


@dataclasses.dataclass(frozen=True)
class Entry:
    """Where one tensor lies in a safetensors file."""

    file: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int
    stop: int


def read_header(path: Path) -> dict[str, Entry]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path} is not a safetensors file (shorter than 8 bytes).")
        (n,) = struct.unpack("<Q", raw)
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    entries = {}
    for name, info in header.items():
        if info["dtype"] not in DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has dtype {info['dtype']}, which redeqx cannot read.")
        begin, end = info["data_offsets"]
        entries[name] = Entry(path, DTYPES[info["dtype"]], tuple(info["shape"]), 8 + n + begin, 8 + n + end)
    return entries


def read_tensor(entry: Entry) -> np.ndarray:
    with open(entry.file, "rb") as f:
        f.seek(entry.start)
        buf = bytearray(entry.stop - entry.start)
        f.readinto(buf)
    return np.frombuffer(buf, dtype=entry.dtype).reshape(entry.shape)


def checkpoint_files(local_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (several with an index)."""
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


def write_checkpoint(local_dir: Path, shapes: Sequence[tuple[str, jax.ShapeDtypeStruct]],
                     array: Callable[[int], np.ndarray], *, max_shard_bytes: int, writer: bool) -> None:
    """Write tensors ``shapes`` (name, shape and dtype) as ``model.safetensors``,
    or as ``model-0000i-of-0000n.safetensors`` files and an index past
    ``max_shard_bytes``. ``array(i)`` gives tensor ``i``'s values, one at a
    time; every process calls it (it may gather), only the ``writer`` writes."""
    sizes = [int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for _, s in shapes]
    groups: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(sizes):
        if groups[-1] and used + n > max_shard_bytes:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += n
    files = ["model.safetensors"] if len(groups) == 1 else [
        f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))
    ]
    weight_map = {}
    for file, group in zip(files, groups):
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for i in group:
            name, shape = shapes[i]
            header[name] = {"dtype": NAMES[np.dtype(shape.dtype)], "shape": list(shape.shape),
                            "data_offsets": [offset, offset + sizes[i]]}
            offset += sizes[i]
            weight_map[name] = file
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        f = open(local_dir / file, "wb") if writer else None
        try:
            if f:
                f.write(struct.pack("<Q", len(raw)) + raw)
            for i in group:
                data = np.ascontiguousarray(array(i))
                if f:
                    f.write(data.tobytes())
                del data
        finally:
            if f:
                f.close()
    if writer and len(files) > 1:
        index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
        (local_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
