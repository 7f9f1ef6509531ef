"""The README and docs/ hold together: the README's figures are those of
docs/results.md, every relative link and anchor resolves, the pages keep
to their length budgets, and no page narrates run history."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
RESULTS = DOCS / "results.md"

MECHANISM_PAGES = ["placement.md", "partial_rollout.md", "speculative.md", "multi_turn.md"]
README_MAX_LINES = 150
DOCS_MAX_LINES = 3000

# A figure as the results table writes it: 2.14x, 2.14-2.15x, 0.675-0.676, 95.4%, 1,024.
FIGURE = re.compile(r"(?<![\w.])\d+(?:,\d{3})*(?:\.\d+)?(?:-\d+(?:,\d{3})*(?:\.\d+)?)?(?:x|%)?(?!\w|\.\d)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
ORDINALS = ("second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
            "fourteenth|fifteenth|sixteenth|\\d+(?:st|nd|rd|th)|earlier|previous|prior|former|last|latest")
HISTORY = re.compile(rf"\b(?:(?:{ORDINALS})\s+runs?\b|not\s+(?:yet\s+)?confirmed\b)", re.IGNORECASE)


def markdown_pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def prose(text: str) -> str:
    """The text without fenced code blocks (links and headings there are not markdown)."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            out.append("")
            continue
        out.append("" if fenced else line)
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lower-cased, punctuation other
    than '-' and '_' dropped, spaces turned into '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a markdown file, with GitHub's -1, -2 for repeats."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in prose(path.read_text()).splitlines():
        m = re.match(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def relative_links(path: Path) -> list[str]:
    text = re.sub(r"`[^`\n]*`", "", prose(path.read_text()))  # inline code is not a link
    return [t for t in LINK.findall(text) if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.IGNORECASE)]


def broken_links(path: Path) -> list[str]:
    """The relative links of a page whose file or anchor does not exist."""
    broken = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    return broken


def results_table(readme: str) -> list[dict[str, str]]:
    """The rows of the README's results-at-a-glance table, as {column: cell}."""
    lines = readme.splitlines()
    start = next((i for i, line in enumerate(lines)
                  if line.startswith("#") and "at a glance" in line.lower()), None)
    assert start is not None, "the README has no 'results at a glance' heading"
    table = []
    for line in lines[start + 1:]:
        if line.startswith("#"):
            break
        if line.startswith("|"):
            table.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif table:
            break
    assert len(table) > 2, "the README's results at a glance have no table"
    header, rows = [c.lower() for c in table[0]], table[2:]
    return [dict(zip(header, row)) for row in rows]


def test_every_figure_of_the_readme_results_table_is_in_results_md():
    rows = results_table(README.read_text())
    results = RESULTS.read_text()
    missing = []
    for row in rows:
        assert "figure" in row, f"the README's results table has no 'figure' column: {list(row)}"
        figures = FIGURE.findall(row["figure"])
        assert figures, f"a row of the README's results table states no figure: {row['figure']!r}"
        missing += [f for f in figures if not re.search(rf"(?<![\w.]){re.escape(f)}(?!\d|\.\d)", results)]
    assert not missing, f"figures in the README's results table that docs/results.md does not state: {missing}"


def test_every_readme_result_links_to_its_section_of_results_md():
    for row in results_table(README.read_text()):
        links = [t for t in LINK.findall(" ".join(row.values())) if "results.md#" in t]
        assert links, f"a row of the README's results table links to no section of docs/results.md: {row}"


@pytest.mark.parametrize("name", MECHANISM_PAGES)
def test_a_mechanism_page_takes_its_results_table_from_results_md(name: str):
    """The first table under a mechanism page's `## Results` is rows of docs/results.md, verbatim."""
    lines = (DOCS / name).read_text().splitlines()
    assert "## Results" in lines, f"docs/{name} has no '## Results' section"
    start = lines.index("## Results")
    section = lines[start + 1:next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))]
    first = next((i for i, line in enumerate(section) if line.startswith("|")), None)
    assert first is not None, f"docs/{name} has no results table under '## Results'"
    rows = []
    for line in section[first:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    results = set(RESULTS.read_text().splitlines())
    assert not [r for r in rows if r not in results], \
        f"rows of docs/{name}'s results table that docs/results.md does not hold: {[r for r in rows if r not in results]}"


@pytest.mark.parametrize("page", markdown_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page: Path):
    broken = broken_links(page)
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("heading, anchor", [
    ("The wire contract (rollout.v1)", "the-wire-contract-rolloutv1"),
    ("The trainer side: `StepRollout`", "the-trainer-side-steprollout"),
    ("Padded targets: `build-model`", "padded-targets-build-model"),
    ("What-if", "what-if"),
])
def test_anchors_follow_githubs_slug_rules(heading: str, anchor: str):
    assert slug(heading) == anchor


def test_readme_and_docs_keep_to_their_length():
    readme = len(README.read_text().splitlines())
    docs = {p.relative_to(ROOT): len(p.read_text().splitlines()) for p in DOCS.rglob("*.md")}
    assert readme <= README_MAX_LINES, f"README.md has {readme} lines, at most {README_MAX_LINES}"
    assert sum(docs.values()) <= DOCS_MAX_LINES, f"docs/ has {sum(docs.values())} lines, at most {DOCS_MAX_LINES}: {docs}"


@pytest.mark.parametrize("page", markdown_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_narrates_run_history(page: Path):
    found = [(n, m.group(0)) for n, line in enumerate(page.read_text().splitlines(), 1)
             for m in HISTORY.finditer(line)]
    assert not found, f"{page.relative_to(ROOT)} names results by the order of runs: {found}"
