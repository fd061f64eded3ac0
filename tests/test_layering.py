"""The package's imports form layers: no module imports, directly or through others, a module that imports it back,
and neither do its top-level parts (`parallel` is the base `attention` builds on, never the reverse). Imports inside
functions count (a deferred import is still a dependency); those under `if TYPE_CHECKING:` do not."""

import ast
from pathlib import Path


PACKAGE = Path(__file__).resolve().parents[1] / "hf_spec_cotrain"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that `path` imports."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    type_checking_only = {
        id(node)
        for branch in ast.walk(tree)
        if isinstance(branch, ast.If) and "TYPE_CHECKING" in ast.unparse(branch.test)
        for statement in branch.body
        for node in ast.walk(statement)
    }
    name = _module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    imported = set()
    for node in ast.walk(tree):
        if id(node) in type_checking_only:
            continue
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            source = ".".join([*base, *([node.module] if node.module else [])])
            for alias in node.names:
                candidate = f"{source}.{alias.name}"
                imported.add(candidate if candidate in modules else source)
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    return {module for module in imported if module in modules and module != name}


def _import_graph() -> dict[str, set[str]]:
    paths = [path for path in PACKAGE.rglob("*.py") if "__pycache__" not in path.parts]
    modules = {_module_name(path) for path in paths}
    return {_module_name(path): _imports(path, modules) for path in paths}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path that returns to its start, or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                return [*stack[stack.index(target) :], target]
            if target not in state and (found := visit(target)):
                return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _part(module: str) -> str:
    """The top-level part of the package a module belongs to (`hf_spec_cotrain.parallel`, `hf_spec_cotrain.ttt`)."""
    return ".".join(module.split(".")[:2])


def test_the_checker_sees_imports_and_cycles():
    graph = _import_graph()
    assert "hf_spec_cotrain.parallel.zigzag" in graph["hf_spec_cotrain.attention.ring"]  # a relative import
    assert "hf_spec_cotrain.ttt" in graph["hf_spec_cotrain.training.pipeline_step"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_imports_itself_back():
    cycle = _cycle(_import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_package_parts_form_layers():
    parts: dict[str, set[str]] = {}
    for module, imported in _import_graph().items():
        parts.setdefault(_part(module), set()).update(
            _part(target) for target in imported if _part(target) != _part(module)
        )
    cycle = _cycle(parts)
    assert cycle is None, "the package's parts import each other: " + " -> ".join(cycle)
    assert "hf_spec_cotrain.parallel" in parts["hf_spec_cotrain.attention"]  # the edge the layering is about
