"""MkDocs hook: an API page for every public name of `redeqx` and `redeqx.models`,
generated at build time from the names the packages export, so a name added to
either `__init__.py` gets its page (and its place in the navigation) without an
edit here. Each page is one mkdocstrings directive, rendered from the docstring.

Names that differ only in case (`plan` and `Plan`) share a page, so the site
builds the same on case-insensitive file systems."""

import importlib
import sys
import types
from pathlib import Path

from mkdocs.structure.files import File

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # the checkout's redeqx, as mkdocstrings reads

PACKAGES = {"redeqx": "api", "redeqx.models": "api/models"}


def public_names(package: str) -> list[str]:
    """The public names `package` exports: no leading underscore, no submodules."""
    module = importlib.import_module(package)
    return sorted((n for n, v in vars(module).items() if not n.startswith("_") and not isinstance(v, types.ModuleType)),
                  key=lambda n: (n.lower(), n))


def api_pages() -> dict[str, list[str]]:
    """Page path (under docs/) -> the fully qualified names it documents."""
    pages: dict[str, list[str]] = {}
    for package, folder in PACKAGES.items():
        for name in public_names(package):
            pages.setdefault(f"{folder}/{name.lower()}.md", []).append(f"{package}.{name}")
    return pages


def on_config(config):
    sections = {package: [] for package in PACKAGES}
    for path, names in api_pages().items():
        sections[names[0].rpartition(".")[0]].append({" / ".join(n.rpartition(".")[2] for n in names): path})
    api = [{package: entries} for package, entries in sections.items()]
    for entry in config["nav"]:
        if isinstance(entry, dict) and "API reference" in entry:
            entry["API reference"] = [{"Overview": "api/index.md"}, *api]
    return config


def on_files(files, config):
    for path, names in api_pages().items():
        content = "\n\n".join(f"::: {name}" for name in names) + "\n"
        files.append(File.generated(config, path, content=content))
    return files
