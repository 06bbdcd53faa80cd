"""The layout shows the architecture: ``pipeline/`` is what a worker runs, and nothing local is in it.

The worker image copies ``pipeline/`` and ``template/`` only (container/Dockerfile), so a pipeline module
that imported local code (DirectRunner patches, the embedded model, the docs generator, benchmarks or
tests) would either fail on a worker or ship local-only behaviour to it. Lazy imports inside functions
count too: they run on the worker when called.
"""

from __future__ import annotations

import ast
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


def test_the_worker_package_has_no_import_cycles():
    graph = {module: {name for name in names if name in pipeline_modules()}
             for module, names in pipeline_modules().items()}

    def cycle_from(module: str, path: tuple[str, ...]) -> tuple[str, ...] | None:
        for following in sorted(graph[module]):
            if following in path:
                return path[path.index(following):] + (following,)
            if (found := cycle_from(following, path + (following,))) is not None:
                return found
        return None

    cycles = [cycle for module in graph if (cycle := cycle_from(module, (module,)))]
    assert not cycles, cycles[0]


def test_the_layout_test_sees_a_local_import(tmp_path):
    """The scan itself: a lazy import of local code inside a function is found."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from local.direct_runner import main\n    import benchmarks.scale\n")
    assert {"local.direct_runner", "benchmarks.scale"} <= imports(module)
