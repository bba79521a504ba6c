"""Every term of the course is explained before it is used: the glossary docs/terms.md holds the
terms (one `## term` heading each), and at a term's first use in reading order (README.md, then
the pages in the order of the README's table) the page either links it (`[DDP](terms.md#ddp)`,
or a link to the part that teaches it) or defines it there in bold (`**DDP**
(DistributedDataParallel) keeps ...`).

A use is the term in the prose: fenced code blocks, headings, link targets, images and inline
code are not read, except an inline code span that is the term itself (`torch.compile`). A use
is a whole word, a plural included (ranks, micro-batches). Words with a capital after their first
letter or a digit (DDP, NCCL, bf16, ZeRO-1, GPipe) match in their case only, so "AVX-512 BF16"
is not bf16; other words in any case. A term's short forms (tp for tensor parallelism, MoE for
mixture of experts) are uses of it. Text only: no command runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import REPO

README = REPO / "README.md"
GLOSSARY = REPO / "docs" / "terms.md"
MIN_TERMS = 40
ALIASES = {  # short and other forms of a term, matched in their case
    "tensor parallelism": ("tp",), "context parallelism": ("cp",), "sequence parallelism": ("sp",),
    "pipeline parallelism": ("pp",), "data parallelism": ("dp",), "expert parallelism": ("ep",),
    "mixture of experts": ("MoE",), "DDP": ("DistributedDataParallel",), "FSDP": ("FSDP2",),
    "ZeRO-1": ("ZeRO stage 1",), "bf16": ("bfloat16",), "CUDA Graphs": ("CUDA Graph", "CUDA graph"),
    "micro-batch": ("microbatch",),
}


def reading_order() -> list[Path]:
    """README.md, then the course pages (docs/NN-*.md) in the order the README links them (the
    rule of tests/test_readme.py's course_pages, without the pages outside the course)."""
    linked = []
    for name in re.findall(r"\]\((docs/\d\d-[\w.-]+\.md)\)", README.read_text()):
        if REPO / name not in linked:
            linked.append(REPO / name)
    rest = [p for p in sorted((REPO / "docs").glob("[0-9][0-9]-*.md")) if p not in linked]
    return [README, *linked, *rest]


def glossary_terms(text: str) -> list[str]:
    return re.findall(r"^## (.+?)\s*$", text, re.M)


def word_pattern(word: str, exact: bool) -> str:
    if exact or re.search(r"\d|.[A-Z]", word):
        return re.escape(word)
    return f"(?i:{re.escape(word)})"


def term_pattern(term: str, exact: bool = False) -> re.Pattern:
    """The term as a whole word (plurals too), words apart by any white space."""
    words = r"\s+".join(word_pattern(w, exact) for w in term.split())
    return re.compile(rf"(?<![\w-])(?:{words})(?:s|es)?(?![\w])")


def patterns(term: str) -> list[re.Pattern]:
    return [term_pattern(term)] + [term_pattern(alias, exact=True) for alias in ALIASES.get(term, ())]


def blank(text: str, start: int, end: int) -> str:
    """``text`` with [start, end) replaced by spaces, line breaks kept (places stay the same)."""
    return text[:start] + re.sub(r"[^\n]", " ", text[start:end]) + text[end:]


FENCE = re.compile(r"^[ \t]*```.*?^[ \t]*```[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]+(?:\n[^`\n]+)?`")
HEADING = re.compile(r"^#{1,6} .*$", re.M)
IMAGE = re.compile(r"!\[[^\]]*\]\([^)]*\)")
LINK = re.compile(r"\[((?:[^\[\]\n]|\n(?!\n))+)\]\(([^)\s]+)\)")
BOLD = re.compile(r"\*\*(?=\S)((?:[^*\n]|\n(?!\n)|\*(?!\*))+?)\*\*")
COMMENT = re.compile(r"<!--.*?-->", re.S)


@dataclass
class Prose:
    """A page read as prose: ``text`` with everything that is not prose blanked, the inline
    code spans (start, end, content) and the places that explain (link texts, bold)."""

    text: str
    spans: list[tuple[int, int, str]]
    explained: list[tuple[int, int]]

    @classmethod
    def of(cls, text: str) -> Prose:
        for rule in (FENCE, COMMENT, HEADING, IMAGE):
            for m in list(rule.finditer(text)):
                text = blank(text, m.start(), m.end())
        spans = [(m.start(), m.end(), m.group()[1:-1].strip()) for m in CODE_SPAN.finditer(text)]
        explained = [m.span(1) for m in LINK.finditer(text)] + [m.span(1) for m in BOLD.finditer(text)]
        for m in list(LINK.finditer(text)):
            text = blank(text, *m.span(2))
        for start, end, _ in spans:
            text = blank(text, start, end)
        return cls(text, spans, explained)

    def first_use(self, term: str) -> int | None:
        found = [m.start() for p in patterns(term) for m in p.finditer(self.text)]
        found += [start for start, _, code in self.spans if any(p.fullmatch(code) for p in patterns(term))]
        return min(found, default=None)

    def is_explained(self, index: int) -> bool:
        return any(start <= index < end for start, end in self.explained)


def unexplained_first_uses(terms: list[str], pages: list[tuple[str, str]]) -> list[str]:
    """For each term, its first use in ``pages`` (name, text) read in order, when that use is
    neither linked nor bold: 'term: page line N: ...'."""
    read = [(name, text, Prose.of(text)) for name, text in pages]
    problems = []
    for term in terms:
        for name, text, prose in read:
            index = prose.first_use(term)
            if index is None:
                continue
            if not prose.is_explained(index):
                line = text.count("\n", 0, index) + 1
                context = " ".join(text[max(0, index - 40):index + 50].split())
                problems.append(f"{term}: {name} line {line}: ...{context}...")
            break
    return problems


def test_the_glossary_holds_the_course_terms():
    terms = glossary_terms(GLOSSARY.read_text())
    assert len(terms) >= MIN_TERMS, f"docs/terms.md has {len(terms)} terms (## headings), not {MIN_TERMS}"
    assert len(set(terms)) == len(terms), "a term is in docs/terms.md twice"
    assert set(ALIASES) <= set(terms), f"short forms of terms the glossary lacks: {set(ALIASES) - set(terms)}"


def test_each_term_links_to_the_page_that_teaches_it():
    sections = re.split(r"^## ", GLOSSARY.read_text(), flags=re.M)[1:]
    unlinked = [s.splitlines()[0] for s in sections if not re.search(r"\]\((?:\d\d-[\w-]+|tests)\.md\)", s)]
    assert not unlinked, f"docs/terms.md: link each term to the part that teaches it: {unlinked}"


def test_every_term_is_explained_at_its_first_use():
    terms = glossary_terms(GLOSSARY.read_text())
    pages = [(p.relative_to(REPO).as_posix(), p.read_text()) for p in reading_order()]
    assert [name for name, _ in pages][:2] == ["README.md", "docs/01-single-device.md"] and len(pages) == 14
    problems = unexplained_first_uses(terms, pages)
    assert not problems, ("link the term to docs/terms.md (or the part that teaches it), or define it there "
                          "in bold, at its first use:\n" + "\n".join(problems))


def test_the_check_finds_an_unexplained_first_use():
    pages = [("a.md", "## DDP\n\n```bash\ntorchrun x\n```\nWe wrap the model in DDP's wrapper.\n"),
             ("b.md", "[DDP](terms.md#ddp) and **torchrun** (the launcher).\n")]
    found = unexplained_first_uses(["DDP", "torchrun"], pages)
    assert [p.split(":")[:2] for p in found] == [["DDP", " a.md line 6"]]
    # short forms, plurals and cases count; link targets, images and other code do not
    assert unexplained_first_uses(["tensor parallelism"], [("a.md", "tp x dp on 4 ranks")])
    assert unexplained_first_uses(["rank"], [("a.md", "Two Ranks meet")])
    assert unexplained_first_uses(["micro-batch"], [("a.md", "m micro-batches")])
    assert unexplained_first_uses(["torch.compile"], [("a.md", "with `torch.compile` on")])
    assert not unexplained_first_uses(["rank"], [("a.md", "[page](terms.md#rank) ![rank](img/rank.png) "
                                                           "`--rank 2` ranking cranks")])
    assert not unexplained_first_uses(["bf16", "NCCL", "tensor parallelism"],
                                      [("a.md", "AVX-512 BF16, nccl_plugin, http://x and tensor-parallel")])


def test_the_check_accepts_a_link_or_a_bold_definition():
    pages = [("a.md", "A [process group](terms.md#process-group), **DDP** (DistributedDataParallel),\n"
                      "[`torch.compile`](terms.md#torchcompile), a **mixture of\nexperts** (MoE) and "
                      "[tp](05-model-parallel.md).\n"),
             ("b.md", "Then DDP, MoE, torch.compile and a process group without links.\n")]
    terms = ["process group", "DDP", "torch.compile", "mixture of experts", "tensor parallelism"]
    assert unexplained_first_uses(terms, pages) == []
