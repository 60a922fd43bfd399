"""Every public callable of redeqx checks its arguments' types (issue 33): a
function is wrapped by ``redeqx._typing.typechecked``; a class the user
constructs has a type-checked ``__init__``. A new public name is checked here
as soon as ``redeqx/__init__.py`` exports it."""

import inspect

import pytest

import redeqx
from redeqx._typing import ArgumentTypeError

# Public classes that are not constructed from user arguments, and why.
NOT_CONSTRUCTED = {
    "CheckpointError": "an exception redeqx raises",
    "Preempted": "an exception redeqx raises",
    "Plan": "the record `plan` returns",
    "GrainBatches": "the iterator `grain_batches` returns (its arguments are checked there)",
    "TrainState": "made by init_state; its fields also hold abstract arrays (plan), which jaxtyping shapes refuse",
}


def _public():
    for name in sorted(dir(redeqx)):
        value = getattr(redeqx, name)
        if name.startswith("_") or inspect.ismodule(value) or not callable(value):
            continue
        yield name, value


def test_the_public_callables_are_the_expected_ones():
    # The list the checks below run over; a name added to redeqx/__init__.py shows up here.
    names = [n for n, _ in _public()]
    assert len(names) >= 34 and {"batches", "Logger", "CheckpointManager", "initialize", "constrain"} <= set(names)


@pytest.mark.parametrize("name", [n for n, _ in _public()])
def test_every_public_callable_is_type_checked(name):
    value = getattr(redeqx, name)
    if inspect.isclass(value):
        if name in NOT_CONSTRUCTED:
            return
        value = value.__init__
    assert getattr(value, "__redeqx_typechecked__", False), (
        f"redeqx.{name} is not type-checked: decorate it (its __init__ for a class) with "
        "redeqx._typing.typechecked, or list it in NOT_CONSTRUCTED with the reason"
    )


def test_exempt_names_exist():
    assert set(NOT_CONSTRUCTED) <= {n for n, _ in _public()}


@pytest.mark.parametrize("call", [
    lambda: redeqx.read_metadata(3),
    lambda: redeqx.check_mesh(redeqx.make_mesh(1), name=3),
    lambda: redeqx.collective_summary(3),
    lambda: redeqx.remat(lambda x: x, keep="everything"),
    lambda: redeqx.Logger(3),
    lambda: redeqx.CheckpointManager(3),
])
def test_a_wrong_type_names_the_argument(call):
    with pytest.raises(ArgumentTypeError, match=r"argument \w+=.* is a \w+, expected"):
        call()
