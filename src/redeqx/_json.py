"""The one JSON encoder of what redeqx writes: checkpoint metadata,
``metrics.jsonl`` and `Logger.save_outputs`.

Strict JSON (RFC 8259) has no NaN: strict readers (JavaScript, jq, many
JSON libraries) reject a bare one, so a non-finite float is written as the
string ``"NaN"``, ``"Infinity"`` or ``"-Infinity"`` (``float(s)`` reads it
back; `as_number` too). Arrays (JAX or NumPy) become nested lists, a typed
PRNG key ``{"prng_key": impl, "data": [...]}`` (`from_json` turns it back
into a key), anything else an error naming where it is.

The iterator-position protocol lives here too: an iterator whose position a
checkpoint keeps has ``get_state()`` and ``set_state()`` (`checkpointable`),
and its state is kept as strict JSON (`state_to_json`, `state_from_json`),
never a pickle.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from ._typing import short_repr

NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def is_key(x) -> bool:
    """A typed PRNG key (concrete or abstract)."""
    return isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _finite_or_name(value: float):
    if math.isfinite(value):
        return value
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")


def to_json(value, where: str = "value", *, strict: bool = True):
    """``value`` as JSON values (dicts, lists, str, int, float, bool, None);
    a ``TypeError`` naming ``where`` for what JSON cannot hold.
    ``strict=False`` keeps non-finite floats as floats (for a caller that
    still reads them before `dumps` writes them)."""
    if is_key(value):
        return {"prng_key": str(jax.random.key_impl(value)), "data": np.asarray(jax.random.key_data(value)).tolist()}
    if isinstance(value, (jax.Array, np.ndarray, np.generic)):
        return to_json(np.asarray(value).tolist(), where, strict=strict)
    if isinstance(value, Mapping):
        return {str(k): to_json(v, f"{where}[{k!r}]", strict=strict) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v, f"{where}[{i}]", strict=strict) for i, v in enumerate(value)]
    if isinstance(value, float):
        return _finite_or_name(value) if strict else value
    if value is None or isinstance(value, (bool, int, str)):
        return value
    raise TypeError(
        f"{where} = {value!r} ({type(value).__name__}) cannot be stored as JSON; pass numbers, strings, lists, "
        "dicts, arrays or PRNG keys."
    )


def dumps(value, where: str = "value", **kwargs) -> str:
    """``json.dumps`` of `to_json` ``(value)``: strict JSON text."""
    return json.dumps(to_json(value, where), allow_nan=False, **kwargs)


def from_json(value):
    """What `to_json` wrote, with PRNG keys made keys again."""
    if isinstance(value, dict):
        if set(value) == {"prng_key", "data"}:
            return jax.random.wrap_key_data(np.asarray(value["data"], np.uint32), impl=value["prng_key"])
        return {k: from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json(v) for v in value]
    return value


def as_number(value) -> float | None:
    """A number as `to_json` stored it -> a float (``"NaN"`` etc. included),
    or None for anything that is not a number."""
    if isinstance(value, str):
        return NON_FINITE.get(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


# ----------------------------------------------------------------------------- iterator positions
# (an iterator whose position a checkpoint keeps: Grain's, `grain_batches`', or any with get_state/set_state)

_NOT_CHECKPOINTABLE = (
    "{name} must be a Grain dataset or iterator whose position can be saved (grain.MapDataset, "
    "grain.IterDataset, a grain.DatasetIterator, grain.DataLoader): an iterator with get_state() and "
    "set_state(). Got {got}. For a plain iterable, use redeqx.batches(examples, ..., start=batch) to resume."
)


def checkpointable(iterator, name: str = "data_iterator"):
    """``iterator`` if it has ``get_state`` and ``set_state``, else a
    ``TypeError`` saying what is needed."""
    if not (callable(getattr(iterator, "get_state", None)) and callable(getattr(iterator, "set_state", None))):
        raise TypeError(_NOT_CHECKPOINTABLE.format(name=name, got=short_repr(iterator)))
    return iterator


def state_to_json(state, where: str = "data_iterator.get_state()"):
    """An iterator's state as strict JSON: bytes (a ``DataLoader``'s) as
    base64, anything else as itself if JSON gives it back unchanged."""
    if isinstance(state, (bytes, bytearray)):
        return {"base64": base64.b64encode(bytes(state)).decode("ascii")}
    try:
        same = json.loads(json.dumps(state, allow_nan=False)) == state
    except (TypeError, ValueError) as e:
        raise TypeError(f"{where} returned {short_repr(state)}, which is not JSON ({e}); a checkpoint holds the "
                        "data position as JSON, never a pickle.") from None
    if not same:
        raise TypeError(f"{where} returned {short_repr(state)}, which JSON does not give back unchanged (a tuple, "
                        "or a non-string key?); a checkpoint holds the data position as JSON, never a pickle.")
    return {"json": state}


def state_from_json(saved):
    """The inverse of `state_to_json`."""
    if isinstance(saved, dict) and set(saved) == {"base64"}:
        return base64.b64decode(saved["base64"])
    if isinstance(saved, dict) and set(saved) == {"json"}:
        return saved["json"]
    raise ValueError(f"not a saved data iterator state: {short_repr(saved)}.")
