# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""A fault in drafting costs that step's drafts, never a request: the pure rule, and faults
injected at each stage of a real engine's step (`pytest -k injected_fault` runs the latter)."""

import logging

import pytest

from vllm_selfspec.operations import fail_safe
from vllm_selfspec.operations.fail_safe import (
    COOL_DOWN_STEPS,
    MAX_CONSECUTIVE_FAULTS,
    MAX_FAULTS_IN_WINDOW,
    WINDOW_STEPS,
    FailSafe,
)

from conftest import close_llm, make_llm, proposer_report, token_ids
from fault_injection import INJECT_ENV, FaultInjector, InjectedFault, Injection, parse

# Lookup drafts where the context repeats, self-drafts elsewhere, all of them every step (no
# cost control), so that every stage runs in every step.
# The random tiny model is unsure of every token: no draft exit, or self-drafts would stop at once.
EVERY_STAGE = {
    "method": "self-admg",
    "num_speculative_tokens": 3,
    "adaptive": False,
    "draft_exit_threshold": 0.0,
    "keep_edge_layers": 0,
    "attention_threshold": 0.5,
    "mlp_threshold": 0.5,
}


def test_fail_safe_serves_the_fallback_and_switches_off_after_faults_in_a_row(caplog):
    safe, calls = FailSafe(), []

    def failing():
        calls.append(1)
        raise ValueError("boom")

    with caplog.at_level(logging.WARNING, logger="vllm.selfspec"):
        assert safe.call(lambda: "drafts", lambda: "none") == "drafts"
        assert [safe.call(failing, lambda: "none") for _ in range(2)] == ["none", "none"]
        assert safe.call(lambda: "drafts", lambda: "none") == "drafts"  # a success resets the run
        assert [safe.call(failing, lambda: "none") for _ in range(MAX_CONSECUTIVE_FAULTS)] == ["none"] * 3
        assert safe.switch_off_wanted and not safe.disabled  # switched off where the ranks agree
        assert not safe.agree(True)[0]
        assert safe.disabled and safe.faults == 2 + MAX_CONSECUTIVE_FAULTS
        assert safe.call(failing, lambda: "none") == "none" and len(calls) == safe.faults  # not called again
        safe.record(ValueError("a clean-up fault after switch-off"))
        assert not safe.agree(True)[0]
    with_traceback = [r for r in caplog.records if r.exc_info]
    assert len(with_traceback) == 1  # the first fault of a kind, with its traceback
    assert sum(r.levelno == logging.ERROR for r in caplog.records) == 1  # one ERROR line, ever
    assert sum("switched off" in r.message for r in caplog.records) == 1


def agree_on_all(ranks: list[FailSafe], oks: list[bool], votes=None) -> list[bool]:
    """One agreement among `ranks` (FailSafes standing for tensor-parallel ranks), each having
    done its own part of the step (`oks`) and cast its `votes`: the all-reduce, simulated."""
    votes = votes or [()] * len(ranks)
    flags = [[int(not ok), int(rank.switch_off_wanted), *v] for rank, ok, v in zip(ranks, oks, votes)]
    agreed = [max(column) for column in zip(*flags)]
    for rank in ranks:
        rank.max_over_ranks = lambda own, agreed=agreed: agreed
    results = [rank.agree(ok, v) for rank, ok, v in zip(ranks, oks, votes)]
    assert all(result[1] == results[0][1] for result in results)  # every rank the same decisions
    return [may_draft for may_draft, _ in results]


def test_a_fault_or_a_switch_off_on_one_rank_is_every_ranks(caplog):
    ranks = [FailSafe(), FailSafe()]
    assert agree_on_all(ranks, [True, True]) == [True, True]
    # Rank 1 faults in its own part of the step: both skip drafting, only rank 1 counts a fault.
    assert ranks[1].attempt(lambda: 1 / 0) is None
    assert agree_on_all(ranks, [True, False]) == [False, False]
    assert [r.steps_skipped for r in ranks] == [1, 1] and [r.faults for r in ranks] == [0, 1]
    # Rank 1 reaches its limit: both switch off in the same step, and stay off.
    for _ in range(MAX_CONSECUTIVE_FAULTS):
        ranks[1].record(ValueError("boom"))
    assert agree_on_all(ranks, [True, True]) == [False, False]
    assert [r.disabled for r in ranks] == [True, True]
    assert [r.agree(True)[0] for r in ranks] == [False, False]  # no collective once off everywhere


def test_a_fault_after_the_agreement_costs_every_rank_the_step_and_only_its_rank_a_fault():
    """Past the agreement, a rank's own fault stops every rank at the next checkpoint: the rank
    that faulted counts it, the others see `RanksStopped`; all skip the step alike."""
    from vllm_selfspec.operations.fail_safe import RanksStopped

    ranks = [FailSafe(), FailSafe()]

    def stopped():
        raise RanksStopped("rank 1 faulted")

    no_drafts = lambda: "no drafts"  # noqa: E731
    assert ranks[0].call(stopped, no_drafts) == "no drafts"
    assert ranks[1].call(lambda: 1 / 0, no_drafts) == "no drafts"
    assert [r.steps_skipped for r in ranks] == [1, 1] and [r.faults for r in ranks] == [0, 1]
    assert [r.consecutive for r in ranks] == [0, 1]
    assert ranks[0].call(lambda: "drafts", no_drafts) == "drafts"


def test_the_ranks_share_their_other_decisions_by_their_maximum():
    ranks = [FailSafe(), FailSafe()]
    for rank, vote in zip(ranks, (0, 1)):
        rank.max_over_ranks = lambda own: [0, 0, 1]
        assert rank.agree(True, (vote,)) == (True, [1])


def test_faults_spread_over_more_than_the_window_never_switch_drafting_off():
    """Rare transient faults over a long-running server: the budget counts the last
    WINDOW_STEPS steps, not the engine's lifetime."""
    safe = FailSafe()
    for _ in range(5 * MAX_FAULTS_IN_WINDOW):
        for _ in range(WINDOW_STEPS // (MAX_FAULTS_IN_WINDOW - 1) + 1):  # the closest spacing that never fits them all
            safe.tick()
            assert safe.agree(True)[0]
            assert safe.call(lambda: "drafts", lambda: "none") == "drafts"
        safe.record(ValueError("transient"))
    assert safe.faults == 5 * MAX_FAULTS_IN_WINDOW and not safe.switch_off_wanted and not safe.disabled
    for _ in range(MAX_FAULTS_IN_WINDOW):  # the same faults within one window: off
        safe.tick()
        safe.record(ValueError("burst"))
        safe.call(lambda: "drafts", lambda: "none")  # (not in a row: each step after a fault succeeds)
    assert safe.switch_off_wanted


def switch_off(ranks: list[FailSafe]) -> None:
    """Faults in a row on rank 0, then the step where every rank agrees to switch off."""
    for _ in range(MAX_CONSECUTIVE_FAULTS):
        ranks[0].record(ValueError("boom"))
    for rank in ranks:
        rank.tick()
    assert agree_on_all(ranks, [True] * len(ranks)) == [False] * len(ranks)
    assert all(rank.disabled for rank in ranks)


def test_drafting_comes_back_after_a_cool_down_on_every_rank_and_backs_off_if_faults_return(caplog):
    ranks = [FailSafe(), FailSafe()]
    switch_off(ranks)
    for _ in range(COOL_DOWN_STEPS - 1):
        for rank in ranks:
            rank.tick()
    assert all(rank.disabled for rank in ranks)
    with caplog.at_level(logging.WARNING, logger="vllm.selfspec"):
        for rank in ranks:
            rank.tick()
    assert not any(rank.disabled for rank in ranks)  # the same step on every rank
    assert sum("drafts again" in r.message for r in caplog.records) == 2
    assert agree_on_all(ranks, [True, True]) == [True, True]
    # Faults again within the probation window: off again, for twice as long.
    switch_off(ranks)
    assert [rank.resume_at - rank.step for rank in ranks] == [2 * COOL_DOWN_STEPS] * 2
    for _ in range(2 * COOL_DOWN_STEPS):
        for rank in ranks:
            rank.tick()
    assert not any(rank.disabled for rank in ranks)
    # A clean window after that: the next switch-off starts from the first cool-down again.
    for _ in range(WINDOW_STEPS):
        for rank in ranks:
            rank.tick()
    switch_off(ranks)
    assert [rank.resume_at - rank.step for rank in ranks] == [COOL_DOWN_STEPS] * 2


def test_a_quarantined_request_and_its_prompt_draft_no_more_and_the_rest_still_do():
    import numpy as np

    from vllm_selfspec.operations.fail_safe import RequestQuarantine

    quarantine = RequestQuarantine(max_prompts=2)
    poison, other = np.array([1, 2, 3]), np.array([4, 5, 6])
    assert quarantine.allows("a", lambda: ("t", poison)) and quarantine.allows("b", lambda: ("t", other))
    quarantine.blame("a", "t", poison)
    assert not quarantine.allows("a", lambda: ("t", poison)) and quarantine.allows("b", lambda: ("t", other))
    assert not quarantine.allows("a-again", lambda: ("t", poison))  # the same prompt resent
    assert quarantine.allows("c", lambda: ("another tenant", poison))  # never across tenants
    for req_id in ("a", "a-again", "b", "c"):
        quarantine.forget(req_id)
    assert quarantine.requests == set() and quarantine._digests == {}  # nothing kept of ended requests
    for i in range(5):  # bounded: the oldest prompts are let go
        quarantine.blame(f"x{i}", "t", np.array([100 + i]))
    assert len(quarantine.prompts) == 2 and quarantine.allows("a-third-time", lambda: ("t", poison))


def test_faults_of_single_requests_are_not_faulted_steps():
    """Three requests whose own lookups fault in one step cost those requests their drafts; they
    are no run of faulted steps (only many within the window switch drafting off)."""
    safe = FailSafe()
    safe.tick()
    for _ in range(MAX_CONSECUTIVE_FAULTS):
        safe.record(ValueError("one request's"), one_request=True)
    assert not safe.switch_off_wanted and safe.agree(True)[0]
    for _ in range(MAX_FAULTS_IN_WINDOW - MAX_CONSECUTIVE_FAULTS):
        safe.record(ValueError("one request's"), one_request=True)
    assert safe.switch_off_wanted


def test_fault_points_raise_only_where_and_when_asked(monkeypatch):
    monkeypatch.setattr(fail_safe, "fault_hook", FaultInjector("probe@2,draft@every"))
    fail_safe.fault_point("probe")
    with pytest.raises(InjectedFault, match="probe"):
        fail_safe.fault_point("probe")
    fail_safe.fault_point("probe")
    fail_safe.fault_point("lookup")
    for _ in range(3):
        with pytest.raises(InjectedFault):
            fail_safe.fault_point("draft")
    with pytest.raises(ValueError, match="unknown stage"):
        parse("verify@1")
    assert parse("lookup@5@rank1") == {"lookup": Injection(5, 1, None)}
    assert parse("draft@2@rank1") == {"draft": Injection(2, 1, None)}  # after the agreement too
    assert parse("lookup@token7") == {"lookup": Injection(None, None, 7)}
    monkeypatch.setattr(fail_safe, "fault_hook", None)
    fail_safe.fault_point("draft")  # production: no hook, no fault


def run_with_faults(model, prompts, spec, monkeypatch):
    from vllm import SamplingParams

    monkeypatch.setenv(INJECT_ENV, spec)
    llm = make_llm(model, speculative_config=EVERY_STAGE)
    try:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
        return token_ids(outputs), proposer_report(llm)
    finally:
        close_llm(llm)


@pytest.fixture(scope="module")
def plain_ids(plain_tiny, tiny_prompts):
    from vllm import SamplingParams

    return token_ids(plain_tiny.generate(tiny_prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)))


@pytest.mark.engine
def test_injected_fault_at_each_stage_costs_only_that_steps_drafts(
    tiny_model_path, tiny_prompts, plain_ids, monkeypatch
):
    ids, report = run_with_faults(tiny_model_path, tiny_prompts, "lookup@3,plan@7,probe@2,draft@9", monkeypatch)
    # (probe@2: the warm-up's second, timed probe, whose fault must cost only its step's drafts)
    assert ids == plain_ids
    assert report["faults"] == 4 and not report["drafting_disabled"]
    for stage in ("lookup", "plan", "probe", "draft"):
        assert any(f"injected fault at {stage}" in kind for kind in report["fault_kinds"]), report["fault_kinds"]
    assert report["draft_tokens"] > 0 and report["lookup_tokens"] > 0  # drafting went on


@pytest.mark.engine
def test_injected_fault_every_step_switches_drafting_off_and_serves_on(
    tiny_model_path, tiny_prompts, plain_ids, monkeypatch
):
    ids, report = run_with_faults(tiny_model_path, tiny_prompts, "draft@every", monkeypatch)
    assert ids == plain_ids
    assert report["drafting_disabled"] and report["faults"] == MAX_CONSECUTIVE_FAULTS


# The hooks the plugin adds to vLLM's loop, on the runner's side and on the scheduler's.
HOOKS = ("update_states", "request_removed", "sample", "tenants", "schedule")


@pytest.mark.engine
@pytest.mark.parametrize("hook", HOOKS)
def test_a_fault_in_any_hook_keeps_the_engine_up_and_its_output_plain(
    tiny_model_path, tiny_prompts, plain_ids, monkeypatch, hook
):
    """Every call of the hook raises: the engine serves every request, exactly, and counts the
    faults (the scheduler's in the engine process, where its worker also runs)."""
    ids, report = run_with_faults(tiny_model_path, tiny_prompts, f"{hook}@every", monkeypatch)
    assert ids == plain_ids
    if hook in ("tenants", "schedule"):
        assert report["scheduler_faults"] > 0
    else:
        assert any(f"injected fault at {hook}" in kind for kind in report["fault_kinds"]), report["fault_kinds"]


def unused_token(*token_lists) -> int:
    used = {t for tokens in token_lists for t in tokens}
    return next(t for t in range(3, 512) if t not in used)  # the tiny model's vocabulary


@pytest.mark.engine
def test_one_request_that_makes_drafting_fault_resent_costs_only_its_own_drafts(
    tiny_model_path, tiny_prompt_ids, plain_tiny, monkeypatch
):
    """A request whose lookup always raises, sent more times than the fault budget allows in a
    window: it is quarantined with its prompt after its first fault, so drafting stays on for
    everyone else, and every output is plain decoding's."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    others = [{"prompt_token_ids": ids} for ids in tiny_prompt_ids]
    plain_others = token_ids(plain_tiny.generate(others, params, use_tqdm=False))
    poison_token = unused_token(*tiny_prompt_ids, *plain_others)
    poison = {"prompt_token_ids": tiny_prompt_ids[0] + [poison_token]}
    plain_poison = token_ids(plain_tiny.generate([poison], params, use_tqdm=False))
    monkeypatch.setenv(INJECT_ENV, f"lookup@token{poison_token}")
    llm = make_llm(tiny_model_path, speculative_config=EVERY_STAGE)
    try:
        for _ in range(MAX_FAULTS_IN_WINDOW + 5):
            assert token_ids(llm.generate([poison], params, use_tqdm=False)) == plain_poison
        before = proposer_report(llm)
        assert token_ids(llm.generate(others, params, use_tqdm=False)) == plain_others
        after = proposer_report(llm)
    finally:
        close_llm(llm)
    assert after["faults"] == 1 and not after["drafting_disabled"]
    assert after["lookup_tokens"] > before["lookup_tokens"] and after["draft_tokens"] > before["draft_tokens"]


def test_no_test_switch_is_read_by_the_runtime_package():
    """Fault injection and the unpatched CPU sampler live in the test suite's own plugin: no
    environment variable of theirs can change what an installed server does."""
    from pathlib import Path

    import vllm_selfspec

    package = Path(vllm_selfspec.__file__).parent
    for source in package.rglob("*.py"):
        text = source.read_text()
        for switch in ("VLLM_SELFSPEC_INJECT_FAULT", "VLLM_SELFSPEC_UNPATCHED_CPU_SAMPLER"):
            assert switch not in text, (source, switch)
