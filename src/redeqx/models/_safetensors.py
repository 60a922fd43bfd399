"""The safetensors format, read through the `safetensors` library and
written directly, and `HFTensor`: how one tensor of a Hugging Face checkpoint
maps onto a model's leaves.

A safetensors file is an 8-byte little-endian header length, a JSON header
naming each tensor's dtype, shape and byte range, then the raw bytes. The
library checks a header before anything is read (its bounds, its dtypes,
byte ranges that tile the data exactly) and reads any slice of a tensor
alone, so each device's shard is read on its own and dropped before the next
tensor. Nothing here knows a model family.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path, PurePosixPath
from typing import Any

import jax
import ml_dtypes  # also lets the library's NumPy reader name bfloat16
import numpy as np
from safetensors import SafetensorError, safe_open

from .._trees import is_array_like, named_leaves

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
NAMES = {v: k for k, v in DTYPES.items()}
INDEX = "model.safetensors.index.json"


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
    def whole(self) -> bool:
        """Whether the tensor is its one leaf as stored (no cut, no transpose)."""
        return self.split is _one

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
    """One tensor of a checkpoint: its file, name, dtype and shape, and the
    open file (`safetensors.safe_open`) that reads it, whole or a slice."""

    file: Path
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    handle: Any = dataclasses.field(repr=False, compare=False)

    def read(self, index: tuple[slice, ...] = ()) -> np.ndarray:
        """The tensor's values at ``index`` (slices, one per leading dim): only those bytes are read."""
        return self.handle.get_slice(self.name)[index]


def read_entries(local_dir: Path, files: ExitStack) -> dict[str, Entry]:
    """Every tensor of the checkpoint in ``local_dir``, its files opened (and
    kept open by ``files``) through the `safetensors` library, which checks
    each header: its length against the file's, its JSON, each dtype, and that
    the tensors' byte ranges tile the data exactly (no gap, no overlap, no
    byte missing). A tensor in two files, or in another file than the index
    says, is an error; so is a dtype redeqx does not read."""
    weight_map, paths = checkpoint_files(local_dir)
    entries: dict[str, Entry] = {}
    for path in paths:
        try:
            handle = files.enter_context(safe_open(path, framework="numpy"))
            names = {name: handle.get_slice(name) for name in handle.keys()}
        except SafetensorError as e:
            raise ValueError(f"{path} is not a valid safetensors file{_blame(path)}: {e}. "
                             "Download or save it again.") from e
        if twice := _named_twice(path):
            raise ValueError(f"{path} names tensor{'s' if len(twice) > 1 else ''} {', '.join(map(repr, twice))} twice "
                             "in its header (one of the two would be read, the other's bytes ignored): the file is "
                             "damaged or was written wrongly. Download or save it again.")
        for name, info in names.items():
            dtype = info.get_dtype()
            if dtype not in DTYPES:
                raise ValueError(f"{path}: tensor {name!r} has dtype {dtype}, which redeqx does not read "
                                 f"(it reads {', '.join(DTYPES)}); convert the checkpoint.")
            if name in entries:
                raise ValueError(f"tensor {name!r} is in two files of {str(local_dir)!r}: "
                                 f"{_relative(entries[name].file, local_dir)} and {_relative(path, local_dir)}; "
                                 "keep one.")
            if weight_map is not None and weight_map.get(name, _relative(path, local_dir)) != _relative(path, local_dir):
                raise ValueError(f"{path} holds tensor {name!r}, which {INDEX} places in {weight_map[name]}; "
                                 "the index does not belong to these files.")
            entries[name] = Entry(path, name, DTYPES[dtype], tuple(info.get_shape()), handle)
    return entries


def _named_twice(path: Path) -> list[str]:
    """The tensor names a safetensors header (already checked by the library) holds more than once:
    a JSON object may repeat a key, and a reader keeps one of them."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = f.read(n)
    names = Counter(key for key, _ in json.loads(header, object_pairs_hook=lambda items: items))
    return sorted(name for name, count in names.items() if count > 1)


def _relative(path: Path, local_dir: Path) -> str:
    return path.relative_to(local_dir).as_posix()


def _blame(path: Path) -> str:
    """Which tensors a header the library refused gets wrong (a dtype it does
    not know, bytes that do not fit the shape, a range that overlaps another,
    leaves a gap or runs past the file's end), for the error message; empty
    when the header itself is unreadable."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8).ljust(8, b"\0"))
        if n > size - 8:
            return ""
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return ""
    if not isinstance(header, dict):
        return ""
    bad, end, last = [], 0, None
    try:
        spans = sorted((tuple(info["data_offsets"]), name, info) for name, info in header.items() if name != "__metadata__")
        for (begin, stop), name, info in spans:
            dtype = DTYPES.get(info["dtype"])
            if dtype is None or stop - begin != math.prod(info["shape"]) * dtype.itemsize or stop > size - 8 - n:
                bad.append(name)
            if begin != end:
                bad += [last, name] if begin < end and last is not None else [name]
            end, last = stop, name
    except (KeyError, TypeError, ValueError):
        return ""
    bad = list(dict.fromkeys(bad))
    return f" (tensor{'s' if len(bad) > 1 else ''} {', '.join(bad)})" if bad else ""


def read_json(path: Path) -> dict:
    """A JSON object from ``path``; any damage is an error naming the file."""
    try:
        out = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); download or save it again.") from e
    if not isinstance(out, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(out).__name__}; download or save it again.")
    return out


def checkpoint_files(local_dir: Path) -> tuple[dict[str, str] | None, list[Path]]:
    """The safetensors files of a checkpoint directory, and the index's
    tensor -> file map when there is one (several files). The index may name
    only files inside ``local_dir``."""
    index = local_dir / INDEX
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise ValueError(f"{index} must map each tensor name to a file name under 'weight_map'; "
                             "download or save it again.")
        for file in sorted(set(weight_map.values())):
            relative = PurePosixPath(file)
            if relative.is_absolute() or ".." in relative.parts or "\\" in file or not relative.parts:
                raise ValueError(f"{index} names the file {file!r}, outside the checkpoint's directory; "
                                 "an index may name only files inside it.")
            if not (local_dir / relative).is_file():
                raise FileNotFoundError(f"{index} names {file!r}, which is not in {str(local_dir)!r}; "
                                        "the download is incomplete.")
        # keyed by name relative to local_dir, as read_entries compares
        return {k: str(PurePosixPath(v)) for k, v in weight_map.items()}, [
            local_dir / f for f in sorted({str(PurePosixPath(v)) for v in weight_map.values()})]
    files = sorted(local_dir.glob("*.safetensors"))
    if not files:
        found = sorted(p.name for p in local_dir.iterdir())
        hint = " (PyTorch .bin files are pickles, which redeqx never loads)" if any(
            f.endswith(".bin") for f in found) else ""
        raise FileNotFoundError(
            f"no *.safetensors in {str(local_dir)!r}{hint}; found {found}. Convert the checkpoint with "
            "Transformers: model.save_pretrained(dir, safe_serialization=True)."
        )
    return None, files


def write_checkpoint(local_dir: Path | None, shapes: Sequence[tuple[str, jax.ShapeDtypeStruct]],
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
        (local_dir / INDEX).write_text(json.dumps(index, indent=2))
