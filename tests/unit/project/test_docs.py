"""The documentation a newcomer reads: a short README, every relative link and every named file resolving, every
``make`` target the docs name existing in the Makefile (issue 25, item 4)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "tests" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOCS += sorted((ROOT / "k8s").rglob("*.md"))
TOP = ("dags/", "operators/", "pipeline_steps/", "k8s/", "tests/", "scripts/", "benchmarks/", "docs/")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_the_readme_is_short_and_links_the_rest():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 160
    for page in (ROOT / "docs").glob("*.md"):
        assert f"(docs/{page.name})" in readme, f"docs/{page.name} is linked from no README table"


def test_every_relative_link_resolves():
    broken = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
            elif anchor and dest.suffix == ".md":
                anchors = {_slug(h) for h in re.findall(r"^#+ (.+)$", dest.read_text(), re.M)}
                if anchor not in anchors:
                    broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken


def test_every_named_repository_path_exists():
    """A path of this repository in backticks (``pipeline_steps/x.py``) names a file or folder that exists."""
    stale, checked = [], 0
    for doc in DOCS:
        for ref in re.findall(r"`([^`\s]+)`", doc.read_text()):
            path = ref.split("::")[0].rstrip(".,:;")
            if not path.startswith(TOP) or re.search(r"[<>*{}$]|\.\.\.", path):
                continue
            checked += 1
            if not (ROOT / path).exists():
                stale.append(f"{doc.relative_to(ROOT)}: {ref}")
    assert checked > 50, checked  # the pattern finds the paths the docs name
    assert not stale, stale


def test_every_make_target_named_exists():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*):", makefile, re.M))
    named = set()
    for doc in DOCS:
        named |= set(re.findall(r"(?:`|^|\$ )make ([a-z][\w-]*)", doc.read_text(), re.M))
    assert named, "the docs name no make target: the pattern is wrong"
    assert named <= targets, f"named in the docs but not in the Makefile: {sorted(named - targets)}"
