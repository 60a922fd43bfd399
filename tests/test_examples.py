"""The README's main example runs on its built-in data and learns; every
example has a README with its command and its wall time."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_mnist_example_reaches_95_percent():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the script sets its own 8 devices
    out = subprocess.run([sys.executable, str(ROOT / "examples/mnist/main.py")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "8 devices, mesh {'data': 4, 'model': 2}" in out.stdout
    accuracy = float(re.search(r"final test accuracy from predict: ([0-9.]+)", out.stdout).group(1))
    assert accuracy >= 0.95, out.stdout[-2000:]


def test_every_example_has_a_readme_with_its_command_and_wall_time():
    for directory in sorted(p for p in (ROOT / "examples").iterdir() if p.is_dir()):
        readme = directory / "README.md"
        assert readme.is_file(), f"examples/{directory.name} has no README.md"
        text = readme.read_text()
        commands = [f"python examples/{directory.name}/{script.name}" for script in directory.glob("*.py")]
        assert any(c in text for c in commands), f"examples/{directory.name}/README.md shows none of {commands}"
        assert re.search(r"\bwall\b", text, re.I), f"examples/{directory.name}/README.md gives no wall time"
