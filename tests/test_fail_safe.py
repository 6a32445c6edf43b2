"""A fault in drafting costs that step's drafts, never a request: the pure rule, and faults
injected at each stage of a real engine's step (`pytest -k injected_fault` runs the latter)."""

import logging

import pytest

from vllm_selfspec import fail_safe
from vllm_selfspec.fail_safe import INJECT_ENV, MAX_CONSECUTIVE_FAULTS, FailSafe

from conftest import close_llm, make_llm, proposer_report, token_ids

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


def test_the_ranks_share_their_other_decisions_by_their_maximum():
    ranks = [FailSafe(), FailSafe()]
    for rank, vote in zip(ranks, (0, 1)):
        rank.max_over_ranks = lambda own: [0, 0, 1]
        assert rank.agree(True, (vote,)) == (True, [1])


def test_fault_points_raise_only_where_and_when_asked(monkeypatch):
    monkeypatch.setenv(INJECT_ENV, "probe@2,draft@every")
    monkeypatch.setattr(fail_safe, "_injected", None)
    monkeypatch.setattr(fail_safe, "_calls", {})
    fail_safe.fault_point("probe")
    with pytest.raises(fail_safe.InjectedFault, match="probe"):
        fail_safe.fault_point("probe")
    fail_safe.fault_point("probe")
    fail_safe.fault_point("lookup")
    for _ in range(3):
        with pytest.raises(fail_safe.InjectedFault):
            fail_safe.fault_point("draft")
    with pytest.raises(ValueError, match="unknown stage"):
        fail_safe._parse("verify@1")
    assert fail_safe._parse("lookup@5@rank1") == {"lookup": fail_safe._Injection(5, 1, None)}
    assert fail_safe._parse("lookup@token7") == {"lookup": fail_safe._Injection(None, None, 7)}
    with pytest.raises(ValueError, match="before the ranks' agreement"):
        fail_safe._parse("draft@5@rank1")  # after the agreement a rank cannot skip alone


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


def test_injected_fault_at_each_stage_costs_only_that_steps_drafts(
    tiny_model_path, tiny_prompts, plain_ids, monkeypatch
):
    ids, report = run_with_faults(tiny_model_path, tiny_prompts, "lookup@3,plan@7,probe@1,draft@9", monkeypatch)
    assert ids == plain_ids
    assert report["faults"] == 4 and not report["drafting_disabled"]
    for stage in ("lookup", "plan", "probe", "draft"):
        assert any(f"injected fault at {stage}" in kind for kind in report["fault_kinds"]), report["fault_kinds"]
    assert report["draft_tokens"] > 0 and report["lookup_tokens"] > 0  # drafting went on


def test_injected_fault_every_step_switches_drafting_off_and_serves_on(
    tiny_model_path, tiny_prompts, plain_ids, monkeypatch
):
    ids, report = run_with_faults(tiny_model_path, tiny_prompts, "draft@every", monkeypatch)
    assert ids == plain_ids
    assert report["drafting_disabled"] and report["faults"] == MAX_CONSECUTIVE_FAULTS
