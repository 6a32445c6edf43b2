# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""The lab stays small: the README and docs/results.md keep to their line budgets, results.md's
tables hold numbers and short phrases, and benchmarks/diagnostics/ holds only what its index
names, each script cited by a doc or used by a test. Reads files only; imports nothing heavy."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DIAGNOSTICS = ROOT / "benchmarks" / "diagnostics"
BUDGETS = {"README.md": 200, "docs/results.md": 300}
# A table cell longer than this is a paragraph; its explanation belongs under the table.
MAX_CELL_CHARS = 80


@pytest.mark.parametrize("name", sorted(BUDGETS))
def test_a_doc_keeps_to_its_line_budget(name):
    lines = len((ROOT / name).read_text().splitlines())
    assert lines <= BUDGETS[name], f"{name} has {lines} lines, its budget is {BUDGETS[name]}"


def test_results_tables_hold_no_paragraphs():
    long_cells = [
        (number, cell.strip())
        for number, line in enumerate((ROOT / "docs" / "results.md").read_text().splitlines(), 1)
        if line.startswith("|")
        for cell in line.strip().strip("|").split("|")
        if len(cell.strip()) > MAX_CELL_CHARS
    ]
    assert not long_cells, f"cells past {MAX_CELL_CHARS} characters: {long_cells}"


def diagnostics_index() -> list[str]:
    """The names the package docstring lists, one `- `name`: what it measures` line each."""
    return re.findall(r"^- `(\w+)`:", (DIAGNOSTICS / "__init__.py").read_text(), flags=re.MULTILINE)


def test_the_diagnostics_index_names_exactly_the_scripts_in_the_folder():
    index = diagnostics_index()
    scripts = sorted(path.stem for path in DIAGNOSTICS.glob("*.py") if path.name != "__init__.py")
    assert len(index) == len(set(index)), f"named twice: {sorted({n for n in index if index.count(n) > 1})}"
    assert sorted(index) == scripts, (
        f"in the folder, not the index: {sorted(set(scripts) - set(index))}; "
        f"in the index, not the folder: {sorted(set(index) - set(scripts))}"
    )


def test_every_diagnostic_is_cited_by_a_doc_or_used_by_a_test():
    texts = [(ROOT / "README.md").read_text(), (ROOT / "benchmarks" / "NOTES.md").read_text()]
    texts += [path.read_text() for path in sorted((ROOT / "docs").glob("*.md"))]
    texts += [path.read_text() for path in sorted((ROOT / "tests").glob("*.py")) if path.name != "test_house.py"]
    corpus = "\n".join(texts)
    uncited = [
        name
        for name in diagnostics_index()
        if not re.search(rf"diagnostics[./]{name}\b|from benchmarks\.diagnostics import [\w, ]*\b{name}\b", corpus)
    ]
    assert not uncited, f"no doc cites and no test uses {uncited}: move them to git history"


def test_every_source_file_carries_its_licence_as_vllms_files_do():
    sources = [
        path
        for folder in ("vllm_selfspec", "benchmarks", "tests", "scripts")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if "results" not in path.relative_to(ROOT).parts
    ]
    unlicensed = [
        str(path.relative_to(ROOT))
        for path in sources
        if "# SPDX-License-Identifier: Apache-2.0" not in path.read_text().splitlines()[:3]
    ]
    assert sources and not unlicensed


def test_every_kept_result_names_a_commit_this_tree_descends_from():
    """A kept result folder says which code it measured: each environment.json under
    benchmarks/results names a commit (`benchmarks.run.measured_commit`), and that commit is an
    ancestor of HEAD, so that `git checkout` of it reproduces the run's code."""
    import json
    import subprocess

    def git(*args) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)

    if git("rev-parse", "--is-shallow-repository").stdout.strip() == "true":
        pytest.skip("a shallow clone holds no history to check the commits against")
    results = ROOT / "benchmarks" / "results"
    folders = sorted(p for p in results.iterdir() if p.is_dir())
    named = {}
    for folder in folders:
        environments = sorted(folder.rglob("environment.json"))
        assert environments, f"{folder.name} has no environment.json naming the commit it was measured on"
        for path in environments:
            commit = str(json.loads(path.read_text()).get("commit") or "").split(" ")[0]
            assert re.fullmatch(r"[0-9a-f]{7,40}", commit), f"{path.relative_to(ROOT)} names no commit"
            named[path] = commit
    for path, commit in named.items():
        ancestor = git("merge-base", "--is-ancestor", commit, "HEAD")
        assert ancestor.returncode == 0, f"{path.relative_to(ROOT)}: {commit} is not an ancestor of HEAD"
