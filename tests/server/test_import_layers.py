"""The server's packages import downward only, with no cycle between them.

Read from the source (every `import` and `from ... import` outside `if TYPE_CHECKING:`), so a
new import that climbs a layer or closes a cycle fails here, in CI, before anyone has to untangle
it. The layers, top to bottom: the wire (`api`, `security`, `openai_api`), telemetry, the engine, then
the model, text and sampling packages. Modules at the top of `tokenwire.server` (the app, the
CLI, settings) and `model_tools` sit outside the layers but may not close a cycle either.
"""

from __future__ import annotations

import ast
import gc
from collections import defaultdict
from pathlib import Path

import tokenwire.server

ROOT = Path(tokenwire.server.__file__).parent
PACKAGE = "tokenwire.server"
LAYERS = {
    "api": 3,
    "security": 3,
    "openai_api": 3,
    "telemetry": 2,
    "engine": 1,
    "models": 0,
    "text": 0,
    "sampling": 0,
}
"""A module may import its own layer's packages and those below it, never above."""
OUTSIDE_THE_LAYERS = {
    "model_tools",
    "adapter_loading",
    "app",
    "cli",
    "config",
    "health",
    "lifecycle",
    "load",
    "main",
    "metadata",
    "method_handlers",
    "observers",
    "settings_schema",
    "settings_sources",
}
"""The units that wire the layers together or build models offline: they may import any layer,
and no layer may import them (the cycle test below holds them to that)."""
SCHEDULER_MAY_NOT_IMPORT = (
    "tokenwire.server.models",
    "tokenwire.server.text",
    "tokenwire.server.sampling.sampler",
    "tokenwire.server.sampling.constraint",
    "tokenwire.server.engine.core",
    "tokenwire.server.engine.output",
    "tokenwire.server.engine.kv_reuse",
    "grpc",
    "google.protobuf",
    "tokenwire.v1",
    "numpy",
)


def _component(module: str) -> str:
    """The package a module belongs to (its first name below tokenwire.server), or itself."""
    return module.removeprefix(PACKAGE + ".").split(".")[0]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PACKAGE, *parts])


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[str]:
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
            found.extend(f"{node.module}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _parse(path: Path) -> ast.Module:
    """`ast.parse` with the cyclic collector paused.

    Python 3.11's AST builder keeps its recursion depth in interpreter-wide state, and a collection
    during a parse can run a finalizer that parses too (an asyncio task's "exception was never
    retrieved" message, whose traceback formatting parses source lines): the outer parse then fails
    with "SystemError: AST constructor recursion depth mismatch". Other tests' garbage must not
    decide this one.
    """
    source = path.read_text(encoding="utf-8")
    collecting = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(source, filename=str(path))
    finally:
        if collecting:
            gc.enable()


def _graph() -> dict[str, set[str]]:
    """Module -> the server modules (and outside modules) it imports at run time."""
    graph: dict[str, set[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        graph[_module_name(path)] = set(_imports(_parse(path)))
    return graph


def _server_edges(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    modules = set(graph)
    edges: dict[str, set[str]] = defaultdict(set)
    for module, imported in graph.items():
        for name in imported:
            if name in modules and name != module:
                edges[module].add(name)
    return edges


def test_no_package_imports_a_package_of_a_higher_layer() -> None:
    climbs = []
    for module, imported in _server_edges(_graph()).items():
        source = _component(module)
        for target in imported:
            if (
                source in LAYERS
                and _component(target) in LAYERS
                and LAYERS[_component(target)] > LAYERS[source]
            ):
                climbs.append(f"{module} imports {target}")
    assert climbs == []


def test_every_unit_of_the_server_is_in_a_layer_or_named_outside_them() -> None:
    units = {_component(module) for module in _graph() if module != PACKAGE}
    assert units - set(LAYERS) - OUTSIDE_THE_LAYERS == set(), "a new unit needs its place in LAYERS"
    assert set(LAYERS) | OUTSIDE_THE_LAYERS <= units, "a unit named here that no longer exists"


def test_the_server_s_packages_import_each_other_without_a_cycle() -> None:
    components: dict[str, set[str]] = defaultdict(set)
    for module, imported in _server_edges(_graph()).items():
        for target in imported:
            if _component(target) != _component(module):
                components[_component(module)].add(_component(target))
    cycle = _find_cycle(components)
    assert cycle is None, " -> ".join(cycle or [])


def test_the_scheduler_imports_no_runner_tokenizer_sampler_or_wire_code() -> None:
    graph = _graph()
    edges = _server_edges(graph)
    reached, todo = set(), ["tokenwire.server.engine.scheduler"]
    while todo:
        module = todo.pop()
        if module in reached:
            continue
        reached.add(module)
        todo.extend(edges.get(module, ()))
    imported = {name for module in reached for name in graph[module]}
    forbidden = sorted(
        name
        for name in imported | reached
        if any(name == banned or name.startswith(banned + ".") for banned in SCHEDULER_MAY_NOT_IMPORT)
    )
    assert forbidden == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    # The check above is only as good as this search: it must see a cycle when there is one.
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) is not None
    assert _find_cycle({"a": {"b"}, "b": {"c"}}) is None


def _find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path that returns to its start, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for target in sorted(edges.get(node, ())):
            if state.get(target) == 1:
                return [*stack[stack.index(target) :], target]
            if target not in state:
                found = visit(target)
                if found is not None:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found is not None:
                return found
    return None
