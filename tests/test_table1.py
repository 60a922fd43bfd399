"""`python -m benchmarks.table1`'s quick mode: GPT2-Large's widths (2 of its 36
layers) planned on 2 simulated devices of 10 GB, as redco's Table 1 row runs
it, in a subprocess the way the benchmark runs every row."""

import json

import pytest

from _helpers import ROOT, run_python


@pytest.mark.slow
def test_table1_quick_row_fits_in_the_stated_memory(tmp_path):
    out = tmp_path / "table1.json"
    proc = run_python("-m", "benchmarks.table1", "--rows", "gpt2-large", "--quick", "--json", out, cwd=ROOT)
    (row,) = json.loads(out.read_text())
    plan = row["redco"]
    assert row["row"] == "gpt2-large"
    assert plan["mesh"] == {"data": 1, "model": 2} and plan["seq"] == 512 and plan["global_batch"] == 1
    assert plan["fits"] is True and plan["margin"] > 0
    assert plan["peak"] < 10e9
    # AdamW's two moments mirror the parameters; the step holds at least the state and the gradients
    assert abs(plan["optimizer"] - 2 * plan["parameters"]) <= 64
    assert plan["peak"] >= plan["parameters"] + plan["optimizer"] + plan["gradients"]
    # each device holds at most its half of the split weights plus the replicated leaves (the embedding:
    # 50257 rows do not divide by 2), and at least half of everything
    assert 4 * row["params"] / 2 <= plan["parameters"] < 4 * row["params"]
    assert "| GPT2-Large |" in proc.stdout and "Quick mode" in proc.stdout
