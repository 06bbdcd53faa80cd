"""The layout shows the architecture: ``pipeline/`` is what a worker runs, and nothing local is in it.

The worker image copies ``pipeline/`` and ``template/`` only (container/Dockerfile), so a pipeline module
that imported local code (DirectRunner patches, the embedded model, the docs generator, benchmarks or
tests) would either fail on a worker or ship local-only behaviour to it. Lazy imports inside functions
count too: they run on the worker when called.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LOCAL_ONLY = ("local", "benchmarks", "tests", "template")


def imports(path: Path) -> set[str]:
    """Every module a file imports, at module level or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            if node.module == "pipeline":  # from pipeline import x
                found.update(f"pipeline.{alias.name}" for alias in node.names)
    return found


def pipeline_modules() -> dict[str, set[str]]:
    return {f"pipeline.{path.stem}": imports(path) for path in sorted((REPO / "pipeline").glob("*.py"))}


def test_no_pipeline_module_imports_local_only_code():
    offending = {module: sorted(name for name in names if name.split(".")[0] in LOCAL_ONLY)
                 for module, names in pipeline_modules().items()}
    assert not {module: names for module, names in offending.items() if names}


def first_cycle(graph: dict[str, list[str]]) -> list[str] | None:
    """A cycle in an import graph, if any: depth-first, each module searched once (linear in the graph)."""
    done: set[str] = set()

    def search(module: str, path: list[str]) -> list[str] | None:
        for following in graph.get(module, ()):
            if following in path:
                return path[path.index(following):] + [following]
            if following not in done and (found := search(following, path + [following])) is not None:
                return found
        done.add(module)
        return None

    for module in graph:
        if module not in done and (cycle := search(module, [module])) is not None:
            return cycle
    return None


def test_the_worker_package_has_no_import_cycles():
    modules = pipeline_modules()
    graph = {module: sorted(name for name in names if name in modules) for module, names in modules.items()}
    assert first_cycle(graph) is None, first_cycle(graph)


def test_the_cycle_search_finds_a_ring_and_passes_a_diamond():
    assert first_cycle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]
    assert first_cycle({"a": ["b", "c"], "b": ["d"], "c": ["d"], "d": []}) is None


def test_the_layout_test_sees_a_local_import(tmp_path):
    """The scan itself: a lazy import of local code inside a function is found."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from local.direct_runner import main\n    import benchmarks.scale\n")
    assert {"local.direct_runner", "benchmarks.scale"} <= imports(module)


def test_the_architecture_page_names_every_worker_module_and_no_other():
    page = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^\| `([a-z_]+)\.py` \|", page, flags=re.M))
    modules = {path.stem for path in (REPO / "pipeline").glob("*.py") if path.stem != "__init__"}
    assert listed == modules, {"not listed": sorted(modules - listed), "no such module": sorted(listed - modules)}


def test_every_reference_to_a_worker_module_names_one_that_exists():
    """Docstrings and docs that point at ``pipeline.x`` (or ``pipeline/x.py``) point at a module that is there."""
    modules = {path.stem for path in (REPO / "pipeline").glob("*.py")}
    texts = [*(REPO / "pipeline").glob("*.py"), *(REPO / "local").glob("*.py"), *(REPO / "docs").glob("*.md"),
             REPO / "README.md"]
    reference = re.compile(r"pipeline/([a-z_]+)\.py|(?<![\w/.])pipeline\.([a-z_]+)(?=[`.\s:,)])")
    dangling = {(path.name, name) for path in texts
                for found in reference.findall(path.read_text(encoding="utf-8")) for name in found
                if name and name not in modules}
    assert not dangling, sorted(dangling)
