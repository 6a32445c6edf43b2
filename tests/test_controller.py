"""The draft controller and prompt lookup: pure functions, no engine."""

import numpy as np
import pytest

from vllm_selfspec.controller import AcceptanceRate, DraftController, StepCost
from vllm_selfspec.lookup import prompt_lookup


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


def test_acceptance_rate_counts_trials_up_to_the_first_rejection():
    rate = AcceptanceRate(prior=0.5, decay=1.0)
    rate.observe(drafted=4, accepted=4)  # 4 trials, 4 successes
    rate.observe(drafted=4, accepted=1)  # 2 trials (1 success, then a rejection)
    assert rate.rate == pytest.approx((1 + 4 + 1) / (2 + 4 + 2))
    rate.observe(drafted=0, accepted=0)
    assert rate.rate == pytest.approx(6 / 8)


def test_step_cost_fits_a_line_and_ignores_idle_gaps():
    cost = StepCost(decay=1.0)
    for n in [1, 2, 3, 4, 5] * 4:
        cost.observe(n, 0.2 + 0.01 * n)
    assert cost.coefficients() == pytest.approx((0.2, 0.01))
    cost.observe(1, 60.0)  # the engine sat idle between requests
    assert cost.coefficients() == pytest.approx((0.2, 0.01))
    for _ in range(3):  # but steps that really got slower are followed
        cost.observe(1, 2.0)
    assert cost.predict(1) > 0.3


def trained(t0, t1, self_step, lookup_rate, self_rate):
    controller = DraftController()
    for n in [1, 3, 5] * 4:
        controller.step.observe(n, t0 + t1 * n)
    controller.observe_self_step(self_step)
    controller.lookup = AcceptanceRate(prior=lookup_rate, decay=1.0)
    controller.self_draft = AcceptanceRate(prior=self_rate, decay=1.0)
    return controller


def test_cheap_verification_and_good_drafts_draft_everything():
    controller = trained(t0=0.25, t1=0.01, self_step=0.02, lookup_rate=0.9, self_rate=0.9)
    assert controller.plan(batch_rows=1, lookup_found=[], num_self_rows=1, self_budget=4).self_length == 4
    assert controller.plan(batch_rows=1, lookup_found=[3], num_self_rows=0, self_budget=0).lookup_lengths == [3]


def test_a_self_draft_step_must_beat_the_rate_lookup_already_reached():
    # 0.05 s per self-draft step: worth a first token at acceptance 0.9, not a second one
    # once the lookup row has made the step productive.
    controller = trained(t0=0.25, t1=0.01, self_step=0.05, lookup_rate=0.9, self_rate=0.9)
    plan = controller.plan(batch_rows=2, lookup_found=[3], num_self_rows=1, self_budget=4)
    assert plan.lookup_lengths == [3] and plan.self_length == 1


def test_self_drafts_that_cost_a_full_step_are_not_made():
    """The measured case on a 2-core CPU: a draft step costs about a target step."""
    controller = trained(t0=0.25, t1=0.02, self_step=0.25, lookup_rate=0.8, self_rate=0.8)
    plan = controller.plan(batch_rows=2, lookup_found=[4], num_self_rows=1, self_budget=4)
    assert plan.self_length == 0 and plan.lookup_lengths[0] >= 2


def test_expensive_verification_turns_drafting_off():
    """Large batches on CPU: each extra verified token costs nearly as much as a row's token."""
    controller = trained(t0=0.1, t1=0.03, self_step=0.5, lookup_rate=0.5, self_rate=0.5)
    plan = controller.plan(batch_rows=32, lookup_found=[4] * 16, num_self_rows=16, self_budget=4)
    assert plan.lookup_lengths == [0] * 16 and plan.self_length == 0


def test_an_unused_source_is_retried_with_back_off():
    controller = trained(t0=0.25, t1=0.02, self_step=0.25, lookup_rate=0.8, self_rate=0.5)
    retries = [i for i in range(200) if controller.plan(1, [], 1, 4).explored]
    assert retries[:3] == [15, 47, 111]  # after 16, then 32, then 64 idle steps


def test_before_costs_are_known_only_free_drafts_are_made():
    """Lookup drafts need no forward pass; self-drafts wait until their cost can be judged."""
    plan = DraftController().plan(batch_rows=3, lookup_found=[2, 4], num_self_rows=1,
                                             self_budget=3)
    assert plan.lookup_lengths == [2, 4] and plan.self_length == 0


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
