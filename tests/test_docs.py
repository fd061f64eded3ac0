"""The README stays a short front door to docs/, and no link in README.md or docs/*.md is broken."""

import re
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCUMENTS = [README, *sorted((ROOT / "docs").glob("*.md"))]
MAX_README_LINES = 200
FIRST_COMMANDS = ["bash scripts/setup.sh && .venv/bin/hf-spec-cotrain grpo", "bash scripts/test.sh"]

FENCED_BLOCK = re.compile(r"^```.*?^```", flags=re.DOTALL | re.MULTILINE)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", flags=re.IGNORECASE)  # http:, https:, mailto:, ...


def _links(document: Path) -> list[str]:
    """Link targets of a Markdown file, outside code blocks (where `[x](y)` is code, not a link)."""
    return LINK.findall(FENCED_BLOCK.sub("", document.read_text(encoding="utf-8")))


def _anchors(document: Path) -> set[str]:
    """GitHub's anchors for the headings of a Markdown file."""
    text = FENCED_BLOCK.sub("", document.read_text(encoding="utf-8"))
    headings = re.findall(r"^#+\s+(.*?)\s*$", text, flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def test_readme_is_at_most_200_lines():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; move details to docs/"


def test_readme_first_commands_set_up_and_run_the_main_job_then_the_tests():
    (first_block, *_) = re.findall(r"^```bash\n(.*?)^```", README.read_text(encoding="utf-8"), flags=re.S | re.M)
    commands = [line for line in first_block.splitlines() if line.strip() and not line.startswith("#")]
    assert commands == FIRST_COMMANDS
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")  # CI runs the README's tests


def test_every_relative_link_points_to_an_existing_file():
    broken = []
    for document in DOCUMENTS:
        for target in _links(document):
            if EXTERNAL.match(target):
                continue
            path, _, anchor = target.partition("#")
            linked = (document.parent / path).resolve() if path else document
            if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in _anchors(linked)):
                broken.append(f"{document.relative_to(ROOT)}: {target}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_readme_links_every_file_in_docs():
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in _links(README)}
    documents = [path for path in (ROOT / "docs").iterdir() if path.is_file()]
    assert documents
    unlinked = [path.name for path in documents if path.resolve() not in linked]
    assert not unlinked, f"docs/ files missing from the README's index: {unlinked}"


def test_every_test_file_the_docs_name_exists():
    """Docs cite tests by path (`tests/generation/test_weight_transactions.py::...`): a moved test must take its citations."""
    named = {path for document in DOCUMENTS for path in re.findall(r"tests/[\w/]+\.py", document.read_text("utf-8"))}
    assert named
    missing = sorted(path for path in named if not (ROOT / path).is_file())
    assert not missing, f"docs name test files that do not exist: {missing}"
