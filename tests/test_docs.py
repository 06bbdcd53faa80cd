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


def test_the_idle_worker_cost_example_adds_up_for_the_default_machine():
    """operations.md's worked example: each row's quantity times its price, the rows' sum, and the month; the
    machine's shape is the default MACHINE_TYPE's (8 vCPUs, 32 GB on a g2-standard-8, which comes with one L4)."""
    import re
    from decimal import Decimal

    from pipeline.contract.parameters import DEFAULT_DISK_SIZE_GB
    from pipeline.serving.gpus import FIXED_SHAPES

    text = (REPO / "docs" / "operations.md").read_text()
    section = text[text.index('<a id="idle-worker-cost"></a>'):]
    rows = re.findall(r"^\| ([^|*]+?) \| (\d+) \| ([\d.]+) per [^|]+ \| ([\d.]+) \|$", section, re.MULTILINE)
    assert [name for name, *_ in rows] == ["Streaming worker vCPU", "Streaming worker memory", "GPU (`nvidia-l4`)",
                                           "Boot disk (standard persistent disk)"]
    for _, quantity, price, per_hour in rows:
        assert (Decimal(quantity) * Decimal(price)).quantize(Decimal("0.0001")) == Decimal(per_hour), (quantity, price)
    total = Decimal(re.search(r"\*\*One idle worker\*\* \| \| \| \*\*([\d.]+)\*\*", section).group(1))
    month = Decimal(re.search(r"\*\*A 730-hour month of it\*\* \| \| \| \*\*([\d.]+)\*\*", section).group(1))
    exact = sum(Decimal(q) * Decimal(p) for _, q, p, _ in rows)
    assert exact.quantize(Decimal("0.0001")) == total
    assert (exact * 730).quantize(Decimal("0.01")) == month
    makefile = (REPO / "Makefile").read_text()
    machine = re.search(r"^MACHINE_TYPE \?= (\S+)", makefile, re.MULTILINE).group(1)
    assert machine == "g2-standard-8" and FIXED_SHAPES[machine] == ("nvidia-l4", 1)
    assert [int(q) for _, q, _, _ in rows] == [8, 32, 1, DEFAULT_DISK_SIZE_GB]


def numbered_targets(makefile: str) -> dict[str, int]:
    """Targets whose `make help` line starts with a deploy step number: target -> step."""
    return {target: int(step) for target, step in re.findall(r"^([a-z-]+):.*?## (\d+)\. ", makefile, re.MULTILINE)}


def readme_steps(readme: str) -> dict[int, str]:
    """The README's numbered deploy steps: number -> the step's text."""
    section = readme.split("## Deploy on Dataflow", 1)[1].split("\n## ", 1)[0]
    return {int(n): text for n, text in re.findall(r"^(\d+)\. (.*?)(?=^\d+\. |^\*\*|\Z)", section, re.M | re.S)}


def test_make_help_numbers_each_deploy_step_as_the_readme_does():
    """`make help` and the README's deploy steps name the same step by the same number."""
    targets = numbered_targets((REPO / "Makefile").read_text())
    steps = readme_steps((REPO / "README.md").read_text())
    assert {"setup", "image", "template", "run"} <= set(targets)
    wrong = {target: step for target, step in targets.items() if f"make {target}" not in steps.get(step, "")}
    assert not wrong, f"make help numbers these as README steps that do not name them: {wrong}"


def test_the_step_number_check_sees_a_step_out_of_place():
    steps = readme_steps("## Deploy on Dataflow\n\n1. **Project.** `make setup`.\n2. **Run.** `make run`.\n")
    targets = numbered_targets("setup: ## 2. Make a project ready\nrun: ## 2. Launch\n")
    assert [t for t, n in targets.items() if f"make {t}" not in steps.get(n, "")] == ["setup"]
