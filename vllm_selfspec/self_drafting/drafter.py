# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""Drafting with the target model itself: one probe per prompt, then masked greedy steps.

- Probe: the first time a row self-drafts, one eager pass over its prompt's last `stats_window`
  tokens measures, per layer, how much each attention and MLP sublayer changes the residual
  stream. It reads the prompt's cached KV and writes nothing, so it is exact under chunked
  prefill and prefix caching. ADMG turns the statistics into the row's `SkipMask`.
- Draft: up to K greedy steps for all self-drafting rows in one batch, each row under its own
  mask. Step j of a row feeds its last token at position q+j (q: its first unverified position)
  and writes KV for the computed layers into the target's own slots at q+j. The scheduler
  reserves q..q+K-1 and the next verification pass rewrites exactly those slots, so draft KV
  never outlives its step and verified KV is never touched. A row stops early (draft exit) when
  its draft's top-1 probability falls below `draft_exit_threshold`.
- Warm-up: the eager path's one-off set-up (a few seconds on a 1.5B model on a CPU) is paid at
  the engine's first decode step, not by the first request that self-drafts.
"""

from __future__ import annotations

import logging
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

import numpy as np
import torch

from vllm_selfspec.operations.fail_safe import fault_point
from vllm_selfspec.options import SelfAdmgOptions
from vllm_selfspec.self_drafting.admg import SkipMask, select_skip_mask
from vllm_selfspec.self_drafting.residual_stream import HeadIds, ResidualStream, draft_logits, similarity_sums
from vllm_selfspec.vllm_integration.draft_forward import DraftForward, meet_after, same_on_all_ranks
from vllm_selfspec.vllm_integration.runner_state import StepView

# A child of vLLM's logger, so VLLM_LOGGING_LEVEL=DEBUG shows per-request skip counts.
logger = logging.getLogger("vllm.selfspec")


@dataclass(frozen=True)
class Measurement:
    """One probed prompt: its per-layer similarities and the mask chosen from them."""

    req_id: str
    prompt: np.ndarray
    attention_similarity: np.ndarray
    mlp_similarity: np.ndarray
    mask: SkipMask


@dataclass
class ProbeResult:
    measurements: list[Measurement]
    tokens: int  # prompt tokens read
    seconds: float


@dataclass
class DraftRun:
    """A batch of self-drafts: the rows drafting in each step and that step's seconds."""

    step_rows: list[int] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0


class WarmUp(NamedTuple):
    """The warm-up's seconds in all, and those of its second probe of one prompt, set up by then:
    the first self-draft retry's probe is priced by it (`StepCostModel.observe_probe`), not as
    free, so that the per-row rule weighs it before any probe has run in earnest."""

    seconds: float
    probe_seconds: float


SUBLAYERS = ("attention", "mlp")  # a mask's fields


class SelfDrafter:
    def __init__(self, target_model: torch.nn.Module, options: SelfAdmgOptions):
        self.options = options
        self.stream = ResidualStream(target_model)
        self.head_rows = self.stream.head_rows()
        self.sublayer_bytes = self.stream.sublayer_bytes()
        self.masks: dict[str, SkipMask] = {}  # per live request, from its probe
        self.warmed_up = False

    def forget(self, req_id: str) -> None:
        self.masks.pop(req_id, None)

    def probe(self, step: StepView, forward: DraftForward, rows: list[int]) -> ProbeResult:
        """Measure these rows' prompts and keep their masks."""
        start = time.perf_counter()
        attn_mean, mlp_mean, query_lens = self._similarities(step, forward, rows)
        measurements = []
        for i, row in enumerate(rows):
            mask = select_skip_mask(attn_mean[i], mlp_mean[i], self.options, self.sublayer_bytes)
            req_id = step.req_ids[row]
            self.masks[req_id] = mask
            measurements.append(Measurement(req_id, step.prompt(row), attn_mean[i], mlp_mean[i], mask))
            logger.debug(
                "self-admg request %s skips %d attention and %d MLP sublayers of %d layers",
                req_id,
                sum(mask.attention),
                sum(mask.mlp),
                len(mask.attention),
            )
        return ProbeResult(measurements, int(query_lens.sum()), time.perf_counter() - start)

    def _similarities(self, step: StepView, forward: DraftForward, rows: list[int]):
        """Per row and layer, the mean cosine similarity over the prompt's last `stats_window`
        tokens across each attention and each MLP sublayer, and the tokens read."""

        def own_part(context: ExitStack):  # this rank's, up to the forward's first collective
            fault_point("probe")
            prompt_lens = step.prompt_lengths(rows)
            window = self.options.stats_window
            starts = np.maximum(prompt_lens - window, 0) if window else np.zeros_like(prompt_lens)
            query_lens = prompt_lens - starts
            ids = np.concatenate([step.prompt(r)[s:] for r, s in zip(rows, starts)])
            positions = np.concatenate([np.arange(s, p) for s, p in zip(starts, prompt_lens)])
            row_of_token = np.repeat(np.arange(len(rows)), query_lens)
            context.enter_context(forward.probe(rows, query_lens, prompt_lens))
            inputs = (ids, positions, row_of_token)
            return query_lens, [torch.from_numpy(a).to(forward.device) for a in inputs]

        with ExitStack() as context:
            query_lens, inputs = meet_after(lambda: own_part(context))
            attn_sum, mlp_sum = similarity_sums(self.stream, *inputs, len(rows))
        means = torch.stack([attn_sum, mlp_sum]) / torch.from_numpy(query_lens)[:, None].to(attn_sum)
        attn_mean, mlp_mean = same_on_all_ranks(means).cpu().numpy()
        return attn_mean, mlp_mean, query_lens

    def warm_up(self, step: StepView, forward: DraftForward, row: int) -> WarmUp:
        """One row: a probe whose result is dropped, and a one-token draft whose KV at the row's
        next position the next step overwrites, as it does any draft's; then the probe again,
        timed, now that it is set up: what a probe costs (`WarmUp`)."""
        start = time.perf_counter()
        mask = self._mask(step, forward, row)
        scratch: list[list[int]] = [[] for _ in range(row + 1)]
        self._draft(step, forward, [row], [mask], np.ones(1, np.int64), scratch)
        probed_at = time.perf_counter()
        self._mask(step, forward, row)
        end = time.perf_counter()
        self.warmed_up = True
        return WarmUp(seconds=end - start, probe_seconds=end - probed_at)

    def _mask(self, step: StepView, forward: DraftForward, row: int) -> SkipMask:
        attn_mean, mlp_mean, _ = self._similarities(step, forward, [row])
        return select_skip_mask(attn_mean[0], mlp_mean[0], self.options, self.sublayer_bytes)

    def draft(
        self, step: StepView, forward: DraftForward, rows: list[int], budgets: list[int], drafts: list[list[int]]
    ) -> DraftRun:
        """Greedy draft tokens for `rows` (probed already) under their masks, up to `budgets`,
        appended to `drafts[row]`."""
        return self._draft(step, forward, rows, None, np.asarray(budgets, dtype=np.int64), drafts)

    def _draft(
        self,
        step: StepView,
        forward: DraftForward,
        rows: list[int],
        masks: list[SkipMask] | None,
        budgets: np.ndarray,
        drafts: list[list[int]],
    ) -> DraftRun:
        """Each forward's own part on this rank (its rows, metadata and inputs) ends at a
        checkpoint where the ranks meet (`meet_after`); the rest is the same code on the same
        broadcast values on every rank."""
        run, start = DraftRun(), time.perf_counter()
        device = forward.device

        def setup():
            chosen = masks if masks is not None else [self.masks[step.req_ids[r]] for r in rows]
            skips = [torch.tensor([getattr(m, part) for m in chosen], dtype=torch.bool) for part in SUBLAYERS]
            first_positions = step.last_positions(rows)
            return skips, first_positions, step.tokens_at(rows, first_positions), self._head_ids(step, rows, device)

        (skip_attention, skip_mlp), first_positions, tokens, head_ids = meet_after(setup)
        active = np.arange(len(rows))  # indices into `rows` still drafting
        exit_threshold = self.options.draft_exit_threshold
        for j in range(int(budgets.max())):
            step_start = time.perf_counter()
            active_rows = [rows[i] for i in active]
            positions = first_positions[active] + j
            with ExitStack() as context:
                own_part = partial(_enter_draft_step, context, forward, active_rows, positions, tokens[active], j)
                token_ids, position_ids = meet_after(own_part)
                logits = draft_logits(
                    self.stream, token_ids, position_ids, skip_attention[active], skip_mlp[active], head_ids
                )
            if exit_threshold > 0:
                top_prob, next_tokens = torch.softmax(logits.float(), dim=-1).max(dim=-1)
                confident = top_prob >= exit_threshold
            else:
                next_tokens = logits.argmax(dim=-1)
                confident = torch.ones_like(next_tokens, dtype=torch.bool)
            if head_ids is not None:
                next_tokens = head_ids.token_ids(next_tokens)
            next_tokens, confident = same_on_all_ranks(torch.stack([next_tokens, confident.long()])).cpu().numpy()
            confident = confident.astype(bool)
            for i, token, keep in zip(active, next_tokens, confident):
                if keep:
                    drafts[rows[i]].append(int(token))
            tokens[active] = next_tokens
            active = active[confident & (budgets[active] > j + 1)]
            run.step_rows.append(len(active_rows))
            run.step_seconds.append(time.perf_counter() - step_start)
            if len(active) == 0:
                break
        run.tokens = sum(len(drafts[r]) for r in rows)
        run.seconds = time.perf_counter() - start
        return run

    def _head_ids(self, step: StepView, rows: list[int], device) -> HeadIds | None:
        """The draft's vocabulary for these rows (None: the full LM head)."""
        num_first = self.options.draft_vocab
        if not num_first or self.head_rows is None or num_first >= self.head_rows.shape[0]:
            return None
        contexts = np.concatenate([step.context(r) for r in rows])
        extra = np.unique(contexts[contexts >= num_first])
        return HeadIds(self.head_rows, num_first, torch.from_numpy(extra).to(device))


def _enter_draft_step(context: ExitStack, forward: DraftForward, rows: list[int], positions, tokens, index: int):
    """This rank's own part of a draft step, up to its forward's first collective: the forward
    context of `rows` at `positions`, and the step's inputs on the device."""
    context.enter_context(forward.draft_step(rows, positions, index))
    fault_point("draft")
    return torch.from_numpy(tokens).to(forward.device), torch.from_numpy(positions).to(forward.device)
