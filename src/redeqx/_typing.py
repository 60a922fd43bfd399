"""Runtime type checks for the public API: jaxtyping shapes checked by beartype."""

from beartype import BeartypeConf, beartype
from jaxtyping import jaxtyped

# int where float is asked for is fine (PEP 484's numeric tower)
_beartype = beartype(conf=BeartypeConf(is_pep484_tower=True))


def typechecked(fn):
    """Check ``fn``'s annotated arguments (and jaxtyping shapes) on every call."""
    return jaxtyped(typechecker=_beartype)(fn)
