# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""Code edits with and without OpenAI's `prediction`, served by `vllm serve` per method.

    .venv/bin/python -m benchmarks.predicted_edits                         # Qwen2.5-Coder-1.5B
    .venv/bin/python -m benchmarks.predicted_edits --model smollm2-135m --edits 4 --rounds 1

The workload: functions from the Python standard library's own source (the interpreter running
this script), each with one instruction a developer gives an assistant: rename a parameter, add
a parameter, add type hints, write a docstring, or fix a planted bug (one comparison turned
around, the line named). The request is a chat message holding the instruction and the code;
its `prediction` is the code as the client has it (for a planted bug, the buggy code), which is
what an editor sends. Greedy answers, each capped at 1.5x the code's tokens plus 64.

Servers, one at a time, each with the same flags and `--k` draft tokens: plain, ngram, suffix
and self-admg; the self-admg server is sent every edit twice, without and with the prediction.
Every request carries a `cache_salt` of its own, so no request is served from another's prefix
cache or (self-admg) drafted from another's history. Two loads: "light" sends one request at a
time; "capacity" keeps `--concurrency` in flight. Per request: time to first token and time per
output token from the stream, the answer, and the usage OpenAI reports (accepted and rejected
prediction tokens). Each round starts every server anew, the order rotated.

Writes to --out (default: a dated folder in the cache, outside the repository): requests.csv
(every request), table.md (per method and load: time per output token and output throughput
against plain's in the same round, each request's speed against its own plain answer, answers
identical to plain's, prediction tokens accepted and rejected), tpot.png, environment.json and
the servers' logs.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import csv
import importlib
import importlib.util
import inspect
import json
import random
import statistics
import sys
import textwrap
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.engine import bind_worker_cores
from benchmarks.output import default_out
from benchmarks.serve_load import VllmServer, markdown_table, server_flags
from benchmarks.serving import Server, proposer_state, spent

# Modules of pure Python whose functions read as everyday code.
MODULES = (
    "textwrap", "shlex", "fnmatch", "heapq", "bisect", "calendar", "difflib", "statistics",
    "string", "ipaddress", "base64", "colorsys", "posixpath", "glob", "csv", "fractions",
    "gettext", "html", "mimetypes", "quopri", "random", "sched", "smtplib", "tokenize",
)  # fmt: skip
EDITS = ("rename", "parameter", "type hints", "docstring", "bug")
LINES = (10, 40)  # a function's length in lines, so that answers run 100-500 tokens
SYSTEM = "You edit Python code. Answer with the whole edited function in one ```python code block, and nothing else."
# A planted bug: the first of these in a function's body, turned around.
BUGS = ((" < ", " >= "), (" > ", " <= "), (" == ", " != "), (" + 1", " - 1"), (" not in ", " in "))


@dataclass(frozen=True)
class Edit:
    name: str  # module.function
    kind: str
    instruction: str
    code: str  # the code the request holds, and its prediction


@dataclass
class Answer:
    round: int
    method: str  # the server's method, "+ prediction" where the request carried one
    load: str
    edit: str
    kind: str
    ttft_s: float
    tpot_s: float
    completion_tokens: int
    accepted_prediction_tokens: int | None
    rejected_prediction_tokens: int | None
    text: str


def functions() -> list[tuple[str, str]]:
    """(module.Class.function, dedented source) of the functions and methods of MODULES within
    LINES, each name once (a name two definitions share is left out)."""
    found: dict[str, str | None] = {}
    for module_name in MODULES:
        source = inspect.getsource(importlib.import_module(module_name))
        tree = ast.parse(source)
        nested = [(f"{module_name}.{c.name}.", c.body) for c in tree.body if isinstance(c, ast.ClassDef)]
        for prefix, body in [(f"{module_name}.", tree.body), *nested]:
            for node in body:
                if isinstance(node, ast.FunctionDef) and LINES[0] <= node.end_lineno - node.lineno + 1 <= LINES[1]:
                    name = prefix + node.name
                    text = textwrap.dedent(ast.get_source_segment(source, node, padded=True)).rstrip() + "\n"
                    found[name] = None if name in found else text
    return sorted((name, text) for name, text in found.items() if text is not None)


def make_edit(name: str, code: str, kind: str) -> Edit | None:
    """The instruction of `kind` for `code`, or None where it does not apply."""
    function = ast.parse(code).body[0]
    arguments = [a.arg for a in function.args.args if a.arg not in ("self", "cls")]
    if kind == "rename":
        if not arguments:
            return None
        return Edit(name, kind, f"Rename the parameter `{arguments[0]}` to `{arguments[0]}_value` everywhere.", code)
    if kind == "parameter":
        return Edit(
            name,
            kind,
            "Add a keyword-only parameter `log=None` and, when it is not None, call "
            f'`log("{function.name} called")` as the first statement of the body.',
            code,
        )
    if kind == "type hints":
        return Edit(name, kind, "Add type hints to the signature, and change nothing else.", code)
    if kind == "docstring":
        return Edit(name, kind, "Write a Google-style docstring for it, replacing any it has.", code)
    lines = code.split("\n")
    # The first comparison or `+ 1` of the code itself (not of a docstring or a comment).
    for node in sorted(ast.walk(function), key=lambda n: getattr(n, "lineno", 0)):
        if isinstance(node, (ast.Compare, ast.BinOp)) and node.lineno > function.lineno:
            line = lines[node.lineno - 1]
            for wrong, planted in BUGS:
                code_part = line.split("#", 1)[0]
                if wrong in code_part:
                    lines[node.lineno - 1] = code_part.replace(wrong, planted, 1) + line[len(code_part) :]
                    buggy = "\n".join(lines)
                    instruction = f"Line {node.lineno} has a bug: `{lines[node.lineno - 1].strip()}`. Fix it."
                    return Edit(name, kind, instruction, buggy)
    return None


def edits(count: int, seed: int) -> list[Edit]:
    """`count` edits of distinct functions, the kinds in turn (one function, one edit: vLLM's
    `suffix` keeps the answers it served for any later request, whatever its salt)."""
    candidates = functions()
    random.Random(seed).shuffle(candidates)
    chosen = []
    for name, code in candidates:
        edit = make_edit(name, code, EDITS[len(chosen) % len(EDITS)])
        if edit is not None:
            chosen.append(edit)
        if len(chosen) == count:
            return chosen
    raise SystemExit(f"--edits {count}: only {len(chosen)} functions found")


def chat_messages(edit: Edit) -> list[dict]:
    """The edit as a chat client sends it: the system prompt, the instruction and the code."""
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"{edit.instruction}\n\n```python\n{edit.code}```"},
    ]


async def one_answer(client, model: str, edit: Edit, max_tokens: int, predicted: bool, salt: str) -> dict:
    messages = chat_messages(edit)
    extra = {"prediction": {"type": "content", "content": edit.code}} if predicted else {}
    start = time.perf_counter()
    stream = await client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"cache_salt": salt, **extra},
    )
    first = last = None
    text, usage = [], None
    async for chunk in stream:
        if chunk.choices:  # the last one, with the finish reason, may carry no text
            last = time.perf_counter()
            if chunk.choices[0].delta.content:
                first = first or last
                text.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage = chunk.usage
    if usage is None or first is None:
        raise RuntimeError(f"{edit.name}: the stream ended without text or without usage")
    details = getattr(usage, "completion_tokens_details", None)
    tokens = usage.completion_tokens
    return {
        "ttft_s": first - start,
        "tpot_s": max(last - first, 1e-6) / max(tokens - 1, 1),
        "completion_tokens": tokens,
        "accepted_prediction_tokens": getattr(details, "accepted_prediction_tokens", None),
        "rejected_prediction_tokens": getattr(details, "rejected_prediction_tokens", None),
        "text": "".join(text),
    }


async def serve_edits(server: VllmServer, work: list[tuple[Edit, int]], predicted: bool, concurrency: int, tag: str):
    """Every edit's answer, `concurrency` in flight, and the wall time they took."""
    gate = asyncio.Semaphore(concurrency)
    async with server.async_client(timeout=1800, max_retries=0) as client:

        async def limited(i: int, edit: Edit, max_tokens: int) -> dict:
            async with gate:
                return await one_answer(client, server.model, edit, max_tokens, predicted, f"{tag}-{i}")

        start = time.perf_counter()
        answers = await asyncio.gather(*(limited(i, edit, cap) for i, (edit, cap) in enumerate(work)))
        return answers, time.perf_counter() - start


def run_server(method: str, config: dict | None, work: dict[str, list[Edit]], args, round_: int, out: Path) -> None:
    """One server's answers at both loads (a self-admg server's without and with predictions, in
    turn first), each load's appended to answers.jsonl and its wall time to walls.jsonl."""
    spec = Server(method, config)  # (a self-admg server answers for its proposer)
    common = server_flags(args.model_path, args.dtype, args.max_model_len, kv_cache_gb=4, seed=0)
    log = out / f"{method}-round{round_}.log"
    variants = [False, True] if spec.reports_proposer else [False]
    variants = variants[round_ % len(variants) :] + variants[: round_ % len(variants)]
    env = spec.env(bind_worker_cores().binding)
    with VllmServer(args.model_path, *spec.args(common), log_path=log, env=env) as server:
        warm = [(work["warm-up"][0], 64)] * 4  # batched shapes too, each request with a salt of its own
        asyncio.run(serve_edits(server, warm, False, len(warm), f"warm-{round_}"))
        for load, concurrency in (("light", 1), ("capacity", args.concurrency)):
            chosen = [(edit, max_tokens(args.tokenizer, edit)) for edit in work[load]]
            for predicted in variants:
                name = method + (" + prediction" if predicted else "")
                before = proposer_state(server, spec)
                results, wall = asyncio.run(
                    serve_edits(server, chosen, predicted, concurrency, f"{round_}-{load}-{name}")
                )
                print(f"round {round_} {load:8} {name:24} {wall:6.1f} s", flush=True)
                answers = [
                    Answer(round_, name, load, edit.name, edit.kind, **r) for (edit, _), r in zip(chosen, results)
                ]
                with open(out / "answers.jsonl", "a") as f:
                    f.writelines(json.dumps(asdict(answer)) + "\n" for answer in answers)
                # What the proposer drafted and where its time went (PROPOSER_COUNTERS, differences).
                proposer = spent(before, proposer_state(server, spec))
                wall_note = {"round": round_, "load": load, "method": name, "wall_s": wall, "proposer": proposer}
                with open(out / "walls.jsonl", "a") as f:
                    f.write(json.dumps(wall_note) + "\n")


def max_tokens(tokenizer, edit: Edit) -> int:
    return int(1.5 * len(tokenizer(edit.code)["input_ids"])) + 64


def spread(values: list[float]) -> str:
    """The median, with the rounds' range where there are several."""
    middle = f"{statistics.median(values):.2f}"
    return middle if len(values) == 1 else f"{middle} ({min(values):.2f}-{max(values):.2f})"


def summarize(answers: list[Answer], walls: dict[tuple, float]) -> list[dict]:
    """One row per method and load: each ratio against plain's in the same round, over rounds."""
    groups: dict[tuple, list[Answer]] = {}
    for answer in answers:
        groups.setdefault((answer.round, answer.load, answer.method), []).append(answer)
    rounds = sorted({a.round for a in answers})
    methods = list(dict.fromkeys(a.method for a in answers))
    rows = []
    for load in ("light", "capacity"):
        for method in methods:
            measured = []
            for round_ in rounds:
                mine, plain = groups.get((round_, load, method)), groups.get((round_, load, "plain"))
                if not mine or not plain:
                    continue
                plain_by_edit = {a.edit: a for a in plain}
                speeds = sorted(plain_by_edit[a.edit].tpot_s / a.tpot_s for a in mine)

                def throughput(group, name, key=(round_, load)):
                    return sum(a.completion_tokens for a in group) / walls[(*key, name)]

                measured.append(
                    {
                        "tpot_ms": 1000 * statistics.mean(a.tpot_s for a in mine),
                        "tpot_x": statistics.mean(a.tpot_s for a in plain) / statistics.mean(a.tpot_s for a in mine),
                        "throughput_x": throughput(mine, method) / throughput(plain, "plain"),
                        "p10": speeds[len(speeds) // 10],
                        "slowest": speeds[0],
                        "identical": sum(a.text == plain_by_edit[a.edit].text for a in mine),
                        "requests": len(mine),
                        "accepted": sum(a.accepted_prediction_tokens or 0 for a in mine),
                        "rejected": sum(a.rejected_prediction_tokens or 0 for a in mine),
                    }
                )
            if not measured:
                continue
            rows.append(
                {
                    "load": load,
                    "method": method,
                    "TPOT ms": spread([m["tpot_ms"] for m in measured]),
                    "speed per token (x plain)": spread([m["tpot_x"] for m in measured]),
                    "output throughput (x plain)": spread([m["throughput_x"] for m in measured]),
                    "per request: 10th pct / slowest": "{:.2f} / {:.2f}".format(
                        statistics.median(m["p10"] for m in measured), min(m["slowest"] for m in measured)
                    ),
                    "identical to plain": "{}/{}".format(
                        sum(m["identical"] for m in measured), sum(m["requests"] for m in measured)
                    ),
                    "prediction accepted / rejected": (
                        f"{sum(m['accepted'] for m in measured)} / {sum(m['rejected'] for m in measured)}"
                        if "prediction" in method
                        else ""
                    ),
                }
            )
    return rows


def proposer_note(proposers: dict[tuple, dict | None], load: str, method: str) -> str:
    """A self-admg server's own time per step and its lookup drafts (prediction's included),
    summed over rounds; empty for other methods."""
    spent_ = [p for (_, at, name), p in proposers.items() if (at, name) == (load, method) and p]
    calls = sum(p["propose_calls"] for p in spent_)
    if not calls:
        return ""
    ms = 1000 * sum(p["propose_seconds"] for p in spent_) / calls
    accepted = sum(p["lookup_accepted"] + p.get("prediction_accepted", 0) for p in spent_)
    return f"{ms:.2f}, {accepted}/{sum(p['lookup_tokens'] for p in spent_)}"


def plain_spread(answers: list[Answer], walls: dict[tuple, float]) -> str:
    """Plain's own round-to-round spread: each round's mean TPOT over the rounds' median."""
    notes = []
    for load in ("light", "capacity"):
        means = [
            statistics.mean(a.tpot_s for a in answers if (a.round, a.load, a.method) == (r, load, "plain"))
            for r in sorted({a.round for a in answers})
        ]
        middle = statistics.median(means)
        notes.append(f"{load} {min(means) / middle:.2f}-{max(means) / middle:.2f}")
    return "plain's rounds, mean TPOT over their median: " + ", ".join(notes)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for axis, load, column in (
        (axes[0], "light", "speed per token (x plain)"),
        (axes[1], "capacity", "output throughput (x plain)"),
    ):
        chosen = [row for row in rows if row["load"] == load]
        values = [float(row[column].split()[0]) for row in chosen]
        axis.bar([row["method"].replace(" + ", "\n+ ") for row in chosen], values, color="tab:blue")
        axis.axhline(1, color="grey", linewidth=1)
        axis.set_ylim(0, 1.15 * max(values))  # room for the labels
        axis.set_title(f"{load}: {column}")
        for i, value in enumerate(values):
            axis.text(i, value, f"{value:.2f}", ha="center", va="bottom")
    figure.suptitle("Code edits: plain, ngram, suffix, self-admg without and with a prediction (medians of rounds)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="a project model name or a local directory")
    parser.add_argument("--dtype", default=None, help="default: the CPU's native choice")
    parser.add_argument("--methods", nargs="+", default=["plain", "ngram", "suffix", "self-admg"])
    parser.add_argument("--k", type=int, default=8, help="num_speculative_tokens for every method")
    parser.add_argument(
        "--self-admg-options", type=json.loads, default={}, help="""self-admg's options: '{"adaptive": false}'"""
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--edits", type=int, default=16, help="edits at capacity")
    parser.add_argument("--light-edits", type=int, default=8, help="the first edits, sent one at a time")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight at capacity")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0, help="which functions are edited")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--summarize", type=Path, default=None, help="only write the table of this run's folder")
    args = parser.parse_args(argv)
    from benchmarks.run import method_configs

    if args.methods[0] != "plain" or not set(args.methods) <= set(method_configs(None)):
        parser.error(f"--methods: plain first, then any of {sorted(method_configs(None))}")
    if "suffix" in args.methods and importlib.util.find_spec("arctic_inference") is None:
        parser.error("--methods suffix: vLLM's suffix method needs arctic-inference (`make bench` installs it)")
    return args


def main(argv=None) -> Path:
    from transformers import AutoTokenizer

    from benchmarks import assets
    from benchmarks.engine import bind_worker_cores, choose_dtype
    from benchmarks.run import environment, method_configs

    args = parse_args(argv)
    if args.summarize:
        write_results(args.summarize, json.loads((args.summarize / "arguments.json").read_text()))
        return args.summarize
    args.dtype, args.dtype_reason = choose_dtype(args.dtype)
    print(f"cores {bind_worker_cores().reason}; dtype {args.dtype_reason}", flush=True)
    out = args.out or default_out("predicted-edits")
    out.mkdir(parents=True, exist_ok=True)
    (out / "environment.json").write_text(json.dumps(environment(args), indent=2, default=str))
    args.model_path = assets.model_or_path(args.model)
    args.tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    # Light load, capacity and the warm-up each edit functions of their own.
    chosen = edits(args.light_edits + args.edits + 1, args.seed)
    work = {"light": chosen[: args.light_edits], "capacity": chosen[args.light_edits : -1], "warm-up": chosen[-1:]}
    described = {
        "command": "python -m benchmarks.predicted_edits " + " ".join(sys.argv[1:]),
        "model": args.model,
        "dtype": args.dtype,
        **{k: getattr(args, k) for k in ("k", "rounds", "light_edits", "edits", "concurrency", "self_admg_options")},
    }
    (out / "arguments.json").write_text(json.dumps(described, indent=2))
    configs = method_configs(None)
    for round_ in range(args.rounds):
        shift = round_ % len(args.methods)
        for method in args.methods[shift:] + args.methods[:shift]:
            config = configs[method] and {**configs[method], "num_speculative_tokens": args.k}
            if method == "self-admg":
                config.update(args.self_admg_options)
            run_server(method, config, work, args, round_, out)
    write_results(out, described)
    return out


def write_results(out: Path, described: dict) -> None:
    answers = [Answer(**json.loads(line)) for line in (out / "answers.jsonl").read_text().splitlines()]
    walls, proposers = {}, {}
    for line in (out / "walls.jsonl").read_text().splitlines():
        wall = json.loads(line)
        key = (wall["round"], wall["load"], wall["method"])
        walls[key], proposers[key] = wall["wall_s"], wall.get("proposer")
    with open(out / "requests.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(answers[0])))
        writer.writeheader()
        writer.writerows(asdict(a) for a in answers)
    rows = summarize(answers, walls)
    for row in rows:
        row["proposer: ms/step, drafts accepted/made"] = proposer_note(proposers, row["load"], row["method"])
    d = described
    table = (
        f"# Code edits with and without a prediction\n\n`{d['command']}`\n\n"
        f"{d['model']}, {d['dtype']}, K = {d['k']}, {d['rounds']} rounds; light: {d['light_edits']} edits one at a "
        f"time; capacity: {d['edits']} other edits, {d['concurrency']} in flight. Ratios against plain in the same "
        f"round: medians (range over rounds). Per request: plain's TPOT over the method's, same edit, same round.\n\n"
        f"{markdown_table(rows)}\n\n{plain_spread(answers, walls)}\n"
    )
    (out / "table.md").write_text(table)
    plot(rows, out / "tpot.png")
    print(table)


if __name__ == "__main__":
    main()
