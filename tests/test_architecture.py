"""The package's shape, checked: the capability layers hold (lint-imports, imports inside functions included), no
import cycle remains between modules, no module is over 800 lines, and ``import flodl_hf`` stays light."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 800
# Where a library module may import by name at run time, and why (anything else is an import the layers hide):
DYNAMIC_IMPORTS = {
    "flodl_hf/__init__.py": "the facade's top-level names, loaded on first use (PEP 562)",
    "families/__init__.py": "the families package importing each of its own modules",
    "flodl_hf/tasks/embed.py": "the sentence-transformers module classes a modules.json names",
    "flodl_hf/generation/processors.py": "transformers' own logits processors, the reference",
    "flodl_hf/commands/export.py": "the commands package registering its own subcommands",
    "flodl_hf/cli.py": "the top layer loading each command module",
}


def _library_files() -> dict[str, Path]:
    """Module name -> file, laid out as installed (families/ and heads/ are flodl_hf.families, flodl_hf.heads)."""
    files = {}
    for folder, package in (("flodl_hf", "flodl_hf"), ("families", "flodl_hf.families"), ("heads", "flodl_hf.heads")):
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join([package, *parts])] = path
    return files


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def import_graph() -> dict[str, set[str]]:
    """Module -> the library modules it imports anywhere in its file (inside functions too), TYPE_CHECKING aside.
    ``from package import name`` counts as an import of ``package.name`` where that is a module, as grimp does."""
    files = _library_files()
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in files.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_nodes(tree)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for target in targets:
                while target not in files and "." in target:
                    target = target.rpartition(".")[0]
                if target in files and target != module:
                    graph[module].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in list(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_between_modules_or_packages():
    graph = import_graph()
    assert cycles(graph) == []
    # a module's capability package: flodl_hf.core, flodl_hf.training, flodl_hf.auto, flodl_hf.families...
    packages: dict[str, set[str]] = defaultdict(set)
    for module, targets in graph.items():
        if module == "flodl_hf":
            continue  # the facade sits above every package
        for target in targets:
            a, b = ".".join(module.split(".")[:2]), ".".join(target.split(".")[:2])
            if a != b:
                packages[a].add(b)
    assert cycles(packages) == []


def test_the_cycle_check_sees_imports_inside_functions():
    graph = {"a": {"b"}, "b": set()}
    assert cycles(graph) == []
    tree_graph = import_graph()
    # core.modeling reaches the registry only inside functions (get_family): the graph has that edge
    assert "flodl_hf.core.registry" in tree_graph["flodl_hf.core.modeling"]
    graph["b"].add("a")
    assert cycles(graph) == [["a", "b"]]


def test_no_library_module_is_over_800_lines():
    long = {str(path.relative_to(ROOT)): n for path in _library_files().values()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_no_import_by_name_outside_the_known_places():
    found = set()
    for path in _library_files().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = ast.unparse(node.func)
                if name.endswith("import_module") or name == "__import__":
                    found.add(str(path.relative_to(ROOT)))
    assert found == set(DYNAMIC_IMPORTS)


def _installed_layout(tmp_path: Path) -> Path:
    """A copy of the package as a wheel lays it out, with the project's import contracts beside it."""
    tree = tmp_path / "tree"
    ignore = shutil.ignore_patterns("__pycache__")
    # a worktree may link flodl_hf/families and flodl_hf/heads to the folders beside it: those are copied below
    package = shutil.ignore_patterns("__pycache__", "families", "heads")
    shutil.copytree(ROOT / "flodl_hf", tree / "flodl_hf", ignore=package)
    shutil.copytree(ROOT / "families", tree / "flodl_hf" / "families", ignore=ignore)
    shutil.copytree(ROOT / "heads", tree / "flodl_hf" / "heads", ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    return tree


def _lint_imports(tree: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(exe), "--no-cache"], cwd=tree, capture_output=True, text=True, timeout=300,
                          env={"PATH": str(exe.parent), "PYTHONPATH": str(tree)})


def test_lint_imports_keeps_the_layer_and_independence_contracts(tmp_path):
    result = _lint_imports(_installed_layout(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 2 kept, 0 broken." in result.stdout


@pytest.mark.parametrize("module, line", [
    ("core/config.py", "def _probe():\n    from flodl_hf.auto import load_model\n"),  # inside a function
    ("training/records.py", "def _probe():\n    from flodl_hf.roundtrip import parity\n"),  # a sibling
    ("heads/masked_lm.py", "def _probe():\n    from flodl_hf.auto import load_model\n"),  # an optional layer, present
])
def test_lint_imports_refuses_an_upward_import_even_inside_a_function(tmp_path, module, line):
    tree = _installed_layout(tmp_path)
    target = tree / "flodl_hf" / module
    target.write_text(target.read_text() + "\n\n" + line)
    result = _lint_imports(tree)
    assert result.returncode != 0 and "BROKEN" in result.stdout


def test_import_flodl_hf_imports_no_layer():
    code = ("import sys, flodl_hf; layers = [m for m in sys.modules if m.startswith('flodl_hf.') and "
            "m not in ('flodl_hf.core', 'flodl_hf.core.slots', 'flodl_hf.core.version')]; "
            "print(sorted(layers), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[] False"


def test_every_top_level_name_loads_from_its_module():
    import flodl_hf
    for name in flodl_hf.__all__:
        value = getattr(flodl_hf, name)
        assert getattr(value, "__name__", name) == name
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        flodl_hf.nothing_here  # noqa: B018
