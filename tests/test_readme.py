"""The README's Python code blocks run as written, in order, in one namespace,
on tiny data: the digits for `train`/`test`. `run_blocks` is also how
tests/test_docs.py runs the documentation's pages: a tiny LLaMA config where a
page plans LLaMA-7B, and a tiny checkpoint where it loads one.

A block marked by an HTML comment on the line before its fence,
``<!-- not run: the reason -->``, is shown but not run."""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# 8 heads, as a page's model has a multiple of them: every page's mesh, up to 8 model shards, splits them
TINY_LLAMA = "vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8"

BLOCK = re.compile(r"^(<!-- not run[^\n]*-->\n)?```python\n(.*?)^```", flags=re.S | re.M)


def python_blocks(text: str) -> list[str]:
    """The ```python blocks of a Markdown text, in order, except those marked not run."""
    return [code for mark, code in BLOCK.findall(text) if not mark]


def tiny(code: str, checkpoint: Path) -> str:
    """A block as the tests run it: tiny models and sequences where it shows large ones."""
    if "LlamaConfig(vocab_size=32000" in code:  # plan a tiny LLaMA instead of LLaMA-7B
        code = re.sub(r"LlamaConfig\(.*?\)", f"LlamaConfig({TINY_LLAMA})", code, flags=re.S)
    code = code.replace("(2, 1025)", "(2, 17)")
    if "get_topology_desc" in code:  # the same tiny LLaMA, planned for a TPU slice
        code = code.replace("(8, 1025)", "(8, 17)")
    if "get_topology_desc" in code and importlib.util.find_spec("libtpu") is None:
        # planning for a TPU slice needs libtpu (not a dependency); without it the same block
        # plans on this machine's devices (benchmarks/table1.py --compiler tpu-v4 runs it as written)
        code = re.sub(r"topologies\.get_topology_desc\(.*?\)\.devices", "jax.devices()", code, flags=re.S)
    return code.replace("path/to/llama-checkpoint", str(checkpoint))


def run_blocks(blocks: list[str], namespace: dict, source: str, tmp_path: Path) -> dict:
    """Runs `blocks` in order in `namespace` (and returns it); a failing block is named with its code."""
    checkpoint = tmp_path / "llama-checkpoint"
    for i, block in enumerate(blocks):
        if "path/to/llama-checkpoint" in block and not checkpoint.exists():
            exec("from redeqx import models\n"
                 f"models.save_pretrained(models.LlamaForCausalLM(models.LlamaConfig({TINY_LLAMA}), "
                 "key=jax.random.key(0)), CHECKPOINT)", namespace | {"CHECKPOINT": str(checkpoint)}, {})
        try:
            exec(compile(tiny(block, checkpoint), f"{source} python block {i}", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"{source} python block {i} failed:\n{block}") from e
    return namespace


@pytest.mark.slow
def test_readme_python_blocks_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # "out/..." paths land here
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250, "the README is a landing page: guides go to docs/guides/"
    blocks = python_blocks(readme)
    assert blocks, "the README lost its loop?"
    # the loop's block defines train, test and n_epochs itself (it did not: a reader's NameError)
    namespace = run_blocks(blocks, {}, "README.md", tmp_path)
    assert namespace["labels"] and len(namespace["labels"]) == len(namespace["test"]) == 297
