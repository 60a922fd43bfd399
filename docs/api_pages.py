"""MkDocs hook: an API page for every public name of `redeqx` and `redeqx.models`,
generated at build time from the names the packages export, so a name added to
either `__init__.py` gets its page (and its place in the navigation) without an
edit here. Each page is one mkdocstrings directive, rendered from the docstring.

Names that differ only in case (`plan` and `Plan`) share a page, so the site
builds the same on case-insensitive file systems.

The overview, docs/api/index.md, is generated too: its table has a row per
entry of `ROWS` (a line of what the names do, written here), each name shown
with its signature as ``inspect.signature`` reads it, and `api_index` refuses a
public name of `redeqx` that no row lists. ``python docs/api_pages.py``
rewrites the page; tests/test_docs.py fails when the checked-in one differs.

```
python docs/api_pages.py
```
"""

import importlib
import inspect
import sys
import types
from pathlib import Path

from mkdocs.structure.files import File

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS.parent / "src"))  # the checkout's redeqx, as mkdocstrings reads

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


# ----------------------------------------------------------------------------- the overview page

# (names, what they do): a row of docs/api/index.md each, in this order; every public name of redeqx in one row
ROWS = [
    (["make_mesh"], ('a `("data", "model")` mesh (`"context"` too, with `n_context_shards`; `"stage"` in front, with '
                     '`n_pipeline_stages`): `model` = n_model_shards, `data` = the rest; `"auto"` picks the smallest '
                     'that fits (with `planner`)')),
    (["sharding_rules"], ("a PartitionSpec for every array of an Equinox model, each weight's role read from "
                          "`loss_fn(model, batch, key)` when given; works on abstract models")),
    (["explain"], ("a table, one short line per array: path, shape, dtype, spec, bytes per device, why "
                   '(`reasons="full"`: all of it); totals')),
    (["specs_from_overrides"], ("a hand plan: every array replicated except where a `(regex, spec)` override says "
                                "otherwise")),
    (["shard"], "place every array leaf with its spec (a copy: your arrays stay yours)"),
    (["init_model"], "build a model straight into its shards (never whole on one device)"),
    (["TrainState", "init_state"], ("model + optimizer state (sharded like the parameters it mirrors) + step + key "
                                    "(+ BatchNorm state)")),
    (["init_opt_state"], "an optimizer state sharded like its parameters, for your own steps"),
    (["make_train_step"], "`(state, batch) -> (state, metrics)`; metrics hold `loss`, `grad_norm` and your aux dict"),
    (["make_step"], "compile your own step over any state pytree (several models, DP-SGD, PPO, FedAvg...)"),
    (["apply_gradients"], "one optimizer update of a `TrainState`, for steps you write with `make_step`"),
    (["make_eval_step", "make_predict_step"], "compiled inference-mode loss and prediction"),
    (["batches", "evaluate", "predict"], ("global sharded batches from a list or a stream (collated in a background "
                                          "thread); exact example-weighted metrics; one output per example, in order")),
    (["shuffled"], ("a stream read through a seeded shuffle buffer: the same order on every process and after a "
                    "resume")),
    (["grain_batches", "GrainBatches"], ("global batches from a Grain pipeline, whose position `CheckpointManager` "
                                         "saves and restores")),
    (["lr_schedule"], "linear or cosine decay with warm-up, exactly as long as the run `batches` yields"),
    (["plan", "Plan"], ("compile the real step on abstract shapes: memory per device, collectives and FLOPs (a loop "
                        "counted once per iteration), fits or not and what would make it fit; print the `Plan`")),
    (["compare_plans"], ("plans side by side at the link speeds you give: each step's seconds from its compiled "
                         "FLOPs and bytes (stages over hosts against FSDP over them, say), and which is faster")),
    (["remat"], ("recompute each layer's activations in the backward pass: every `lax.scan` iteration (stacked "
                 "layers) and every block of a list of repeated blocks, in any Equinox model")),
    (["exact_conv_grads"], ("grouped and depthwise convolutions' weight gradients from matrix products: XLA's are "
                            "`n_model_shards` times too large on redeqx's batch layout (every step maker, `make_step` "
                            "included, applies it; for your own `jax.jit`)")),
    (["with_opt_state_dtype"], "keep an optimizer's state in bfloat16"),
    (["muon_dimensions"], ("which weights `optax.contrib.muon` orthogonalises, and along which dims, read from the "
                           "program: stacked layers and experts slice by slice, Equinox's `(out, in)` as such")),
    (["collective_summary"], "kind, count and bytes of every collective in a compiled step"),
    (["constrain"], "pin an activation's layout inside a model (Megatron's points)"),
    (["attention"], ("exact softmax attention of a sequence over itself, split over the mesh's `context` axis when "
                     "it has one")),
    (["sequence_positions", "context_order", "restore_order"], ("the positions of a sequence's tokens as a step on a "
                                                                "`context` axis holds them (for RoPE, position tables, "
                                                                "masks); that order; per-token outputs back in order")),
    (["save_checkpoint", "restore_checkpoint", "CheckpointManager"], ("orbax checkpoints: per-device shards, "
                                                                      "re-sharding restore, last-N / best-by-metric, "
                                                                      "async, atomic; any pytree of states")),
    (["read_metadata", "CheckpointError"], ("a checkpoint's JSON metadata; the error a save or restore raises, naming "
                                            "the path and the cause")),
    (["Preempted", "PREEMPTED_EXIT_CODE"], ("raised by `CheckpointManager.save` after a preemption's checkpoint is on "
                                            "disk; its exit status")),
    (["Logger"], "TensorBoard + JSONL metrics with throughput, a log file, JSON outputs; process 0 only"),
    (["initialize"], ("multi-host start-up; `python -m redeqx.launch -n N script.py` starts N local processes to try "
                      "it on one machine")),
    (["check_mesh", "preflight"], ("the mesh redeqx works with (or an error naming the fix); every process sees the "
                                   "same devices and versions")),
    (["StepWatchdog", "HUNG_EXIT_CODE"], ("ends a run whose step hangs, printing every process's stacks; its exit "
                                          "status")),
]

# Deprecated names, (names, what to use instead): a table of their own, below the other
DEPRECATED = [
    (["checkpoint"], ("`remat(loss_fn)` (a checkpoint in redeqx is one on disk); meanwhile it warns and recomputes "
                      "the one call as before")),
]
# Deprecated uses of names that stay, (the old use, what to write instead)
DEPRECATED_USES = [
    ("init_opt_state(optimizer, model, mesh, specs)", ("`init_opt_state(model, optimizer, mesh, specs)`, the order "
                                                       "of `init_state`; meanwhile the old order warns and works")),
]

# Classes shown by name alone: users get them from redeqx (returned or raised), they do not construct them
NOT_CONSTRUCTED = {"TrainState", "GrainBatches", "Plan"}

HEADER = """# API reference

Every public name of `redeqx` and `redeqx.models` has a page, generated from
its docstring (the navigation lists them all). What each piece does, in a
line (this page is generated by `python docs/api_pages.py` from the
signatures):

| name | what it does |
|---|---|
"""

MODELS_ROW = ("| [`redeqx.models`](../guides/models.md) | LLaMA / Mistral / Qwen2, GPT-2, GPT-J, OPT, T5, BART, layers "
              "listed or stacked (`scan_layers`), with Hugging Face safetensors I/O, cached generation (`generate` "
              "drives your own decoder too) and LoRA |\n")


def _default(value) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


def shown(name: str) -> str:
    """``name`` as the overview shows it: with its parameters (no annotations)
    for a function or a class users construct, with its value for a constant."""
    value = getattr(importlib.import_module("redeqx"), name)
    if isinstance(value, type) and (issubclass(value, BaseException) or name in NOT_CONSTRUCTED):
        return name
    if not callable(value):
        return f"{name} = {value!r}"
    parts, star = [], False
    for p in inspect.signature(value).parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
        star = star or p.kind in (p.KEYWORD_ONLY, p.VAR_POSITIONAL)
        prefix = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
        default = "" if p.default is p.empty else f"={_default(p.default)}"
        parts.append(f"{prefix}{p.name}{default}")
    return f"{name}({', '.join(parts)})"


def _row(names: list[str], what: str) -> str:
    return "| " + ", ".join(f"[`{shown(n)}`]({n.lower()}.md)" for n in names) + f" | {what} |\n"


def api_index() -> str:
    """docs/api/index.md: the table of `ROWS` (then `DEPRECATED` and `DEPRECATED_USES`), each name with its
    signature."""
    listed = [n for names, _ in ROWS + DEPRECATED for n in names]
    public = public_names("redeqx")
    missing = [n for n in public if n not in listed]
    unknown = [n for n in listed if n not in public]
    twice = sorted({n for n in listed if listed.count(n) > 1})
    if missing or unknown or twice:
        raise ValueError(f"docs/api_pages.py's ROWS: public names of redeqx in no row {missing}, names in a row that "
                         f"redeqx does not export {unknown}, names in two rows {twice}. Give each public name one "
                         "row (or DEPRECATED entry), then run python docs/api_pages.py.")
    text = HEADER + "".join(_row(names, what) for names, what in ROWS) + MODELS_ROW
    text += "\n## Deprecated\n\nStill there, warning when used, gone in the next release:\n\n"
    text += "| name | instead |\n|---|---|\n" + "".join(_row(names, what) for names, what in DEPRECATED)
    return text + "".join(f"| `{use}` | {what} |\n" for use, what in DEPRECATED_USES)


if __name__ == "__main__":
    (DOCS / "api" / "index.md").write_text(api_index())
