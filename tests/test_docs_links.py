"""The docs stand alone: every relative link and every cited docs file of README.md, docs/
and benches/ exists, every #anchor names a heading of its target, and no doc cites the
steering repo's DESIGN.md or the retired DECISIONS.md (the contract lives in
docs/ARCHITECTURE.md and docs/GUIDE.md, the decisions in docs/design/)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RETIRED = ("DESIGN.md", "DECISIONS.md")

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
# A docs file named in prose or code: a path under docs/ (or design/) ending in .md or an
# image, or a bare upper-case page name (FORMAT.md). Names of bench outputs (results.md,
# incr_bytes.png) are not files of the repository.
_CITED = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*(?:docs|design)/(?:[\w.-]+/)*[\w-]+\.(?:md|png|svg)"
                    r"|[A-Z][A-Z_]+\.md)(?![\w/])")
_FENCE = re.compile(r"^\s*```")


def doc_files() -> list[Path]:
    files = [REPO / "README.md", REPO / "benches" / "README.md"]
    files += sorted((REPO / "docs").rglob("*.md"))
    files += sorted((REPO / "benches" / "results").glob("*.md"))
    return [f for f in files if f.is_file()]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    out: set[str] = set()
    fenced = False
    for line in path.read_text().splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.+)", line)):
            out.add(slug(m.group(1)))
    return out


def _resolve(doc: Path, target: str) -> Path | None:
    """The file ``target`` names from ``doc``: beside it, from the repo root or in docs/."""
    for base in (doc.parent, REPO, REPO / "docs"):
        p = (base / target).resolve()
        if p.exists():
            return p
    return None


def problems(doc: Path, text: str | None = None) -> list[str]:
    """What is wrong with the links and citations of ``doc`` (its text, or ``text``)."""
    found: list[str] = []
    body = doc.read_text() if text is None else text
    for n, line in enumerate(body.splitlines(), 1):
        where = f"{doc.relative_to(REPO)}:{n}"
        for name in RETIRED:
            if re.search(rf"(?<![\w-]){re.escape(name)}", line):
                found.append(f"{where}: cites {name}")
        for target in _LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, mailto:, ...
                continue
            path_part, _, anchor = target.partition("#")
            dest = doc if not path_part else (doc.parent / path_part).resolve()
            if not dest.exists():
                found.append(f"{where}: link to missing {target}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                found.append(f"{where}: no heading #{anchor} in {dest.relative_to(REPO)}")
        for cited in _CITED.findall(_LINK.sub("", line)):
            if Path(cited).name in RETIRED or "*" in cited:
                continue
            if _resolve(doc, cited) is None:
                found.append(f"{where}: cites missing {cited}")
    return found


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_and_cited_file_exists(doc):
    assert problems(doc) == []


def test_the_docs_are_found():
    names = {str(p.relative_to(REPO)) for p in doc_files()}
    assert {"README.md", "docs/ARCHITECTURE.md", "docs/GUIDE.md", "docs/PERFORMANCE.md",
            "docs/design/README.md"} <= names
    assert not (REPO / "docs" / "DECISIONS.md").exists()


def test_the_performance_page_stays_short_and_shows_its_plots():
    text = (REPO / "docs" / "PERFORMANCE.md").read_text()
    assert len(text.splitlines()) < 250
    for png in ("longrun.png", "restore.png", "scaling.png"):
        assert f"]({png})" in text and (REPO / "docs" / png).read_bytes()[:4] == b"\x89PNG"


def test_the_checker_fails_on_a_probe():
    doc = REPO / "docs" / "ARCHITECTURE.md"
    probe = "\n".join([
        "See [the spec](NOPE.md) and [a part](GUIDE.md#no-such-heading).",
        "The contract is DESIGN.md, the history docs/DECISIONS.md.",
        "Details in docs/MISSING.md; the plot docs/absent.png.",
        "Fine: [guide](GUIDE.md#the-api-contract), FORMAT.md, [web](https://example.com).",
        "```", "# not a heading", "```",
    ])
    got = problems(doc, probe)
    assert got == [
        "docs/ARCHITECTURE.md:1: link to missing NOPE.md",
        "docs/ARCHITECTURE.md:1: no heading #no-such-heading in docs/GUIDE.md",
        "docs/ARCHITECTURE.md:2: cites DESIGN.md",
        "docs/ARCHITECTURE.md:2: cites DECISIONS.md",
        "docs/ARCHITECTURE.md:3: cites missing docs/MISSING.md",
        "docs/ARCHITECTURE.md:3: cites missing docs/absent.png",
    ]
    assert slug("Many ranks: the distributed store") == "many-ranks-the-distributed-store"
    assert slug("`put_tables`, in short") == "put_tables-in-short"


def _code_citations(text: str) -> list[int]:
    return [n for n, line in enumerate(text.splitlines(), 1)
            if re.search(r"\bDESIGN(\.md)?\b|DECISIONS\.md", line)]


def test_no_code_cites_the_retired_contract():
    # Docstrings and comments cite the contract too; they must name where it lives now.
    own = Path(__file__).resolve()
    found = [f"{p.relative_to(REPO)}:{n}"
             for folder in ("cnrstore", "engine", "benches", "tests", "fuzz", "scripts")
             for p in sorted((REPO / folder).rglob("*.py")) if p.resolve() != own
             for n in _code_citations(p.read_text())]
    assert not found, f"cite docs/ARCHITECTURE.md or docs/GUIDE.md instead: {found}"


def test_the_code_check_sees_a_citation():
    assert _code_citations('"""The handle (DESIGN.md, "Public API")."""\nx = 1  # DESIGN\n') \
        == [1, 2]
    assert _code_citations('"""docs/design/put-speed.md"""') == []
