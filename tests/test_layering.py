"""The package's imports form layers: no module imports, directly or through others, a module that imports it back,
and neither do its top-level parts (`parallel` is the base `attention` builds on, never the reverse). Every import
counts: a deferred (in-function) import and one under `if TYPE_CHECKING:` are still dependencies, and a circle closed
through either is still a circle. No module reads another module's private (underscored) names."""

import ast
import textwrap
from pathlib import Path


PACKAGE = Path(__file__).resolve().parents[1] / "hf_spec_cotrain"


def _module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


class _ModuleImports:
    """What one module of the package imports: the package's modules, and the private names it reads from them."""

    def __init__(self, path: Path, package: Path, modules: set[str]):
        self.name = _module_name(path, package)
        self.modules: set[str] = set()
        self.private_names: set[str] = set()  # "module._name"
        parent = self.name.split(".") if path.name == "__init__.py" else self.name.split(".")[:-1]
        bound_modules: dict[str, str] = {}  # local name -> the package module it is bound to
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = parent[: len(parent) - node.level + 1] if node.level else []
                source = ".".join([*base, *([node.module] if node.module else [])])
                for alias in node.names:
                    candidate = f"{source}.{alias.name}"
                    if candidate in modules:
                        self.modules.add(candidate)
                        bound_modules[alias.asname or alias.name] = candidate
                    elif source in modules:
                        self.modules.add(source)
                        if _is_private(alias.name):
                            self.private_names.add(f"{source}.{alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules:
                        self.modules.add(alias.name)
                        if alias.asname:
                            bound_modules[alias.asname] = alias.name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and _is_private(node.attr)
                and isinstance(node.value, ast.Name)
                and node.value.id in bound_modules
            ):
                self.private_names.add(f"{bound_modules[node.value.id]}.{node.attr}")
        self.modules.discard(self.name)


def _package_imports(package: Path = PACKAGE) -> list[_ModuleImports]:
    paths = [path for path in package.rglob("*.py") if "__pycache__" not in path.parts]
    modules = {_module_name(path, package) for path in paths}
    return [_ModuleImports(path, package, modules) for path in paths]


def _import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    return {imports.name: imports.modules for imports in _package_imports(package)}


def _private_imports(package: Path = PACKAGE) -> list[str]:
    """`importer -> module._name` for every private name a module reads from another one."""
    return sorted(
        f"{imports.name} -> {private}" for imports in _package_imports(package) for private in imports.private_names
    )


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
    """The top-level part of the package a module belongs to (`hf_spec_cotrain.parallel`, `hf_spec_cotrain.draft`)."""
    return ".".join(module.split(".")[:2])


def _plant(tmp_path: Path, files: dict[str, str]) -> Path:
    """A package `pkg` of `files` (path inside it: source) under `tmp_path`."""
    package = tmp_path / "pkg"
    for name, source in {"__init__.py": "", **files}.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(textwrap.dedent(source), encoding="utf-8")
    return package


def test_the_checker_sees_imports_and_cycles():
    graph = _import_graph()
    assert "hf_spec_cotrain.parallel.zigzag" in graph["hf_spec_cotrain.attention.ring"]  # a relative import
    assert "hf_spec_cotrain.draft.eagle3_ttt" in graph["hf_spec_cotrain.draft.modeling"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_checker_sees_a_cycle_closed_through_type_checking(tmp_path):
    package = _plant(
        tmp_path,
        {
            "a.py": "from .b import B\n",
            "b.py": """\
                from typing import TYPE_CHECKING
                if TYPE_CHECKING:
                    from .a import A
                B = 1
            """,
        },
    )
    assert _cycle(_import_graph(package)) == ["pkg.a", "pkg.b", "pkg.a"]


def test_the_checker_sees_a_cycle_closed_through_a_deferred_import(tmp_path):
    package = _plant(
        tmp_path,
        {
            "sub/__init__.py": "from .model import Model\n",
            "sub/model.py": """\
                class Model:
                    def push(self):
                        from ..hub import push
                        push(self)
            """,
            "hub.py": "from .sub import Model\n",
        },
    )
    assert _cycle(_import_graph(package)) == ["pkg.hub", "pkg.sub", "pkg.sub.model", "pkg.hub"]


def test_the_checker_sees_private_imports(tmp_path):
    package = _plant(
        tmp_path,
        {
            "core.py": "_helper = 1\nPUBLIC = 2\n",
            "by_name.py": "from .core import PUBLIC, _helper\n",
            "deferred.py": "def f():\n    from pkg.core import _helper\n    return _helper\n",
            "by_attribute.py": "from . import core\nx = core._helper + core.PUBLIC\n",
            "aliased.py": "import pkg.core as c\nx = c._helper\n",
            "own.py": "_mine = 1\nx = _mine\n",
            "dunder.py": "from . import __name__ as name\nfrom .core import __doc__\n",
        },
    )
    assert _private_imports(package) == [
        "pkg.aliased -> pkg.core._helper",
        "pkg.by_attribute -> pkg.core._helper",
        "pkg.by_name -> pkg.core._helper",
        "pkg.deferred -> pkg.core._helper",
    ]


def test_no_module_imports_itself_back():
    cycle = _cycle(_import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_module_reads_another_modules_private_names():
    private = _private_imports()
    assert not private, "private names read across modules:\n" + "\n".join(private)


def test_the_package_parts_form_layers():
    parts: dict[str, set[str]] = {}
    for module, imported in _import_graph().items():
        parts.setdefault(_part(module), set()).update(
            _part(target) for target in imported if _part(target) != _part(module)
        )
    cycle = _cycle(parts)
    assert cycle is None, "the package's parts import each other: " + " -> ".join(cycle)
    assert "hf_spec_cotrain.parallel" in parts["hf_spec_cotrain.attention"]  # the edge the layering is about
