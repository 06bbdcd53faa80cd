"""The README and docs/ link to each other by path and anchor; a moved section must not leave a dead link."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's heading slugs of a page, and its explicit <a id="..."> anchors."""
    text = page.read_text(encoding="utf-8")
    found = set(re.findall(r'<a id="([^"]+)"', text))
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", "")).replace(" ", "-")
        found.add(slug)
    return found


def dead_links(page: Path) -> list[str]:
    dead = []
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target):  # http(s), mailto: not checked offline
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            dead.append(f"{target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            dead.append(f"{target} (no such anchor)")
    return dead


def test_every_relative_link_in_the_readme_and_docs_resolves():
    dead = {page.name: links for page in PAGES if (links := dead_links(page))}
    assert not dead


def test_the_link_check_sees_a_dead_anchor(tmp_path):
    page = tmp_path / "a.md"
    page.write_text("# Title\n\n[ok](#title) [gone](#nowhere) [file](b.md)\n")
    assert dead_links(page) == ["#nowhere (no such anchor)", "b.md (no such file)"]


def test_the_readme_stays_short():
    assert len((REPO / "README.md").read_text(encoding="utf-8").encode()) <= 15 * 1024


TEST_NAME = re.compile(r"\btest_[a-z0-9_]*[a-z0-9]\b")


def named_tests(text: str) -> set[str]:
    """The test files and test functions a page names (``test_x`` or ``test_x.py``)."""
    return set(TEST_NAME.findall(text))


def existing_tests() -> set[str]:
    """Every test module's name and every test function defined in tests/."""
    found = set()
    for module in (REPO / "tests").glob("test_*.py"):
        found.add(module.stem)
        found.update(re.findall(r"^\s*(?:async )?def (test_\w+)", module.read_text(encoding="utf-8"), re.M))
    return found


def test_every_test_a_page_names_exists():
    known = existing_tests()
    missing = {page.name: sorted(named_tests(page.read_text(encoding="utf-8")) - known) for page in PAGES}
    assert not {name: tests for name, tests in missing.items() if tests}


def test_the_test_name_check_sees_a_test_that_is_gone():
    assert named_tests("`test_docs` and `test_nowhere_at_all.py`, not tests/test_X.py") == {
        "test_docs", "test_nowhere_at_all"}
    assert "test_nowhere_at_all" not in existing_tests()
