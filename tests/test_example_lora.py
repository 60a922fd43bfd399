"""examples/lora: adapters trained on the language reference lower its
held-out loss while few parameters train, and the merged export is the
adapted model: Transformers loads it and gets the loss the script printed."""

import importlib.util
import re

import numpy as np
import pytest

from _helpers import EXAMPLES, export_matches_transformers, run_example, torch_lm_loss

SCRIPT = EXAMPLES / "lora/main.py"
TINY = ["--source_chars", "30000", "--docs_chars", "24000", "--pretrain_epochs", "1", "--n_epochs", "2",
        "--seq_len", "32", "--vocab_size", "512", "--hidden_size", "64", "--n_layers", "2",
        "--per_device_batch_size", "4", "--rank", "4", "--alpha", "8", "--sample_tokens", "4"]


@pytest.mark.slow
def test_lora_adapts_to_docs_and_exports_merged_weights(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    out = run_example("lora/main.py", *TINY, "--workdir", tmp_path / "run", "--export", tmp_path / "hf")
    n_train, n_total = (int(x.replace(",", "")) for x in
                        re.search(r"trainable parameters ([0-9,]+) of ([0-9,]+)", out).groups())
    assert 0 < n_train < n_total / 10, out
    held_out = [float(x) for x in re.findall(r"held-out docs loss ([0-9.]+), perplexity", out)]
    assert len(held_out) == 3 and held_out[-1] < held_out[0] - 0.3, out  # base model, then each epoch
    assert list((tmp_path / "run" / "checkpoints").glob("step_*"))

    # the merged export is a plain LLaMA that Transformers reads as redeqx does...
    hf, tokenizer = export_matches_transformers(tmp_path / "hf", 'The "while" statement is used for repeated execution')
    # ...and is the adapted model: its held-out docs loss is the one the script printed for the adapters
    spec = importlib.util.spec_from_file_location("lora_example", SCRIPT)
    lora = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lora)
    _, _, docs_test = lora.load_texts(30000, 24000)
    blocks = torch.tensor(lora.to_blocks(tokenizer, docs_test, 32), dtype=torch.long)
    np.testing.assert_allclose(torch_lm_loss(hf, blocks), held_out[-1], rtol=2e-4)
