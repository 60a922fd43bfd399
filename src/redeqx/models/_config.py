"""What every zoo config shares: the layout of its layers (``scan_layers``,
``scan_unroll``; ``context_attention`` for the decoder-only families), their
checks and their paragraph, and the translation to and from Hugging Face's
``config.json``, driven by each family's table of fields.

A family's config is a frozen dataclass of its own sizes that extends
`ZooConfig` (or `DecoderConfig`) and says what differs from the defaults:

- ``hf_keys``: our field -> its ``config.json`` key where the names differ
  (None: a field ``config.json`` does not hold); every other field is read and
  written under its own name;
- ``hf_required``: the fields ``config.json`` must name;
- ``hf_absent``: the value of a field ``config.json`` leaves out, where it is
  not the field's default (a token id the file does not name is None);
- ``hf_fixed``: keys `ZooConfig.to_hf` writes as they are;
- ``positive``: the fields that must be positive ints;
- the hooks `ZooConfig.check`, `ZooConfig.hf_in` and `ZooConfig.hf_out` for
  anything else (derived fields, options redeqx refuses).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from ._layers import ACTIVATIONS, SCAN_LAYERS, check_context_attention, check_positive_ints, check_scan_unroll

LAYOUT_DOC = """
    ``scan_layers=True`` (the default) stacks the layers, run by a ``lax.scan``: compile time
    flat in depth, the same step (`redeqx.models._layers.SCAN_LAYERS` says why); False lists them.
    ``scan_unroll`` is the scan's ``unroll``: by default every layer on a GPU (a loop there costs
    about 9 % of the step) and a loop elsewhere (`redeqx.models._layers.SCAN_UNROLL`), and a loop
    for a generation's prompt pass on every platform (it compiles one layer's kernels, not each's).
"""

CONTEXT_DOC = """    ``context_attention`` is how keys and values cross a sequence split over ``context``:
    ``"gather"`` (all gathered), ``"ring"`` (passed around a ring), ``"heads"`` (heads split
    instead of the sequence, by all-to-all) or ``"auto"`` (``heads`` on a GPU where cuDNN's kernel
    runs, ``gather`` elsewhere); `redeqx.attention`'s ``impl``.
"""

_LAYOUT = ("scan_layers", "scan_unroll", "context_attention")


@dataclasses.dataclass(frozen=True)
class ZooConfig:
    """The base of every zoo config (see the module's docstring)."""

    # Keyword-only, so that each family's own fields keep their positions in its constructor.
    scan_layers: bool = dataclasses.field(default=SCAN_LAYERS, kw_only=True)  # stacked (see SCAN_LAYERS); False: a list
    scan_unroll: int | bool | None = dataclasses.field(default=None, kw_only=True)  # None: per platform (SCAN_UNROLL)

    hf_architecture: ClassVar[str]
    hf_type: ClassVar[str]
    hf_keys: ClassVar[dict[str, str | None]] = {}
    hf_required: ClassVar[tuple[str, ...]] = ()
    hf_absent: ClassVar[dict[str, Any]] = {}
    hf_fixed: ClassVar[dict[str, Any]] = {}
    positive: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.__module__ != __name__ and cls.__dict__.get("__doc__"):  # a family's config: add the paragraph
            extra = CONTEXT_DOC if hasattr(cls, "context_attention") else ""
            cls.__doc__ = cls.__doc__.rstrip() + "\n" + LAYOUT_DOC + extra

    def __post_init__(self):
        check_scan_unroll(self)
        check_positive_ints(self, self.positive)
        self.check()

    def check(self) -> None:
        """The family's own checks, after the shared ones (a hook)."""

    @classmethod
    def from_hf(cls, d: dict):
        """From a Hugging Face ``config.json`` dict (Transformers 4 or 5 layout)."""
        return cls.from_hf_checkpoint(d, None)

    @classmethod
    def from_hf_checkpoint(cls, d: dict, tensor_names: frozenset[str] | None):
        """From ``config.json`` and the names of the checkpoint's tensors (None: unknown), for a
        family whose ``config.json`` does not say everything."""
        values = {}
        for f in dataclasses.fields(cls):
            key = cls.hf_keys.get(f.name, f.name)
            if key is None or f.name in _LAYOUT:
                continue
            if key in d:
                values[f.name] = _from_json(d[key], f.type)
            elif f.name in cls.hf_required:
                values[f.name] = d[key]  # a KeyError, which from_pretrained names with the file
            elif f.name in cls.hf_absent:
                values[f.name] = cls.hf_absent[f.name]
        return cls(**cls.hf_in(d, values, tensor_names))

    @classmethod
    def hf_in(cls, d: dict, values: dict, tensor_names: frozenset[str] | None) -> dict:
        """The constructor's arguments from ``config.json`` ``d``, given those read by the table (a hook)."""
        return values

    def to_hf(self) -> dict:
        """A Hugging Face ``config.json`` dict that Transformers loads as is."""
        d = {"architectures": [self.hf_architecture], "model_type": self.hf_type, **self.hf_fixed}
        for f in dataclasses.fields(self):
            key = self.hf_keys.get(f.name, f.name)
            if key is not None and f.name not in _LAYOUT:
                value = getattr(self, f.name)
                d[key] = list(value) if isinstance(value, tuple) else value
        return self.hf_out(d)

    def hf_out(self, d: dict) -> dict:
        """``config.json`` from the dict the table wrote (a hook)."""
        return d


@dataclasses.dataclass(frozen=True)
class DecoderConfig(ZooConfig):
    """The base of the decoder-only families' configs, which may split a sequence over ``context``."""

    context_attention: str = dataclasses.field(default="gather", kw_only=True)  # "gather" or "ring"

    def __post_init__(self):
        check_context_attention(self)
        super().__post_init__()


class GPTFields:
    """What GPT-2's and GPT-J's configs share beyond their fields' defaults: ``n_embd`` split
    into ``n_head`` heads, an MLP ``n_inner`` wide (None: ``4 * n_embd``), and the same table of
    required and positive fields."""

    hf_required: ClassVar[tuple[str, ...]] = ("vocab_size", "n_embd", "n_layer", "n_head")
    positive: ClassVar[tuple[str, ...]] = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")

    def check(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"{type(self).__name__}: n_embd={self.n_embd} must be a multiple of n_head={self.n_head}.")

    @property
    def inner(self) -> int:
        return self.n_inner or 4 * self.n_embd

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def check_activation(config) -> None:
    """A clear error for a config's ``activation_function`` that `ACTIVATIONS` does not name."""
    if config.activation_function not in ACTIVATIONS:
        raise ValueError(
            f"{type(config).__name__}.activation_function={config.activation_function!r} is not supported; "
            f"use one of {sorted(ACTIVATIONS)}."
        )


def _from_json(value, annotation: str):
    """A ``config.json`` value as the field annotated ``annotation`` holds it: a list as a
    tuple (hashable), or its one item where the field takes no tuple; a bool as a bool."""
    if isinstance(value, list):
        return tuple(value) if "tuple" in annotation or len(value) != 1 else value[0]
    if annotation == "bool" and value is not None:
        return bool(value)
    return value
