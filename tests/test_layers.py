"""The layers, read from the imports: entrypoints -> engine -> worker -> models -> kernels.

Every module under ``mmserve/``, ``models/`` and ``kernels/`` is parsed with ``ast`` (nothing
is imported); ``models/`` and ``kernels/`` install as ``mmserve.models`` and ``mmserve.kernels``
and are named so here. Every import statement counts, those inside functions too: a deferred
import is still a dependency. Importing a submodule is an edge to that module only, not to its
parent packages' ``__init__`` (they hold docstrings and re-exports).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Package name -> the folder it installs from (pyproject.toml's package-dir).
PACKAGE_DIRS = {"mmserve": ROOT / "mmserve", "mmserve.models": ROOT / "models",
                "mmserve.kernels": ROOT / "kernels"}

ENGINE, WORKER = "mmserve.engine", "mmserve.worker"
PROCESSING, ENTRYPOINTS, BENCH = "mmserve.processing", "mmserve.entrypoints", "mmserve.bench"
MODELS, KERNELS = "mmserve.models", "mmserve.kernels"
# The packages whose import graph must have no circle whatever the front doors do, and the
# single-file modules at the top of mmserve/ (config, messages, errors), which they share.
CORE_PACKAGES = (ENGINE, WORKER, PROCESSING, MODELS, KERNELS)


def _module_files() -> dict[str, Path]:
    modules = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


MODULES = _module_files()


def _known(name: str) -> str | None:
    """The longest prefix of a dotted name that is one of our modules (None: not ours)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in MODULES:
            return candidate
        parts.pop()
    return None


def imports_of(module: str) -> set[str]:
    """The modules of this tree that ``module`` imports, anywhere in its source."""
    path = MODULES[module]
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found: set[str | None] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(_known(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from its own package, up level - 1 packages
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[:len(package) - (node.level - 1)]
                base = ".".join([*package, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            for alias in node.names:
                # ``from package import submodule`` imports the submodule; otherwise a name.
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in MODULES else _known(base))
    return {m for m in found if m is not None}


GRAPH = {module: imports_of(module) for module in MODULES}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: strongly connected components of more than one module, or of one
    that imports itself (Tarjan's algorithm, iterative). Edges leaving ``graph`` are ignored."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next((c for c in children if c in graph), None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    cycles.append(sorted(component))
    return cycles


def _under(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _violations(layer: str, forbidden: tuple[str, ...]) -> list[str]:
    return [f"{module} imports {imported}"
            for module, imported_set in sorted(GRAPH.items()) if _under(module, layer)
            for imported in sorted(imported_set) if _under(imported, *forbidden)]


# ----------------------------------------------------------------- the checker itself
def test_the_graph_sees_every_kind_of_import() -> None:
    """The parser finds what these checks rely on, so that an empty graph cannot pass them."""
    assert {"mmserve.step", "mmserve.engine.scheduler", "mmserve.worker.model_runner",
            "mmserve.models.llava", "mmserve.kernels.cpu_ops"} <= MODULES.keys()
    engine = GRAPH["mmserve.engine.llm_engine"]
    assert "mmserve.worker.cuda_runner" in engine  # from module import name
    assert "mmserve.worker.memory_profiler" in engine  # from package import module
    # An import inside a function (the Triton kernels are imported where they are used).
    assert "mmserve.kernels.triton_attention" in GRAPH["mmserve.worker.cuda_runner"]
    # models/ and kernels/ under their installed names.
    assert "mmserve.kernels.fused" in GRAPH["mmserve.models.layers"]
    assert "mmserve.models.registry" in GRAPH["mmserve.models"]  # a package's __init__


def test_find_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}, "f": {"a", "x"}}
    assert find_cycles(graph) == [["a", "b", "c"], ["e"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


# ----------------------------------------------------------------- circles
def test_no_import_circles_in_the_core() -> None:
    """Engine, worker, processing, models and kernels, with the top-level modules they share."""
    core = {m for m, path in MODULES.items()
            if _under(m, *CORE_PACKAGES)
            or (path.parent == PACKAGE_DIRS["mmserve"] and path.name != "__init__.py")}
    assert find_cycles({m: GRAPH[m] & core for m in core}) == []


def test_no_import_circles_anywhere() -> None:
    """The whole tree, front doors (entrypoints, bench) included."""
    assert find_cycles(GRAPH) == []


# ----------------------------------------------------------------- one way down
@pytest.mark.parametrize(("layer", "forbidden"), [
    # The runner gets its step messages from mmserve/step.py, never from the engine's logic.
    (WORKER, (ENGINE, PROCESSING, ENTRYPOINTS, BENCH)),
    (MODELS, (ENGINE, WORKER, PROCESSING, ENTRYPOINTS, BENCH)),
    (KERNELS, (MODELS, ENGINE, WORKER, PROCESSING, ENTRYPOINTS, BENCH)),
    (PROCESSING, (ENGINE, WORKER, ENTRYPOINTS, BENCH)),
    (ENGINE, (ENTRYPOINTS, BENCH)),
])
def test_layer_imports_no_upper_layer(layer: str, forbidden: tuple[str, ...]) -> None:
    assert _violations(layer, forbidden) == []


@pytest.mark.parametrize(("module", "allowed"), [
    ("mmserve.step", {"mmserve.sampling_params"}),
    ("mmserve.inputs", set()),
])
def test_messages_are_leaves(module: str, allowed: set[str]) -> None:
    """What crosses between layers imports nothing of the layers it connects."""
    assert GRAPH[module] <= allowed, GRAPH[module]


def _modules_loaded_by(code: str) -> list[str]:
    """The modules a fresh interpreter has loaded after running ``code``."""
    import subprocess
    import sys

    script = f"import sys\n{code}\nprint(' '.join(sorted(sys.modules)))"
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=True).stdout.split()


def test_a_worker_process_loads_no_engine() -> None:
    """What the graph above leaves out, the parent packages' ``__init__``, seen by importing
    for real: a tensor-parallel worker process imports the worker and the models (and,
    through them, ``mmserve/__init__.py``), and must not load the engine, the processors,
    the front doors or the structured-output library with them (``mmserve`` re-exports its
    names on first use)."""
    loaded = _modules_loaded_by("import mmserve.worker.executor, mmserve.models")
    above = [m for m in loaded
             if m.split(".")[0] == "xgrammar"
             or any(m == p or m.startswith(p + ".")
                    for p in (ENGINE, PROCESSING, ENTRYPOINTS, BENCH))]
    assert "mmserve.worker.model_runner" in loaded
    assert above == []


def test_the_command_builds_its_parser_without_the_engine() -> None:
    """The ``mmserve`` command's module is imported again by every process it spawns (a
    tensor-parallel worker of ``mmserve serve``): building its parser loads neither the engine
    nor the server, the processors' libraries or the structured-output library."""
    loaded = _modules_loaded_by(
        "from mmserve.entrypoints.cli import build_parser\nbuild_parser()")
    heavy = [m for m in loaded
             if m.split(".")[0] in ("xgrammar", "transformers", "starlette", "uvicorn")
             or m == ENGINE or m.startswith(ENGINE + ".")
             or m == "mmserve.entrypoints.api_server"]
    assert "mmserve.entrypoints.serve_args" in loaded
    assert heavy == []


def test_the_package_still_gives_its_names() -> None:
    import mmserve
    from mmserve import LLM, EngineConfig, RequestOutput, SamplingParams

    assert mmserve.LLM is LLM and LLM.__name__ == "LLM"
    assert {EngineConfig.__name__, RequestOutput.__name__, SamplingParams.__name__} == {
        "EngineConfig", "RequestOutput", "SamplingParams"}
    assert set(mmserve.__all__) <= set(dir(mmserve))
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        mmserve.nothing  # noqa: B018


def test_the_kernels_folder_does_not_hide_hugging_face_kernels() -> None:
    """Run from a checkout's root, ``import kernels`` finds this repository's ``kernels/``
    folder first; that name is Hugging Face's package (transformers >= 5.25 imports it), so the
    folder steps aside for it where it is installed (else it is an empty module, as before),
    and ``mmserve.kernels`` stays this one."""
    import importlib.metadata
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    script = ("import kernels, mmserve.kernels.paged_attention as ours\n"
              "print(kernels.__file__)\nprint(ours.__file__)")
    run = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    theirs, ours = (Path(line) for line in run.stdout.split())
    try:
        importlib.metadata.distribution("kernels")
        installed = True
    except importlib.metadata.PackageNotFoundError:
        installed = False
    if installed:
        assert root / "kernels" not in theirs.parents
    else:
        assert theirs == root / "kernels" / "__init__.py"
    assert ours == root / "kernels" / "paged_attention.py"
