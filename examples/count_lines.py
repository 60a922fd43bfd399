"""Lines of code of Python files, as the examples table counts them: lines that
hold code, not blank lines, comments or docstrings.

    python examples/count_lines.py examples/*/main.py
    python examples/count_lines.py path/to/reference_impl/          # every .py file below it

A line counts when some token on it is code (a string used as an expression
statement, i.e. a docstring, is not). Prints one line per file and the total.
"""

import argparse
import ast
import io
import sys
import tokenize
from pathlib import Path


def docstring_lines(source: str) -> set[int]:
    """Line numbers covered by string literals that stand alone as statements."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            lines.update(range(node.lineno, node.end_lineno + 1))
    return lines


def count(source: str) -> int:
    skip = docstring_lines(source)
    code: set[int] = set()
    ignored = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
               tokenize.ENDMARKER, tokenize.ENCODING}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in ignored:
            continue
        for line in range(tok.start[0], tok.end[0] + 1):
            if line not in skip:
                code.add(line)
    return len(code)


def python_files(paths: list[str]) -> list[Path]:
    files: list[Path] = []
    for p in map(Path, paths):
        files.extend(sorted(p.rglob("*.py")) if p.is_dir() else [p])
    return files


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="Python files or directories")
    args = parser.parse_args(argv)
    total = 0
    for path in python_files(args.paths):
        n = count(path.read_text(encoding="utf-8", errors="replace"))
        total += n
        print(f"{n:6d}  {path}")
    print(f"{total:6d}  total")
    return 0


if __name__ == "__main__":
    sys.exit(main())
