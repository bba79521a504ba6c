"""The length of every page of the course, against its budget, and the commands of its pages.

    python scripts/page_stats.py        # the table; exit status 1 when a budget is exceeded

Lengths are counted as `wc -c` counts them (bytes of the file). The budgets: README.md and each
course page (docs/01-*.md ... docs/13-*.md) at most 14,000, README.md and the 13 pages together
at most 150,000, docs/tests.md at most 15,000, docs/terms.md (the glossary) at most 10,000 and
docs/gpu-check.md at most 14,000. tests/test_pages.py runs the same check. `readme_commands`
reads a page's shell commands as a learner types them (the course walk, tests/test_readme.py, and
scripts/course_day.py run them).
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGE_LIMIT = 14_000
COURSE_LIMIT = 150_000  # README.md and the 13 course pages together
OTHER_LIMITS = {"docs/tests.md": 15_000, "docs/terms.md": 10_000, "docs/gpu-check.md": PAGE_LIMIT}


def course_files(repo: Path = REPO) -> list[Path]:
    """README.md and the numbered pages, in their order."""
    return [repo / "README.md", *sorted((repo / "docs").glob("[0-9][0-9]-*.md"))]


def page_sizes(repo: Path = REPO) -> dict[str, int]:
    """Each page's length (bytes, as `wc -c`), keyed by its path from the repository's top."""
    files = course_files(repo) + [repo / name for name in OTHER_LIMITS]
    return {f.relative_to(repo).as_posix(): len(f.read_bytes()) for f in files if f.is_file()}


def over_budget(sizes: dict[str, int]) -> list[str]:
    """One line for each budget exceeded; empty when every page fits."""
    problems = []
    course = {name: n for name, n in sizes.items() if name not in OTHER_LIMITS}
    for name, n in sizes.items():
        limit = OTHER_LIMITS.get(name, PAGE_LIMIT)
        if n > limit:
            problems.append(f"{name}: {n:,} characters, over its {limit:,}")
    total = sum(course.values())
    if total > COURSE_LIMIT:
        problems.append(f"README.md and the course pages: {total:,} characters, over {COURSE_LIMIT:,}")
    return problems


@dataclass(frozen=True)
class Command:
    line: int  # line of its page where the command starts
    text: str
    page: str = "README.md"

    @property
    def where(self) -> str:
        return f"{self.page} line {self.line}"

    @property
    def env_and_words(self) -> tuple[dict[str, str], list[str]]:
        words = shlex.split(self.text)
        env = {}
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
            key, value = words.pop(0).split("=", 1)
            env[key] = value
        return env, words


def readme_commands(text: str | None = None, page: str = "README.md") -> list[Command]:
    """Commands of a page's ```bash blocks, with continuation lines joined."""
    text = (REPO / "README.md").read_text() if text is None else text
    commands: list[Command] = []
    in_bash, pending, start = False, "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("```"):
            in_bash = not in_bash and stripped in ("```bash", "```sh", "```shell")
            continue
        if not in_bash:
            continue
        line = raw[: _comment_start(raw)].rstrip()
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = " ".join((pending + line).split())
        pending = ""
        if full:
            commands.append(Command(start, full, page))
    return commands


def _comment_start(line: str) -> int:
    """Index of a shell comment's '#' outside quotes (len(line) if none)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return i
    return len(line)


def report(sizes: dict[str, int]) -> str:
    lines = [f"{'page':<34} {'characters':>10} {'budget':>8}"]
    for name, n in sizes.items():
        lines.append(f"{name:<34} {n:>10,} {OTHER_LIMITS.get(name, PAGE_LIMIT):>8,}")
    total = sum(n for name, n in sizes.items() if name not in OTHER_LIMITS)
    lines.append(f"{'README.md + course pages':<34} {total:>10,} {COURSE_LIMIT:>8,}")
    return "\n".join(lines)


def main() -> int:
    sizes = page_sizes()
    print(report(sizes))
    problems = over_budget(sizes)
    for problem in problems:
        print(f"over budget: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
