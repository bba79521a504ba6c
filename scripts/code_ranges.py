#!/usr/bin/env python
"""Keep the course pages' code references in step with the code.

A page points at code as "`training/trainer.py` lines 118-180 (`train_step`, `train_epoch`)".
This script finds every such reference in README.md and docs/*.md, computes the lines the
named functions and classes span now, and reports (or with --fix rewrites) the ranges
that moved. tests/test_readme.py fails while a range does not hold its names.

    python scripts/code_ranges.py          # list the references that moved
    python scripts/code_ranges.py --fix    # rewrite them in place
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CODE_RANGE = re.compile(r"`([\w/]+\.py)`\s+lines\s+(\d+)-(\d+)(?:\s+\(([^)]*)\))?")


def span(path: Path, names: list[str]) -> tuple[int, int] | None:
    """First and last line of the named top-level or nested functions and classes (decorators
    included), or None when one of them is not defined in ``path``."""
    found: dict[str, tuple[int, int]] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name in names:
            start = min([d.lineno for d in node.decorator_list] + [node.lineno])
            found.setdefault(node.name, (start, node.end_lineno or node.lineno))
    if not names or set(names) - set(found):
        return None
    return min(a for a, _ in found.values()), max(b for _, b in found.values())


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def refresh(text: str) -> tuple[str, list[str]]:
    """The page with every named reference's range recomputed, and what moved."""
    moved = []

    def fix(m: re.Match) -> str:
        path, start, end, names = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
        wanted = re.findall(r"`(\w+)`", names or "")
        now = span(REPO / path, wanted) if (REPO / path).is_file() else None
        if now is None or now == (start, end):
            return m.group(0)
        moved.append(f"{path} lines {start}-{end} -> {now[0]}-{now[1]} ({', '.join(wanted)})")
        # the numbers replaced where the match has them ("lines" and the range may be a line apart)
        begin, stop = m.start(2) - m.start(0), m.end(3) - m.start(0)
        return m.group(0)[:begin] + f"{now[0]}-{now[1]}" + m.group(0)[stop:]

    return CODE_RANGE.sub(fix, text), moved


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fix", action="store_true", help="rewrite the ranges that moved")
    args = p.parse_args()
    total = 0
    for page in pages():
        text, moved = refresh(page.read_text())
        for line in moved:
            print(f"{page.relative_to(REPO)}: {line}")
        total += len(moved)
        if moved and args.fix:
            page.write_text(text)
    if total and not args.fix:
        print("run with --fix to rewrite them")
    return 1 if total and not args.fix else 0


if __name__ == "__main__":
    sys.exit(main())
