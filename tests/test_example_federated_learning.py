"""examples/federated_learning (FedAvg on non-IID digits): accuracy rises over
a few rounds, and 2 processes x 4 devices print what 1 process x 8 prints."""

import re

import pytest

from _helpers import run_example

# one worker runs this module, so its module-scoped process run happens once under -n 2
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("test_example_federated_learning")]
SCRIPT = "federated_learning/main.py"
TINY = ["--n_rounds", "8", "--local_epochs", "3", "--hidden", "64", "--learning_rate", "0.2", "--central_epochs", "1"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("fedavg")
    return run_example(SCRIPT, *TINY, "--workdir", workdir), workdir


def test_fedavg_accuracy_rises(one_process):
    text, workdir = one_process
    accuracy = [float(a) for a in re.findall(r"round \d+: test loss [0-9.]+, test accuracy ([0-9.]+)", text)]
    assert len(accuracy) == 8, text[-3000:]
    assert accuracy[-1] > accuracy[0] + 0.2, text[-3000:]  # from chance (~0.1) to well above it
    assert list((workdir / "checkpoints").iterdir()) and (workdir / "metrics.jsonl").exists()


def test_fedavg_two_processes_match_one(one_process):
    two = run_example(SCRIPT, *TINY, launch=("-n", "2"))
    final = lambda text: re.search(r"FedAvg, 8 rounds: final test accuracy .*", text).group(0)  # noqa: E731
    assert final(two) == final(one_process[0]), (two[-2000:], one_process[0][-2000:])
    assert two.count("round 8:") == 1  # only process 0 prints
