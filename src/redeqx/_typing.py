"""Runtime type checks for the public API: jaxtyping shapes checked by beartype,
with short messages that name the argument instead of dumping every value."""

from __future__ import annotations

import functools
import inspect
import os
import reprlib
import sys
import types
import typing
import warnings

import jax
import numpy as np
from beartype import BeartypeConf, beartype
from beartype.door import is_bearable
from beartype.roar import BeartypeCallHintParamViolation
from jaxtyping import TypeCheckError, jaxtyped

# int where float is asked for is fine (PEP 484's numeric tower)
_CONF = BeartypeConf(is_pep484_tower=True)
_beartype = beartype(conf=_CONF)

_short = reprlib.Repr()
_short.maxstring = 60
_short.maxother = 60
_short.maxlist = _short.maxtuple = _short.maxdict = _short.maxset = 3
_short.maxlevel = 2


def short_repr(value) -> str:
    """A repr of at most a line or so, whatever the value (a dataset, a model)."""
    try:
        text = _short.repr(value)
    except Exception:  # a repr that fails is no reason to hide the real error
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 120 else text[:117] + "..."


def _hint_name(hint) -> str:
    """A type hint as a reader would say it: ``int or 'auto'``, ``Mesh or None``."""
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        return " or ".join(_hint_name(a) for a in typing.get_args(hint))
    if origin is typing.Literal:
        return " or ".join(repr(a) for a in typing.get_args(hint))
    if hint is type(None):
        return "None"
    if hint is jax.sharding.PartitionSpec:  # its class is named ``P``, which says little in a message
        return "a PartitionSpec (jax.P(...))"
    if isinstance(hint, type):
        return hint.__qualname__
    return str(hint).replace("typing.", "").replace("collections.abc.", "").replace("jaxtyping.", "")


class ArgumentTypeError(TypeCheckError):
    """A public function got an argument of the wrong type; the message names
    it, what it was and what is expected (a ``TypeError``)."""


def _bad_argument(fn, sig: inspect.Signature, hints: dict, args, kwargs) -> ArgumentTypeError | None:
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError:
        return None
    for name, value in bound.arguments.items():
        hint = hints.get(name)
        if hint is None:
            continue
        kind = sig.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            hint = tuple[hint, ...]
        elif kind is inspect.Parameter.VAR_KEYWORD:
            hint = dict[str, hint]
        try:
            ok = is_bearable(value, hint, conf=_CONF)
        except Exception:
            continue
        if not ok:
            return ArgumentTypeError(
                f"{fn.__qualname__}(): argument {name}={short_repr(value)} is a {type(value).__qualname__}, "
                f"expected {_hint_name(hint)}."
            )
    return None


def fn_name(fn) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


# how redeqx calls a loss_fn, and what one looks like (the steps' errors and the rules' say the same)
LOSS_CALL = "(model, batch, key)"
LOSS_EXAMPLE = "def loss_fn(model, batch, key): ..."
STATEFUL_CALL = "(model, batch, key, model_state)"
STATEFUL_EXAMPLE = "def loss_fn(model, batch, key, model_state): ...; return loss, new_model_state"


def takes(fn, n: int) -> bool | None:
    """Whether ``fn`` can be called with ``n`` positional arguments; None where its signature
    cannot be read (builtins, some C callables: found out when called)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        sig.bind(*([None] * n))
    except TypeError:
        return False
    return True


def check_signature(fn, role: str, n: int | tuple[int, ...], call: str, example: str) -> None:
    """``fn`` can be called with ``n`` positional arguments (any of them, for
    a tuple), else an error naming the function and what it must look like."""
    if any(takes(fn, k) is not False for k in ((n,) if isinstance(n, int) else n)):
        return
    sig = inspect.signature(fn)
    raise TypeError(
        f"{role} {fn_name(fn)!r} has the signature {sig}, but redeqx calls it as {role}{call}. "
        f"Write it as `{example}` (an argument it does not need may go unused)."
    )


def typechecked(fn):
    """Check ``fn``'s annotated arguments (and jaxtyping shapes) on every call.

    A wrong argument raises `ArgumentTypeError` (a ``TypeError``) whose message
    names the argument, a short repr of its value and the expected type; the
    checker's own message would print every argument in full (a dataset of
    5,000 examples made one of 175,000 characters).
    """
    checked = jaxtyped(typechecker=_beartype)(fn)
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return checked(*args, **kwargs)
        except (TypeCheckError, BeartypeCallHintParamViolation) as e:
            if isinstance(e, ArgumentTypeError):
                raise
            try:
                hints = typing.get_type_hints(fn)
            except Exception:
                hints = {}
            short = _bad_argument(fn, sig, hints, args, kwargs)
            if short is None:  # not one argument's fault (shapes that disagree across arguments)
                raise
            raise short from None

    wrapper.__redeqx_typechecked__ = True  # what tests/test_typed_api.py looks for
    return wrapper


_INTERNAL = tuple(
    os.path.dirname(m.__file__) + os.sep
    for m in (sys.modules[__name__.rsplit(".", 1)[0]], sys.modules["jaxtyping"], sys.modules["beartype"])
)


def warn_user(message: str, category=UserWarning) -> None:
    """``warnings.warn`` pointing at the first frame outside redeqx (and the
    type-check wrappers), so the warning names the user's own line."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1)


def positive_int(value, name: str, *, minimum: int = 1) -> int:
    """``value`` as an int, if it is one (not a bool) and at least ``minimum``;
    else a ``ValueError`` naming the argument: one check for every count of the API."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {what}, got {value!r}.")
    return int(value)


def floating_dtype(value, name: str, *, allow_none: bool = True):
    """``value`` as a NumPy floating dtype (``None`` stays ``None`` when allowed), or a
    ``TypeError`` naming the argument: one check for every dtype argument of the API."""
    if value is None and allow_none:
        return None
    import jax.numpy as jnp

    try:
        dtype = jnp.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        either = ", or None" if allow_none else ""
        raise TypeError(f"{name} must be a floating dtype such as jnp.bfloat16{either}; got {short_repr(value)}.")
    return dtype
