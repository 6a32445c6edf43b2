# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""Independent computations to test against: the ADMG statistic with plain transformers (no vLLM),
and the lookup rule in numpy."""

from __future__ import annotations

import numpy as np
import torch

from vllm_selfspec.sources.lookup import NO_DRAFT, LookupDraft


def hf_similarities(model_path, prompts_token_ids, window: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per prompt: mean over its tokens (its last `window` tokens, if set) of cos(h, h + attn)
    and cos(h', h' + mlp) per layer, from hooks on a float32 transformers model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    captured: dict[str, list[torch.Tensor]] = {"in": [], "attn": [], "mlp": []}
    hooks = []
    for layer in model.model.layers:
        hooks.append(
            layer.register_forward_pre_hook(
                lambda m, args, kwargs: captured["in"].append(
                    kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
                ),
                with_kwargs=True,
            )
        )
        hooks.append(
            layer.self_attn.register_forward_hook(
                lambda m, args, out: captured["attn"].append(out[0] if isinstance(out, tuple) else out)
            )
        )
        hooks.append(layer.mlp.register_forward_hook(lambda m, args, out: captured["mlp"].append(out)))
    results = []
    try:
        for ids in prompts_token_ids:
            for v in captured.values():
                v.clear()
            with torch.no_grad():
                model(torch.tensor([ids]))
            attn, mlp = [], []
            for h, a, m in zip(captured["in"], captured["attn"], captured["mlp"]):
                h, a, m = (x[0, -window:].double() for x in (h, a, m))
                attn.append(torch.cosine_similarity(h, h + a, dim=-1).mean().item())
                mid = h + a
                mlp.append(torch.cosine_similarity(mid, mid + m, dim=-1).mean().item())
            results.append((np.array(attn), np.array(mlp)))
    finally:
        for hook in hooks:
            hook.remove()
    return results


def numpy_suffix_draft(
    context: np.ndarray, max_tokens: int, corpus: np.ndarray | None = None, max_match: int = 24, min_prob: float = 0.1
) -> LookupDraft:
    """vllm_selfspec.sources.lookup.suffix_draft's rule in numpy calls, written apart from the compiled one:
    the same drafts, probabilities and match length, for the equivalence test."""
    n = len(context)
    own = corpus is None
    corpus = context if own else corpus
    end = n if own else len(corpus)  # continuations stop here
    limit = n - 1 if own else len(corpus) - 1  # an occurrence needs a token after it
    if n == 0 or limit <= 0 or max_tokens <= 0 or max_match <= 0:
        return NO_DRAFT
    ends = np.flatnonzero(corpus[:limit] == context[-1])
    if not len(ends):
        return NO_DRAFT
    # lengths[i]: how many of the context's last tokens match the corpus, ending at ends[i].
    lengths = np.ones(len(ends), dtype=np.int64)
    alive = np.arange(len(ends))
    for k in range(1, min(max_match, n)):
        pos = ends[alive] - k
        alive, pos = alive[pos >= 0], pos[pos >= 0]
        alive = alive[corpus[pos] == context[n - 1 - k]]
        if not len(alive):
            break
        lengths[alive] += 1
    best = NO_DRAFT
    # The occurrences change only at the distinct lengths, and the longest m of a run allows
    # the longest draft with the same probabilities, so only those m are tried (ascending, so
    # that a tie goes to the longer match).
    for m in np.unique(lengths):
        occurrences = ends[lengths >= m]
        total = len(occurrences) + 1  # the current occurrence counts: it has no continuation yet
        tokens, probs = [], []
        for j in range(min(max_tokens, int(m))):
            occurrences = occurrences[occurrences + 1 + j < end]
            following = corpus[occurrences + 1 + j]
            occurrences, following = occurrences[following >= 0], following[following >= 0]
            if not len(occurrences):
                break
            # Most frequent next token; among equals the most recent (first in reversed order).
            values, first_reversed, counts = np.unique(following[::-1], return_index=True, return_counts=True)
            pick = np.lexsort((first_reversed, -counts))[0]
            if counts[pick] / total < min_prob:
                break
            tokens.append(int(values[pick]))
            probs.append(float(counts[pick] / total))
            occurrences = occurrences[following == values[pick]]
        if tokens and sum(probs) >= best.score:
            best = LookupDraft(np.asarray(tokens, dtype=np.int64), tuple(probs), int(m))
    return best


def give_back_by_scan(protection, taken: list, seconds: float) -> list:
    """The planner's give-back as first written: while some row is not left its due, scan
    `taken` (by gain per second, best first) from its end for the least paying deepest token
    of a row left its due without it, else of a row that does not bind, else take the least
    paying; give it back. The tokens given back, in order (O(tokens x rows))."""
    given, row = [], None
    while taken and (row := protection.a_binding_row(seconds - protection.t_plain, hint=row)) is not None:
        added, seen, fallback, chosen = seconds - protection.t_plain, set(), None, None
        for k in range(len(taken) - 1, -1, -1):
            rows, gained = taken[k][2], taken[k][4]
            deepest = seen.isdisjoint(rows)
            seen.update(rows)
            if not deepest or protection.binds(rows, added):
                continue
            if protection.due_without(rows, gained, added):
                chosen = k
                break
            fallback = k if fallback is None else fallback
        k = chosen if chosen is not None else (len(taken) - 1 if fallback is None else fallback)
        token = taken.pop(k)
        protection.take(token[2], token[3], token[4], sign=-1)
        seconds -= token[3] * len(token[2])
        given.append(token)
    return given


class LearningByObjects:
    """What verified drafts teach, learned draft by draft with `AcceptanceRate` objects (as
    `AcceptanceModel` learned before its arrays): the reference for `request_rates.learn_verified`."""

    def __init__(self):
        from vllm_selfspec.control.acceptance import LOOKED_UP, EstimateCalibration, default_rates

        self.rates = default_rates()
        self.by_request = {}  # (request, source): its own AcceptanceRate
        self.trusted = set()
        self.by_bin = {}  # bin: its AcceptanceRate
        self.calibration = {source: EstimateCalibration() for source in LOOKED_UP}

    def observe(self, req_id: str, source, drafted: int, accepted: int, calibration, estimated: float) -> None:
        from vllm_selfspec.control.acceptance import AcceptanceRate, DraftSource
        from vllm_selfspec.control.request_rates import REQUEST_DECAY, TRUSTED_AFTER_TOKENS

        overall = self.rates[source]
        overall.observe(drafted, accepted)
        if source != DraftSource.SELF:
            self.calibration[source].observe(estimated, min(accepted, drafted))
            own = self.by_request.setdefault((req_id, source), AcceptanceRate(prior=overall.rate, decay=REQUEST_DECAY))
            own.observe(drafted, accepted)
            if own.verified >= TRUSTED_AFTER_TOKENS:
                self.trusted.add(req_id)
        for j, (token_bin, prior) in enumerate(zip(calibration.bins.tolist(), calibration.priors.tolist())):
            if j <= accepted and j < drafted:  # (the accepted tokens and the first rejected)
                rate = self.by_bin.setdefault(token_bin, AcceptanceRate(prior=min(prior, 0.999)))
                rate.observe(1, int(j < accepted))

    def forget(self, req_id: str) -> None:
        self.by_request = {key: rate for key, rate in self.by_request.items() if key[0] != req_id}
        self.trusted.discard(req_id)
