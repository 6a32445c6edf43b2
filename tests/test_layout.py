# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""The package's shape, which a newcomer reads first: no import circles, only `vllm_integration`
imports vLLM, the design doc's layout lists every module, and no class or function grows past
what can be read at once."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "vllm_selfspec"
MAX_FUNCTION_LINES = 80
MAX_PROPOSER_LINES = 150  # proposer.py, the step loop on one page: its model-free stages are draft_pipeline


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: Path, known: dict[str, Path], name: str) -> set[str]:
    """The package's modules `path` imports, lazily inside functions too (a lazy import still
    ties the two modules together)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        found |= {t for t in targets if t in known and t != name}
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, known, name) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_no_module_of_the_package_imports_itself_back_through_others():
    assert cycles(graph()) == []


def test_the_cycle_finder_finds_a_circle():  # what would make the test above fail
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_only_vllm_integration_imports_vllm():
    for name, path in modules().items():
        if name.startswith("vllm_selfspec.vllm_integration"):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert not any(a.name.split(".")[0] == "vllm" for a in node.names), name
            elif isinstance(node, ast.ImportFrom) and not node.level:
                assert (node.module or "").split(".")[0] != "vllm", name


def test_the_design_docs_layout_lists_every_module():
    """The layout block lists the modules; those of `vllm_integration/` may be in the patch table."""
    design = (ROOT / "docs" / "design.md").read_text()
    layout = design.split("## Code layout", 1)[1]
    patch_table = design.split("## vLLM patches", 1)[1].split("## ", 1)[0]
    for path in modules().values():
        if path.name == "__init__.py":
            continue  # a package is listed by its folder
        where = patch_table + layout if path.parent.name == "vllm_integration" else layout
        assert re.search(rf"\b{re.escape(path.name)}\b", where), f"docs/design.md's layout does not list {path.name}"


def _long_definitions(path: Path, limit: int) -> list[str]:
    tree = ast.parse(path.read_text())
    return [
        f"{path.name}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > limit
    ]


def test_no_function_in_the_package_is_longer_than_a_screen_or_two():
    assert [d for path in modules().values() for d in _long_definitions(path, MAX_FUNCTION_LINES)] == []


def test_the_proposer_reads_as_its_loop():
    assert len((PACKAGE / "proposer.py").read_text().splitlines()) <= MAX_PROPOSER_LINES


@pytest.mark.parametrize(
    "name",
    [
        "control.first_tokens",
        "scheduler_note",
        "control",
        "control.planner",
        "sources.lookup",
        "control.learning",
        "sources.row_lookup",
        "draft_pipeline",
    ],
)
def test_pure_parts_import_no_torch(name):
    path = modules()[f"vllm_selfspec.{name}"]
    assert "import torch" not in path.read_text()


def test_one_module_sets_an_attribute_on_vllms_objects_and_only_through_the_note():
    """The scheduler-worker contract has one owner (`scheduler_note`): nothing else hangs loose
    names on vLLM's objects (patches go through `vllm_integration.patching`)."""
    setters = [
        str(path.relative_to(PACKAGE))
        for path in modules().values()
        if path.name != "patching.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr"
    ]
    assert setters == ["scheduler_note.py"]
