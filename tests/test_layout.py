"""The layout shows the architecture: ``pipeline/`` is what a worker runs, and nothing local is in it.

The worker image copies ``pipeline/`` and ``template/`` only (container/Dockerfile), so a pipeline module
that imported local code (DirectRunner patches, the embedded model, the docs generator, benchmarks or
tests) would either fail on a worker or ship local-only behaviour to it. Lazy imports inside functions
count too: they run on the worker when called.
"""

from __future__ import annotations

import ast
import re
import tokenize
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


# The stage packages, ground first: a module imports only from its own package or one listed before it (records at
# the ground, then the sinks that write them, which the engine uses too (each chunk published as it is cut); then
# the data path upward: the model's server, intake, the engines, the worker's runtime, flow control, generation, and
# the configuration that names them all); ``pipeline.assembly`` wires them and sits on top.
STAGES = ("contract", "sinks", "serving", "intake", "engines", "worker", "flow", "generation", "config")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def pipeline_modules() -> dict[str, set[str]]:
    """Every worker module (packages' ``__init__`` included) and what it imports."""
    return {module_name(path): imports(path) for path in sorted((REPO / "pipeline").rglob("*.py"))}


def stage_of(module: str) -> int:
    """A module's floor: its stage package's place in :data:`STAGES`; the top for modules outside the stages."""
    parts = module.split(".")
    return STAGES.index(parts[1]) if len(parts) > 1 and parts[1] in STAGES else len(STAGES)


def upward_imports(modules: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports that go from a stage package to one above it."""
    return sorted((module, name) for module, names in modules.items() for name in names
                  if name.startswith("pipeline.") and stage_of(name) > stage_of(module))


def test_no_pipeline_module_imports_local_only_code():
    offending = {module: sorted(name for name in names if name.split(".")[0] in LOCAL_ONLY)
                 for module, names in pipeline_modules().items()}
    assert not {module: names for module, names in offending.items() if names}


def test_the_operator_tools_import_nothing_local_only():
    """ops/ is what an operator runs against Google Cloud (make image, run, backfill, redrive): a local hook it
    imported would run on every real deploy (local/backfill.py wraps the backfill from outside for the tests)."""
    offending = {path.name: sorted(name for name in imports(path) if name.split(".")[0] in LOCAL_ONLY)
                 for path in (REPO / "ops").rglob("*.py")}
    assert not {name: found for name, found in offending.items() if found}


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


def test_no_worker_module_switches_on_local_emulators_or_benchmarks():
    """Local and benchmark hooks live in local/ and benchmarks/, registered from there (an emulator's BigQuery client:
    local/emulators.py). Google's own libraries find the Pub/Sub and Storage emulators by themselves."""
    named = {module: sorted(set(re.findall(r"[A-Z_]*EMULATOR[A-Z_]*|(?<![/\w])benchmarks\.(?!md\b)[a-z_]+", prose_and_code)))
             for module, prose_and_code in ((path.relative_to(REPO).as_posix(), path.read_text(encoding="utf-8"))
                                            for path in (REPO / "pipeline").rglob("*.py"))}
    assert not {module: names for module, names in named.items() if names}


def test_the_cycle_search_finds_a_ring_and_passes_a_diamond():
    assert first_cycle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]
    assert first_cycle({"a": ["b", "c"], "b": ["d"], "c": ["d"], "d": []}) is None


def test_the_layout_test_sees_a_local_import(tmp_path):
    """The scan itself: a lazy import of local code inside a function is found."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from local.direct_runner import main\n    import benchmarks.scale\n")
    assert {"local.direct_runner", "benchmarks.scale"} <= imports(module)


def test_stage_packages_import_only_downward():
    assert not upward_imports(pipeline_modules())


def test_the_direction_check_sees_an_arrow_back_up():
    modules = {"pipeline.contract.messages": {"pipeline.engines.engine"}, "pipeline.engines.engine": {
        "pipeline.contract.messages", "json"}, "pipeline.assembly": {"pipeline.config.options"}}
    assert upward_imports(modules) == [("pipeline.contract.messages", "pipeline.engines.engine")]


def test_every_worker_module_sits_in_a_stage_package_that_says_what_enters_and_leaves_it():
    packages = sorted(path.name for path in (REPO / "pipeline").iterdir() if (path / "__init__.py").is_file())
    assert sorted(STAGES) == packages
    loose = sorted(path.name for path in (REPO / "pipeline").glob("*.py"))
    assert loose == ["__init__.py", "assembly.py"]  # assembly wires the stages: it is no stage of its own
    for stage in STAGES:
        docstring = ast.get_docstring(ast.parse((REPO / "pipeline" / stage / "__init__.py").read_text()))
        assert docstring and len(docstring) > 40, stage


def test_the_architecture_page_names_every_worker_module_and_no_other_in_stage_order():
    page = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    listed = re.findall(r"^\| `(?:([a-z_]+)/)?([a-z_]+)\.py` \|", page, flags=re.M)
    modules = {name.removeprefix("pipeline.").replace(".", "/") for name in pipeline_modules()
               if not name.endswith("__init__") and name.count(".") >= 1 and (REPO / f"{name.replace('.', '/')}.py").is_file()}
    named = {f"{stage}/{module}" if stage else module for stage, module in listed}
    assert named == modules, {"not listed": sorted(modules - named), "no such module": sorted(named - modules)}
    order = [stage for stage, _ in listed if stage]
    assert order == sorted(order, key=STAGES.index), "list the stages ground first, as STAGES does"


def test_each_worker_module_is_short_enough_to_hold_in_ones_head():
    """Issue #56's bar: no module of pipeline/ over 450 lines, and the generate step's DoFn a thin shell of 300."""
    lengths = {path.relative_to(REPO).as_posix(): len(path.read_text(encoding="utf-8").splitlines())
               for path in (REPO / "pipeline").rglob("*.py")}
    assert {path: n for path, n in lengths.items() if n > 450} == {}
    assert lengths["pipeline/generation/generate.py"] <= 300


def prose(path: Path) -> str:
    """What a reader reads: a page whole, a Python file's strings and comments (its code may name a Beam pipeline)."""
    if path.suffix != ".py":
        return path.read_text(encoding="utf-8")
    with path.open("rb") as source:
        return "\n".join(token.string for token in tokenize.tokenize(source.readline)
                         if token.type in (tokenize.STRING, tokenize.COMMENT))


def test_every_reference_to_a_worker_module_names_one_that_exists():
    """Docstrings and docs that point at ``pipeline.x`` (or ``pipeline/x.py``) point at a module that is there."""
    modules = set(pipeline_modules())
    texts = [*(REPO / "pipeline").rglob("*.py"), *(REPO / "local").glob("*.py"), *(REPO / "docs").glob("*.md"),
             REPO / "README.md", *(REPO / "benchmarks").rglob("*.py"),
             *(path for path in (REPO / "tests").glob("*.py") if path.name != "test_layout.py"),
             *(REPO / "ops").glob("*.py")]
    reference = re.compile(r"(?<![\w/.])pipeline/([a-z_/]+)\.py|(?<![\w/.])pipeline((?:\.[A-Za-z_]+)+)")
    dangling = set()
    for path in texts:
        for slashed, dotted in reference.findall(prose(path)):
            if slashed and "pipeline." + slashed.replace("/", ".") not in modules:
                dangling.add((path.name, f"pipeline/{slashed}.py"))
            if dotted and not re.search(r"\.(log|json|pb|txt|ya?ml)$", dotted):  # a file named pipeline.log
                parts = dotted.strip(".").split(".")
                # The longest module the reference names; what follows it is an attribute (a class, a function).
                named = next((".".join(parts[:n]) for n in range(len(parts), 0, -1)
                              if "pipeline." + ".".join(parts[:n]) in modules), None)
                whole = parts[1:] if named is None else parts[len(named.split(".")):]
                if named is None or (whole and whole[0].islower() and not named.count(".")):
                    dangling.add((path.name, "pipeline" + dotted))
    assert not dangling, sorted(dangling)


# Beam calls these on a DoFn or PTransform: a public method of that name is the runner's, not a seam.
BEAM_CALLBACKS = {"setup", "start_bundle", "process", "finish_bundle", "teardown", "expand",
                  # a RestrictionProvider's and a RestrictionTracker's, which Beam calls
                  "initial_restriction", "create_tracker", "restriction_size", "truncate", "split", "try_split"}


def exposed(path: Path) -> set[str]:
    """The public names a worker module defines: its functions, classes and globals, and its classes' methods
    (Beam's callbacks and timer callbacks aside)."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(target.id for target in targets if isinstance(target, ast.Name))
        if isinstance(node, ast.ClassDef):
            names.update(item.name for item in node.body if isinstance(item, ast.FunctionDef)
                         and item.name not in BEAM_CALLBACKS and not any(
                             isinstance(d, ast.Call) and getattr(d.func, "id", None) == "on_timer"
                             for d in item.decorator_list))
    return {name for name in names if not name.startswith("_")}


def referenced(paths) -> set[str]:
    """Every name, attribute and imported name the files use."""
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Name):
                names.add(node.id)
            elif isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.alias):
                names.add(node.name.split(".")[-1])
    return names


def only_for_local_code(product: set[str], local: set[str], modules: dict[str, set[str]]) -> dict[str, list[str]]:
    """Per worker module, the public names local code or benchmarks use and the product never does."""
    found = {module: sorted(names & local - product) for module, names in modules.items()}
    return {module: names for module, names in found.items() if names}


def test_nothing_in_the_worker_package_exists_only_for_local_code_benchmarks_or_tests():
    """A seam for a local run, a benchmark or a test (a client factory, a count-based grant, a registry of engines,
    a getter only a test reads) is a name the worker package exposes that only local/, benchmarks/ or tests/ use.
    The product is what a worker runs (pipeline/, template/), the operator's commands (ops/) and the build of the
    console form (local/template_docs.py). Local code may wrap the worker's functions from outside; it must not
    need one made for it, and tests read what the product itself reports."""
    build = REPO / "local" / "template_docs.py"
    product = referenced([*(REPO / "pipeline").rglob("*.py"), *(REPO / "template").rglob("*.py"),
                          *(REPO / "ops").rglob("*.py"), build])
    local = referenced([*(path for path in (REPO / "local").rglob("*.py") if path != build),
                        *(REPO / "benchmarks").rglob("*.py"), *(REPO / "tests").rglob("*.py")])
    modules = {module_name(path): exposed(path) for path in (REPO / "pipeline").rglob("*.py")}
    assert not only_for_local_code(product, local, modules)


def test_the_seam_check_sees_a_factory_only_a_launcher_sets(tmp_path):
    module = tmp_path / "sink.py"
    module.write_text("_factory = None\n\ndef use_factory(f):\n    global _factory\n    _factory = f\n\n"
                      "class Sink:\n    def process(self):\n        return _factory\n\n    def setup(self):\n        pass\n")
    launcher = tmp_path / "launch.py"
    launcher.write_text("from sink import use_factory\nuse_factory(print)\n")
    assert exposed(module) == {"use_factory", "Sink"}
    assert only_for_local_code(referenced([module]), referenced([launcher]), {"sink": exposed(module)}) == {
        "sink": ["use_factory"]}


MUTATORS = {"append", "clear", "pop", "popleft", "setdefault", "update", "extend", "add", "remove", "discard"}


def process_globals(path: Path) -> dict[str, bool]:
    """A module's globals that its code changes after import (items set, or a mutating method called), each with
    whether the comment just above it says it is kept per process."""
    text = path.read_text(encoding="utf-8")
    lines, tree = text.splitlines(), ast.parse(text)
    containers = {}
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        if isinstance(getattr(node, "value", None), (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp)):
            for target in targets:
                if isinstance(target, ast.Name):
                    above = lines[node.lineno - 2] if node.lineno > 1 else ""
                    containers[target.id] = above.lstrip().startswith("#") and "per process" in above.lower()
    changed = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name):
            changed.add(node.value.id)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS \
                and isinstance(node.func.value, ast.Name):
            changed.add(node.func.value.id)
    return {name: documented for name, documented in containers.items() if name in changed}


def test_the_worker_package_keeps_no_mutable_global_but_documented_per_process_caches():
    """A runner may build a DoFn instance per bundle, so a few things must be kept per process (clients, the
    worker's runtime and what this process told it); each says so where it is declared. Nothing else is global."""
    undocumented = {module_name(path): sorted(name for name, documented in process_globals(path).items()
                                              if not documented)
                    for path in (REPO / "pipeline").rglob("*.py")}
    assert not {module: names for module, names in undocumented.items() if names}


def test_the_global_check_sees_a_changed_global_and_its_comment(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("TABLE = {'a': 1}\n_seen = {}\n# Per process: clients, kept for its life.\n_clients = {}\n"
                      "def f(k):\n    _seen[k] = True\n    _clients.setdefault(k, 1)\n    return TABLE[k]\n")
    assert process_globals(module) == {"_seen": False, "_clients": True}
