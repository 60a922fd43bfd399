"""Write one benchmark's section of benchmarks/RESULTS.md, keeping the others."""

import datetime
import platform
import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
HEADER = "# Benchmark results\n\nEach section is rewritten by the script named in its title; ratios are measured side by side in one run.\n"


def write_section(title: str, body: str) -> None:
    text = RESULTS.read_text() if RESULTS.exists() else HEADER
    stamp = f"_{datetime.date.today().isoformat()}, {platform.machine()}, {platform.node() or 'host'}_"
    section = f"## {title}\n\n{stamp}\n\n{body.strip()}\n"
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text)
    else:
        text = text.rstrip() + "\n\n" + section
    RESULTS.write_text(text.rstrip() + "\n")
    print(f"wrote section '{title}' of {RESULTS}")
