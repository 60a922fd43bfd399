"""The documentation site (mkdocs.yml, docs/) builds with ``mkdocs build
--strict``, so a broken link, a missing anchor or a docstring that does not
render fails; every public name of `redeqx` and `redeqx.models` has its API
page; and every page's ```python blocks run as tests/test_readme.py runs the
README's: in order, each page in a namespace that starts from what the loop's
page (docs/guides/loop.md) leaves, with tiny models where a page shows large
ones. A block marked ``<!-- not run: the reason -->`` on the line before its
fence is not run (docs/index.md states the convention)."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from test_readme import python_blocks, run_blocks

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
LOOP = DOCS / "guides" / "loop.md"
sys.path.insert(0, str(DOCS))
from api_pages import api_index, api_pages  # noqa: E402  (the pages the site generates, one per public name)


def test_the_api_overview_is_generated_from_the_signatures():
    # docs/api/index.md's table: every public name of redeqx, each with the signature inspect.signature reads
    assert (DOCS / "api" / "index.md").read_text() == api_index(), (
        "docs/api/index.md is not what docs/api_pages.py generates: run python docs/api_pages.py"
    )


@pytest.mark.slow
def test_docs_build_strict_with_a_page_per_public_name(tmp_path):
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    pages = api_pages()
    assert len(pages) >= 70, "fewer public names than redeqx exports?"
    for path, names in pages.items():
        html = (site / path.removesuffix(".md") / "index.html").read_text()
        for name in names:
            assert f'id="{name}"' in html, f"{path} does not document {name}"
    for guide in (DOCS / "guides").glob("*.md"):
        assert (site / "guides" / guide.stem / "index.html").is_file(), f"{guide.name} was not built"


def fresh_copy(tree):
    """A copy of every array in ``tree``, laid out as before: a page's step donates its state,
    and the next page starts from the loop's state again."""
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding, may_alias=False) if isinstance(x, jax.Array) else x,
                        tree)


@pytest.mark.slow
def test_docs_python_blocks_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # "out/..." and "runs/..." paths land here
    loop = run_blocks(python_blocks(LOOP.read_text()), {}, "docs/guides/loop.md", tmp_path)
    ran = []
    for page in sorted(DOCS.rglob("*.md")):
        blocks = python_blocks(page.read_text())
        if page == LOOP or not blocks:
            continue
        namespace = loop | {"state": fresh_copy(loop["state"])}
        run_blocks(blocks, namespace, str(page.relative_to(ROOT)), tmp_path)
        ran.append(page.stem)
    assert {"checkpoints", "data", "large_models", "models", "stacked_layers"} <= set(ran), ran
    assert (tmp_path / "out" / "lora-merged" / "config.json").exists()
