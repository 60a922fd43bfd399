"""examples/language_modeling: a tiny LLaMA learns the standard library's
source (held-out loss falls), the export loads in Transformers with the same
logits and the same held-out loss, --init_from continues from it, and two
processes train exactly as one."""

import importlib.util
import re

import numpy as np
import pytest

from _helpers import EXAMPLES, export_matches_transformers, run_example, torch_lm_loss

# one worker runs this module, so its module-scoped process run happens once under -n 2
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("test_example_language_modeling")]
SCRIPT = EXAMPLES / "language_modeling/main.py"
TINY = ["--train_chars", "30000", "--eval_chars", "15000", "--seq_len", "32", "--vocab_size", "512",
        "--hidden_size", "64", "--n_layers", "2", "--n_epochs", "1", "--per_device_batch_size", "4",
        "--sample_tokens", "8", "--log_every", "5"]


def run(*args, launch=False):
    return run_example("language_modeling/main.py", *TINY, *args, launch=("-n", "2") if launch else None)


def losses(stdout):
    """Held-out losses (step 0, then after each epoch) and the logged train losses."""
    held_out = [float(x) for x in re.findall(r"held-out loss ([0-9.]+), perplexity", stdout)]
    train = [float(x) for x in re.findall(r"train loss ([0-9.]+)", stdout)]
    return np.array(held_out), np.array(train)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lm")
    return tmp, run("--workdir", tmp / "run", "--export", tmp / "hf")


def test_held_out_loss_falls_and_samples_print(one_process):
    tmp, stdout = one_process
    held_out, train = losses(stdout)
    assert len(held_out) == 2 and held_out[-1] < held_out[0] - 0.7, stdout  # 6.25 -> 4.91 (ln 512 = 6.24)
    assert train[-1] < train[0], stdout
    assert stdout.count("--- sample") == 4, stdout
    assert (tmp / "run" / "metrics.jsonl").exists() and list((tmp / "run" / "checkpoints").glob("step_*"))


def test_export_loads_in_transformers_with_the_same_logits_and_loss(one_process):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    tmp, stdout = one_process
    hf, tokenizer = export_matches_transformers(tmp / "hf", "def read(self, n=-1):\n    return self._buf[:n]")

    # the export is the trained model: its loss on the script's held-out blocks is the one the script printed
    spec = importlib.util.spec_from_file_location("lm_example", SCRIPT)
    lm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lm)
    _, held_out_texts = lm.load_texts(30000, 15000)
    blocks = torch.tensor(lm.to_blocks(tokenizer, held_out_texts, 32), dtype=torch.long)
    np.testing.assert_allclose(torch_lm_loss(hf, blocks), losses(stdout)[0][-1], rtol=2e-4)


def test_init_from_continues_from_the_export(one_process, tmp_path):
    tmp, stdout = one_process
    held_out, _ = losses(run("--init_from", tmp / "hf", "--n_epochs", "1", "--learning_rate", "5e-4"))
    np.testing.assert_allclose(held_out[0], losses(stdout)[0][-1], rtol=1e-4)  # starts where the export ended
    assert held_out[-1] < held_out[0]


def test_two_processes_train_as_one(one_process, tmp_path):
    _, stdout = one_process
    two = run("--workdir", tmp_path / "run", "--export", tmp_path / "hf", launch=True)
    assert "8 devices in 2 process(es)" in two
    for got, want in zip(losses(two), losses(stdout)):
        np.testing.assert_allclose(got, want, rtol=1e-4)
    assert (tmp_path / "hf" / "model.safetensors").exists() and (tmp_path / "hf" / "tokenizer.json").exists()


def test_pipeline_stages_train_as_the_same_batch_without_them():
    """Two stages x 2 model shards x 2 data against 4 model shards x 2 data: the same global batch, the
    same held-out losses; and with each stage a process of its own (two hosts over a slow link)."""
    staged = losses(run("--n_pipeline_stages", "2", "--microbatches", "2"))[0]
    plain = losses(run("--n_model_shards", "4"))[0]
    assert len(staged) == 2 and staged[-1] < staged[0] - 0.7
    np.testing.assert_allclose(staged, plain, rtol=1e-4)
    two_hosts = losses(run("--n_pipeline_stages", "2", "--microbatches", "2", launch=True))[0]
    np.testing.assert_allclose(two_hosts, staged, rtol=1e-4)
