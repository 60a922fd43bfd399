"""examples/mixture_of_experts: a tiny Mixtral learns (held-out loss falls), its experts
sit on the expert axis (explain), and the export loads in Transformers."""

import re

import pytest

from _helpers import run_example

TINY = ["--train_bytes", "30000", "--eval_bytes", "8000", "--seq_len", "32", "--hidden_size", "32",
        "--n_epochs", "1", "--sample_tokens", "8", "--log_every", "10"]


@pytest.mark.slow
def test_a_tiny_mixtral_learns_and_exports(tmp_path):
    transformers = pytest.importorskip("transformers")
    text = run_example("mixture_of_experts/main.py", *TINY, "--export", tmp_path / "hf", "--plot", tmp_path / "load.png",
                       timeout=600)
    assert "8 devices, mesh {'data': 2, 'model': 4}" in text
    assert "expert stack: dim 0, experts 8 -> 2 per device (expert parallel)" in text
    first = float(re.search(r"step 0: held-out loss ([0-9.]+)", text).group(1))
    last = float(re.search(r"final held-out loss ([0-9.]+)", text).group(1))
    assert last < first - 1.0, text[-2000:]
    assert re.search(r"step 10: loss [0-9.]+, aux [0-9.]+, z [0-9.]+", text)
    assert re.search(r"final held-out loss [0-9.]+ \(perplexity [0-9.]+ per byte\)", text)
    assert (tmp_path / "load.png").read_bytes()[:4] == b"\x89PNG"  # each expert's share over training
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(hf).__name__ == "MixtralForCausalLM" and hf.config.num_local_experts == 8
