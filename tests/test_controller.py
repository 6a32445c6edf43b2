"""The draft controller and prompt lookup: pure functions, no engine."""

import dataclasses

import numpy as np
import pytest

from vllm_selfspec.controller import AcceptanceRate, DraftController, RowOffer, target_step_cost
from vllm_selfspec.lookup import OutputHistory, prompt_lookup


def test_prompt_lookup_takes_the_longest_most_recent_match():
    context = np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    # "2 3" last occurred at 5..6, followed by 7 8 5 (the earlier "2 3 9" is older).
    assert prompt_lookup(context, max_ngram=4, max_tokens=3).tolist() == [7, 8, 5]
    # A longer n-gram wins over a more recent shorter one.
    context = np.array([4, 2, 3, 6, 0, 2, 3, 9, 4, 2, 3])
    assert prompt_lookup(context, max_ngram=4, max_tokens=2).tolist() == [6, 0]
    assert prompt_lookup(context, max_ngram=2, max_tokens=2).tolist() == [9, 4]


def test_prompt_lookup_without_a_match_or_context():
    assert prompt_lookup(np.array([1, 2, 3, 4]), 4, 3).tolist() == []
    assert prompt_lookup(np.array([5]), 4, 3).tolist() == []
    # The continuation may run up to the context's end, never past it.
    assert prompt_lookup(np.array([1, 2, 1, 2]), 4, 5).tolist() == [1, 2]


def test_output_history_continues_the_longest_most_recent_match():
    history = OutputHistory(max_ngram=3, max_entries=1000, continuation=4)
    # Prompt 1 2, output 3 4 5 6 7: n-grams ending at an output token, reaching into the prompt.
    history.add(np.array([1, 2, 3, 4, 5, 6, 7]), output_start=2)
    assert history.lookup(np.array([9, 9, 1, 2]), max_tokens=3).tolist() == [3, 4, 5]
    assert history.lookup(np.array([8, 4, 5]), max_tokens=8).tolist() == [6, 7]
    assert history.lookup(np.array([5, 6, 7]), max_tokens=3).tolist() == []  # nothing followed
    assert history.lookup(np.array([9, 1]), max_tokens=3).tolist() == []  # never ended an output n-gram
    history.add(np.array([0, 4, 5, 0, 0]), output_start=1)  # more recent: "4 5" is now followed by 0
    assert history.lookup(np.array([8, 4, 5]), max_tokens=2).tolist() == [0, 0]
    assert history.lookup(np.array([3, 4, 5]), max_tokens=2).tolist() == [6, 7]  # the longer match wins


def test_output_history_keeps_at_most_max_entries():
    history = OutputHistory(max_ngram=2, max_entries=10)
    for start in range(0, 1000, 10):
        history.add(np.arange(start, start + 10), output_start=0)
    assert len(history) == 10
    assert history.lookup(np.array([997, 998]), 2).tolist() == [999]  # the newest survive
    assert history.lookup(np.array([7, 8]), 2).tolist() == []


def test_acceptance_rate_counts_trials_up_to_the_first_rejection():
    rate = AcceptanceRate(prior=0.5, decay=1.0)
    rate.observe(drafted=4, accepted=4)  # 4 trials, 4 successes
    rate.observe(drafted=4, accepted=1)  # 2 trials (1 success, then a rejection)
    assert rate.rate == pytest.approx((1 + 4 + 1) / (2 + 4 + 2))
    rate.observe(drafted=0, accepted=0)
    assert rate.rate == pytest.approx(6 / 8)


def target_step_cost():
    from vllm_selfspec import controller

    return dataclasses.replace(controller.target_step_cost(), decay=1.0)


def test_step_cost_fits_each_kind_of_work_and_ignores_idle_gaps():
    cost = target_step_cost()
    # Decode steps of 1-8 rows, half of them sampling, and a few prefill chunks.
    steps = [(0, n, s) for n in range(1, 9) for s in (0, n // 2)] + [(300, 1, 0), (120, 2, 1)]
    for p, n, s in steps * 2:
        cost.observe((p, n, s), 0.2 + 0.001 * p + 0.01 * n + 0.02 * s)
    intercept, coef = cost.coefficients()
    assert intercept == pytest.approx(0.2, rel=1e-2) and coef == pytest.approx([0.001, 0.01, 0.02], rel=5e-2)
    cost.observe((0, 1, 0), 60.0)  # the engine sat idle between requests
    assert cost.predict((0, 1, 0)) == pytest.approx(0.21, rel=1e-2)
    for _ in range(3):  # but steps that really got slower are followed
        cost.observe((0, 1, 0), 2.0)
    assert cost.predict((0, 1, 0)) > 0.3


def test_step_cost_charges_an_always_sampling_workload_to_its_rows():
    """With every row sampling, rows and sampled rows cannot be told apart; the fit must still
    price a sampled row right, and not make rows look free."""
    cost = target_step_cost()
    for n in [32, 64, 96, 128] * 3:
        cost.observe((0, n, n), 0.3 + 0.015 * n)
    intercept, (_, t_row, t_sampled) = cost.coefficients()
    assert t_row + t_sampled == pytest.approx(0.015, rel=1e-2) and t_row > 0.01


def test_step_cost_prompt_tokens_do_not_make_draft_tokens_look_cheap():
    """A prefill chunk of 4000 tokens costs far less per token than a verified draft token (no
    logits, one big product). One slope for both priced drafts at the prompt rate."""
    cost = target_step_cost()
    for n in [32, 64, 96, 128] * 3:
        cost.observe((0, n, 0), 0.3 + 0.012 * n)
    for _ in range(3):
        cost.observe((4000, 32, 0), 0.3 + 0.002 * 4000 + 0.012 * 32)
    _, (t_prompt, t_row, _) = cost.coefficients()
    assert t_prompt == pytest.approx(0.002, rel=1e-2) and t_row == pytest.approx(0.012, rel=1e-2)


def test_step_cost_without_spread_assumes_a_token_costs_a_tenth_of_a_step():
    cost = target_step_cost()
    for _ in range(10):
        cost.observe((0, 4, 0), 0.28)
    _, (_, t_row, _) = cost.coefficients()
    assert 0.01 < t_row < 0.05 and cost.predict((0, 4, 0)) == pytest.approx(0.28)


def trained(t0, t1, self_step, lookup_rate, self_rate, t_sampled=0.0):
    controller = DraftController()
    for n in [1, 3, 5, 8] * 4:
        controller.observe_step(0, n, 0, t0 + t1 * n)
        controller.observe_step(0, n, n, t0 + (t1 + t_sampled) * n)
    for rows in (1, 2):
        controller.observe_self_step(rows, 10 * self_step)  # the first at a shape: set-up, ignored
        controller.observe_self_step(rows, self_step)
    controller.lookup = AcceptanceRate(prior=lookup_rate, decay=1.0)
    controller.self_draft = AcceptanceRate(prior=self_rate, decay=1.0)
    return controller


def lookup_rows(*found, sampled=False):
    return [RowOffer(f"r{i}", lookup=n, sampled=sampled) for i, n in enumerate(found)]


def self_rows(count, start=100):
    return [RowOffer(f"r{start + i}", can_self_draft=True) for i in range(count)]


def test_cheap_verification_and_good_drafts_draft_everything():
    controller = trained(t0=0.25, t1=0.01, self_step=0.02, lookup_rate=0.9, self_rate=0.9)
    assert controller.plan(self_rows(1), self_budget=4).self_length == 4
    assert controller.plan(lookup_rows(3), self_budget=0).lookup_lengths == [3]


def test_a_self_draft_step_must_beat_the_rate_lookup_already_reached():
    # 0.05 s per self-draft step: worth a first token at acceptance 0.9, not a second one
    # once the lookup row has made the step productive.
    controller = trained(t0=0.25, t1=0.01, self_step=0.05, lookup_rate=0.9, self_rate=0.9)
    plan = controller.plan(lookup_rows(3) + self_rows(1), self_budget=4)
    assert plan.lookup_lengths == [3, 0] and plan.self_length == 1


def test_self_drafts_that_cost_a_full_step_are_not_made_nor_retried():
    """The measured case on a 2-core CPU: a draft step costs about a target step, so even with
    every draft token accepted a self-draft cannot beat plain decoding; retrying it (and
    probing new prompts for it) would only cost time."""
    controller = trained(t0=0.25, t1=0.02, self_step=0.3, lookup_rate=0.8, self_rate=0.8)
    plans = [controller.plan(lookup_rows(4) + self_rows(1), self_budget=4) for _ in range(300)]
    assert all(p.self_length == 0 for p in plans) and plans[0].lookup_lengths[0] >= 2


def test_expensive_verification_turns_drafting_off():
    """Large batches on CPU: each extra verified token costs nearly as much as a row's token."""
    controller = trained(t0=0.1, t1=0.03, self_step=0.5, lookup_rate=0.5, self_rate=0.5)
    plan = controller.plan(lookup_rows(*[4] * 16) + self_rows(16), self_budget=4)
    assert plan.lookup_lengths == [0] * 32 and plan.self_length == 0


def test_sampled_rows_draft_less_when_their_verification_costs_more():
    controller = trained(t0=0.3, t1=0.004, self_step=0.5, lookup_rate=0.5, self_rate=0.5, t_sampled=0.02)
    greedy = controller.plan(lookup_rows(4, 4), self_budget=0).lookup_lengths
    sampled = controller.plan(lookup_rows(4, 4, sampled=True), self_budget=0).lookup_lengths
    assert sum(sampled) < sum(greedy)


def test_lookup_acceptance_is_learned_per_request():
    controller = trained(t0=0.25, t1=0.03, self_step=0.5, lookup_rate=0.6, self_rate=0.5)
    for _ in range(30):
        controller.observe_draft("r0", "lookup", 4, 4)  # copies its context well
        controller.observe_draft("r1", "lookup", 4, 0)  # does not
    plan = controller.plan(lookup_rows(4, 4), self_budget=0)
    assert plan.lookup_lengths[0] == 4 and plan.lookup_lengths[1] == 0
    controller.forget("r1")
    assert controller.lookup_rate("r1") == controller.lookup.rate


def test_an_unused_source_is_retried_with_back_off():
    # A self-draft step of 0.1 s could pay if its tokens were accepted: it is retried.
    controller = trained(t0=0.25, t1=0.02, self_step=0.1, lookup_rate=0.8, self_rate=0.2)
    retries = [i for i in range(200) if controller.plan(self_rows(1), 4).explored]
    assert retries[:3] == [15, 47, 111]  # after 16, then 32, then 64 idle steps


def test_before_costs_are_known_only_free_drafts_are_made():
    """Lookup drafts need no forward pass; self-drafts wait until their cost can be judged."""
    plan = DraftController().plan(lookup_rows(2, 4) + self_rows(1), self_budget=3)
    assert plan.lookup_lengths == [2, 4, 0] and plan.self_length == 0


def test_head_ids_map_draft_columns_back_to_token_ids():
    import torch

    from vllm_selfspec.layers import HeadIds

    head = torch.randn(50, 8)
    ids = HeadIds(head, num_first=10, extra=torch.tensor([17, 42]))
    h = torch.randn(3, 8)
    logits = torch.cat([h @ head[:10].T, h @ head[[17, 42]].T], dim=-1)
    assert ids.token_ids(torch.tensor([3, 10, 11])).tolist() == [3, 17, 42]
    # Restricted to the same ids, the truncated head picks what the full head picks.
    full = h @ head.T
    allowed = torch.tensor(list(range(10)) + [17, 42])
    expected = allowed[full[:, allowed].argmax(-1)]
    assert torch.equal(ids.token_ids(logits.argmax(-1)), expected)
