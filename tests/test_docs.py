"""The front door stays a front door (issue 38): README.md fits in 250 lines, every relative link of
the documentation resolves inside the repository, and the benchmark map (benchmarks/README.md)
names scripts and reports that exist. Read from the files at test time, so a moved file or an
edited page is what is checked."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250


def _pages() -> list[Path]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
             *sorted((ROOT / "benchmarks").glob("*.md")),
             *sorted((ROOT / "benchmarks" / "findings").glob("*.md"))]
    return [p for p in pages if p.exists()]


def _prose(text: str) -> str:
    """The text outside fenced code blocks (a link inside a code block is code, not a link)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _links(text: str) -> list[str]:
    # [text](target) and ![alt](target); the target ends at the first space or ')'
    return re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", _prose(text))


def _expand(pattern: str) -> list[str]:
    """Shell brace expansion: ``a_{x,y}.{json,png}`` -> four names."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [e for alt in m.group(1).split(",")
            for e in _expand(pattern[:m.start()] + alt + pattern[m.end():])]


def test_readme_fits_the_cap():
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (cap {README_MAX_LINES}): move reference " \
                                  "material to docs/"


def test_pages_exist():
    names = {p.relative_to(ROOT).as_posix() for p in _pages()}
    for need in ("docs/sampling.md", "docs/kv-cache.md", "docs/serving.md", "docs/scaling.md",
                 "docs/architecture.md", "docs/contributing.md", "benchmarks/FINDINGS.md"):
        assert need in names, need


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces -> '-'."""
    heads = re.findall(r"^#+\s+(.*)$", _prose(page.read_text(encoding="utf-8")), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve_inside_the_repository(page: Path):
    bad = []
    for target in _links(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue                                   # http(s), mailto: not files
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        if not path.is_relative_to(ROOT):
            bad.append(f"{target} (outside the repository)")
        elif not path.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            bad.append(f"{target} (no such heading)")
    assert not bad, f"{page.relative_to(ROOT)}: {bad}"


def test_readme_tables_have_no_paragraph_cells():
    """A README table cell is a name or a phrase; anything longer belongs in docs/."""
    for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            for cell in line.strip().strip("|").split("|"):
                assert len(cell.strip()) <= 90, f"README.md table cell is a paragraph: {cell!r}"


def _benchmark_rows() -> list[list[str]]:
    text = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    body = text.split("## Figures by topic", 1)[1].split("\n## ", 1)[0]
    return [[c.strip() for c in line.strip().strip("|").split(" | ")]
            for line in body.splitlines()
            if line.startswith("| ") and not line.startswith("| figure")]


def test_benchmark_map_reports_exist():
    rows = _benchmark_rows()
    assert len(rows) > 50, len(rows)
    missing = []
    for row in rows:
        report = row[-1]
        for token in re.findall(r"`([^`]+)`", report):
            if token.startswith("."):                  # `.png` next to the report before it
                continue
            base = ROOT if token.split("/", 1)[0] in ("checkpoints", "flash_dllm") \
                else ROOT / "benchmarks" / "results"
            missing += [n for n in _expand(token) if not (base / n).exists()]
    assert not missing, missing


def test_benchmark_commands_name_existing_scripts_and_folders():
    """Every script a command runs exists, and every report path it writes lands in an existing
    topic folder (the file itself may be a placeholder such as ``eval_S_D_...``)."""
    text = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    text += (ROOT / "benchmarks" / "run_gpu.sh").read_text(encoding="utf-8")
    scripts = set(re.findall(r"\b(benchmarks/[\w./-]+\.(?:py|sh))\b", text))
    assert len(scripts) > 15, scripts
    assert [s for s in sorted(scripts) if not (ROOT / s).exists()] == []
    outputs = set(re.findall(r"\b(benchmarks/results/[\w./{},-]+)", text))
    assert outputs
    assert [o for o in sorted(outputs) if not (ROOT / o).parent.is_dir()] == []


def test_every_script_is_in_a_topic_folder():
    top = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py"))
    assert top == [], f"scripts at the top of benchmarks/ (put them in a topic folder): {top}"
