"""The README's main example runs on its built-in data and learns; every
example has a README with its command and its wall time."""

import re

import pytest

from _helpers import EXAMPLES, run_example


@pytest.mark.slow
def test_mnist_example_reaches_95_percent():
    out = run_example("mnist/main.py")
    assert "8 devices, mesh {'data': 4, 'model': 2}" in out
    accuracy = float(re.search(r"final test accuracy from predict: ([0-9.]+)", out).group(1))
    assert accuracy >= 0.95, out[-2000:]


def test_every_example_has_a_readme_with_its_command_and_wall_time():
    for directory in sorted(p for p in EXAMPLES.iterdir() if p.is_dir()):
        readme = directory / "README.md"
        assert readme.is_file(), f"examples/{directory.name} has no README.md"
        text = readme.read_text()
        commands = [f"python examples/{directory.name}/{script.name}" for script in directory.glob("*.py")]
        assert any(c in text for c in commands), f"examples/{directory.name}/README.md shows none of {commands}"
        assert re.search(r"\bwall\b", text, re.I), f"examples/{directory.name}/README.md gives no wall time"
