"""The pages agree with each other and say what was measured and where: one bubble formula, every
machine named by its CPU and instruction set, no sentence about how a page was written, every
exercise on a page, and output paths under logs/ in the commands quoted in the text too.

Text only: no command runs (tests/test_readme.py runs the pages' commands).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
COURSE = sorted((REPO / "docs").glob("[0-9][0-9]-*.md"))


def prose(text: str) -> str:
    """The text outside fenced code blocks (commands and program output are checked elsewhere)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def where(page: Path, text: str, index: int) -> str:
    return f"{page.relative_to(REPO)} line {text.count(chr(10), 0, index) + 1}"


# ------------------------------------------------------------------------------------ bubble ---
# The idle fraction of a pipeline stage's step: p stages, m micro-batches, v stages per rank.
BUBBLE_FORMS = {"(p - 1) / (m + p - 1)", "(p - 1) / (v m + p - 1)"}
BUBBLE = re.compile(r"\((?:p|pp|stages) *- *1\) */ *(?:\([^)]*\)|[\w.]+)")


def bubble_fractions(text: str) -> list[tuple[int, str]]:
    """Each bubble fraction with its place in the text, line breaks read as spaces."""
    flat = re.sub(r"\s*\n\s*", lambda m: " " * len(m.group()), text)  # same length, same places
    return [(m.start(), re.sub(" +", " ", m.group())) for m in BUBBLE.finditer(flat)]


def test_the_bubble_is_written_one_way_on_every_page():
    """Part 7 and part 11 once gave the bubble as (p - 1) / (m + p - 1) and as (pp - 1) / m (of the
    step, and of the useful work): every page now writes the fraction of the step, in one form."""
    found, odd = [], []
    for page in PAGES:
        text = page.read_text()
        for index, formula in bubble_fractions(text):
            found.append(page.name)
            if formula not in BUBBLE_FORMS:
                odd.append(f"{where(page, text, index)}: {formula}")
    assert not odd, "write the bubble as " + " or ".join(sorted(BUBBLE_FORMS)) + ":\n" + "\n".join(odd)
    assert {"07-pipeline-parallel.md", "11-cost-model.md"} <= set(found)


def test_the_bubble_check_finds_other_forms():
    odd = ("the bubble is (pp - 1) / m of a step, or (p - 1)/(m + p) or (stages - 1) / (m + stages - 1)"
           " or (p -\n  1) / m")
    assert [f for _, f in bubble_fractions(odd)] == ["(pp - 1) / m", "(p - 1)/(m + p)",
                                                      "(stages - 1) / (m + stages - 1)", "(p - 1) / m"]
    assert not set(f for _, f in bubble_fractions(odd)) & BUBBLE_FORMS


# ---------------------------------------------------------------------------------- machines ---
# A CPU named on a page comes with what sets its speed here: its instruction set (bf16 matmuls
# differ 11x between them), or, for Perlmutter's nodes, its model.
CPU = re.compile(r"\bEPYC\b|\bXeon\b")
NAMED = re.compile(r"AVX2|AVX-512|AMX|EPYC 7763")
BEFORE, AFTER = 12, 90  # characters around the CPU's name in which its instruction set is named


def unnamed_machines(text: str) -> list[tuple[int, str]]:
    text = prose(text)
    return [(m.start(), " ".join(text[m.start():m.start() + AFTER].split()))
            for m in CPU.finditer(text)
            if not NAMED.search(text, max(0, m.start() - BEFORE), m.start() + AFTER)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_each_cpu_is_named_with_its_instruction_set(page):
    """Three different machines were all "a 2-core AMD EPYC" on the pages (AVX2 only, AVX-512
    BF16, and an Intel Xeon with AMX), and their bf16 speeds differ 11x."""
    text = prose(page.read_text())
    bad = [f"{where(page, text, i)}: {snippet}" for i, snippet in unnamed_machines(text)]
    assert not bad, "name the instruction set beside the CPU:\n" + "\n".join(bad)


def test_a_cpu_without_its_instruction_set_is_found():
    assert len(unnamed_machines("measured on a 2-core AMD EPYC virtual machine, torch 2.13")) == 1
    assert len(unnamed_machines("on the 2-core Intel Xeon (torch 2.13.0 CPU)")) == 1
    assert not unnamed_machines("a 2-core AMD EPYC with AVX2 only, and an Intel Xeon with AMX")
    assert not unnamed_machines("Perlmutter's AMD EPYC 7763, and the AVX2 EPYC above")
    assert len(unnamed_machines("AVX-512 is fast. On a 2-core AMD EPYC it was not")) == 1
    assert not unnamed_machines("```text\nCPU AMD EPYC, 2 cores\n```\n")


# ------------------------------------------------------------------- how a page was written ---
# Pages say what was measured and where, never the story of their writing.
WRITING = ("this page was", "this task", "this session", "this work", "was lent", "lent to this",
           "earlier version", "first version", "measured again", "before this change",
           "earlier measurement", "got wrong", "while writing", "this version of", "was first written",
           "was first measured", "not yet", "so far measured", "run the same day")


def writing_phrases(text: str) -> list[tuple[int, str]]:
    low = " ".join(text.lower().split())
    return [(m.start(), phrase) for phrase in WRITING
            for m in re.finditer(rf"\b{re.escape(phrase)}\b", low)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_pages_do_not_tell_how_they_were_written(page):
    found = [phrase for _, phrase in writing_phrases(page.read_text())]
    assert not found, f"{page.name}: say what was measured and where, not how the page was made: {found}"


def test_a_sentence_about_writing_the_page_is_found():
    text = "No GPU was lent\nto this work. On the AVX-512 machine this page was first measured on, it ran."
    assert {p for _, p in writing_phrases(text)} == {"was lent", "lent to this", "this work",
                                                       "this page was", "was first measured"}
    assert not writing_phrases("the ladder measured against a bare loop; this tasks list")


# ---------------------------------------------------------------------------------- exercises ---
EXERCISE = re.compile(r"make exercise NAME=(\w+)")


def test_every_exercise_is_on_a_page_and_every_page_has_one():
    """Part 9 once had no exercise although exercises/dispatch_exercise.py existed."""
    on_pages = {}
    for page in COURSE:
        names = EXERCISE.findall(page.read_text())
        assert names, f"{page.name} has no exercise (`make exercise NAME=...`)"
        on_pages.update({name: page.name for name in names})
    files = {p.name.removesuffix("_exercise.py") for p in (REPO / "exercises").glob("*_exercise.py")}
    assert files - set(on_pages) == set(), f"exercises no page gives: {sorted(files - set(on_pages))}"
    assert set(on_pages) - files == set(), f"pages name missing exercises: {sorted(set(on_pages) - files)}"
    table = (REPO / "exercises" / "README.md").read_text()
    assert all(f"`{name}`" in table for name in files), "exercises/README.md lists every exercise"


# ------------------------------------------------------------------- commands quoted in text ---
OUT_IN_TEXT = re.compile(r"`[^`\n]*?--(?:out|out_dir|output_dir|expdir)[ =](\S+?)[`\s]")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_commands_quoted_in_the_text_write_under_logs(page):
    """A page cited its report's command with `--out pipeline` after running it with
    `--out logs/pipeline` (test_readme.py checks the commands of the ```bash blocks)."""
    text = prose(page.read_text())
    bad = [f"{where(page, text, m.start())}: {m.group()}" for m in OUT_IN_TEXT.finditer(text)
           if not m.group(1).startswith(("logs/", "data/", "$", "LOGDIR", "DIR"))]
    assert not bad, "\n".join(bad)


def test_an_output_outside_logs_in_the_text_is_found():
    text = "From `python scripts/pipeline_report.py --config tiny_deep --out pipeline` on a CPU"
    assert [m.group(1) for m in OUT_IN_TEXT.finditer(text)] == ["pipeline"]
