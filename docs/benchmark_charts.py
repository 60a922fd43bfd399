"""Draws the pictures on docs/guides/benchmarks.md from the tables in
benchmarks/RESULTS.md (no benchmark is re-run): after a benchmark rewrites
its section, run

    python docs/benchmark_charts.py

and commit the PNGs it writes to docs/images/. vs_redco.png is not redrawn:
its table is in RESULTS.md's History now (its script at 3db93f0)."""

import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
IMAGES = ROOT / "docs" / "images"


def tables(title: str) -> list[list[dict[str, str]]]:
    """The Markdown tables of the RESULTS.md section whose heading starts with `title`, as rows of dicts."""
    sections = re.split(r"^## ", RESULTS.read_text(), flags=re.M)
    section = next(s for s in sections if s.startswith(title))
    found = []
    for block in re.findall(r"((?:^\|.*\|\n)+)", section, flags=re.M):
        lines = [[c.strip() for c in line.strip().strip("|").split("|")] for line in block.strip().split("\n")]
        found.append([dict(zip(lines[0], row)) for row in lines[2:]])
    return found


def number(text: str) -> float:
    """The first number in a cell: '27.44 GB' -> 27.44, '68,583' -> 68583, '**0.93**' -> 0.93."""
    return float(re.search(r"-?[0-9][0-9,]*\.?[0-9]*", text).group(0).replace(",", ""))


def save(fig, name: str) -> None:
    fig.tight_layout()
    fig.savefig(IMAGES / name, dpi=110)
    plt.close(fig)
    print("wrote", (IMAGES / name).relative_to(ROOT))


def table1() -> None:
    """redco's Table 1 by the planner: each model's peak per device against its devices' memory."""
    cpu = tables("redco Table 1 by the planner")[0]
    tpu = tables("redco Table 1's TPU rows by the TPU v4 compiler")[0]
    rows = [(f"{r['model']}  ({r['n_model_shards x data']})", number(r["peak / device"]),
             number(r["server: devices x memory"].split(":")[-1].split("x")[-1]), "XLA:CPU") for r in cpu if r["params"]]
    rows += [(f"{r['model']}, {r['setting']}, TPU v4  ({r['n_model_shards x data']})", number(r["peak / chip (TPU compiler)"]),
              32.0, "TPU v4 compiler") for r in tpu if r["model"].startswith("OPT-66B")]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.2))
    for i, (label, peak, memory, compiler) in enumerate(rows):
        color = ("tab:blue" if compiler == "XLA:CPU" else "tab:green") if peak <= memory else "tab:red"
        ax.barh(i, min(peak, 80), color=color)
        ax.plot([memory, memory], [i - 0.4, i + 0.4], color="black", lw=2)
        ax.text(min(max(peak, memory), 80) + 0.8, i, f"{peak:.1f} GB" + (" (off scale)" if peak > 80 else ""), va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 110)
    ax.set_xlabel("planned peak per device, GB (black: the device's memory)")
    ax.set_title("redco's Table 1 planned by redeqx.plan\nblue: XLA:CPU fits; green: TPU v4 compiler fits; red: does not fit",
                 fontsize=9)
    save(fig, "table1_peaks.png")


def throughput() -> None:
    """The zoo's 1.1B LLaMA on one H200: step time and MFU by layer layout."""
    rows = tables("Throughput and MFU")[0]
    names = [r["variant"].removeprefix("redeqx bf16, ") for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 2.8))
    left.barh(names, [number(r["step"]) for r in rows], color="tab:blue")
    left.set_xlabel("step time, ms (lower is better)")
    right.barh(names, [number(r["MFU"]) for r in rows], color="tab:orange")
    right.set_xlabel("MFU, % (higher is better)")
    right.set_yticks(range(len(names)), [""] * len(names))
    for ax in (left, right):
        ax.invert_yaxis()
        for bar in ax.patches:
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {bar.get_width():.1f}", va="center", fontsize=8)
        ax.margins(x=0.2)
    fig.suptitle("LLaMA 1.1B, batch 8 x 2048, bf16, one H200", fontsize=9)
    save(fig, "throughput_h200.png")


def rules_program() -> None:
    """Collective bytes with the rules read from the program, over the bytes with names alone,
    for the models where the two differ (every other model: the same plan, 1.000)."""
    rows = [r for r in tables("Rules read from the program")[1] if r["program / names"] != "1.000"]
    labels = [f"{r['model']}, n={r['n']}" for r in rows]
    ratios = [number(r["program / names"]) for r in rows]
    fig, ax = plt.subplots(figsize=(8, 0.3 * len(rows) + 1.2))
    ax.barh(labels, ratios, color=["tab:green" if x < 0.999 else "tab:red" if x > 1.001 else "tab:gray" for x in ratios])
    ax.axvline(1.0, color="black", lw=1)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("collective bytes per step, rules read from the program / names alone\n"
                  "(lower is better; every other model tested: 1.000, the same plan)", fontsize=8)
    save(fig, "rules_program.png")


if __name__ == "__main__":
    IMAGES.mkdir(exist_ok=True)
    for draw in (table1, throughput, rules_program):
        draw()
