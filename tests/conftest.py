"""Every test runs on 8 simulated CPU devices; the flag must be set before jax is imported."""

import os

# The suite compiles hundreds of small programs, and XLA:CPU spends most of a compile in LLVM on
# code that runs for milliseconds: these flags lower that effort without changing what XLA
# computes or its buffer assignment (benchmarks/table1.py plans with them too), so the suite runs
# in about 60 % of the time. Processes the tests start inherit them.
FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                "--xla_cpu_use_fusion_emitters=false")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 " + FAST_COMPILE
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def getkey():
    """A fresh PRNG key each call: ``getkey()``."""
    counter = iter(range(10**9))

    def get():
        return jax.random.key(next(counter))

    return get


@pytest.fixture(scope="session")
def devices():
    assert len(jax.devices()) == 8, "tests need 8 simulated CPU devices; was jax imported before conftest?"
    return jax.devices()


_SLOW_CASES = {line.strip() for line in open(os.path.join(os.path.dirname(__file__), "slow_cases.txt"))
               if line.strip() and not line.startswith("#")}


def pytest_collection_modifyitems(config, items):
    """The cases listed in slow_cases.txt run only in the full suite; a listed id no test has is an error."""
    ids = {item.nodeid.removeprefix("tests/"): item for item in items}
    for case in _SLOW_CASES & ids.keys():
        ids[case].add_marker(pytest.mark.slow)
    if len(items) > 100:  # a whole run: every listed case must still exist (a renamed test leaves the list)
        missing = sorted(c for c in _SLOW_CASES if c.split("::")[0] in {i.split("::")[0] for i in ids} and c not in ids)
        if missing:
            raise pytest.UsageError(f"tests/slow_cases.txt names cases no test has: {missing[:5]}")
