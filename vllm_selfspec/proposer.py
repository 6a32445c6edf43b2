"""SelfAdmgProposer: drafts with the target model's own layers under a per-sequence skip mask.

vLLM builds it as a `custom_class` proposer in each worker (see `vllm_selfspec.patches`), hands
it the target model through `load_model`, and calls `propose_for_runner` after every step
through the runner hook. Per step:

1. Learn from the step that just ran: its time, and how much of each row's draft was accepted
   (`vllm_selfspec.controller`).
2. Offer each row a prompt-lookup draft when its context's last n-gram occurred before
   (`vllm_selfspec.lookup`); the other rows can draft with the model itself. The controller
   decides how many tokens of each pay this step, possibly none.
3. Self-drafts: a row's prompt is measured the first time it self-drafts (a probe pass over the
   prompt that reads the cached KV and writes nothing: exact under chunked prefill and prefix
   caching), and the similarities become its `SkipMask` (`vllm_selfspec.admg`). Then up to K
   greedy steps for all self-drafting rows in one batch, each under its own mask. Draft step j
   of a row feeds its last token at position q+j (q = its first unverified position) and writes
   KV for the computed layers into the target's own slots at q+j. The scheduler reserves
   q..q+K-1 (the lookahead patch) and the next verification pass rewrites exactly those slots,
   so draft KV never outlives its step and verified KV is never touched.
4. Return ragged lists; vLLM's scorer and rejection sampler verify them. Every draft is a point
   mass, so rejection sampling reproduces the target's distribution exactly.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_selfspec.admg import SkipMask, select_skip_mask
from vllm_selfspec.controller import DraftController, DraftPlan, RowOffer
from vllm_selfspec.layers import HeadIds, ResidualStream, draft_logits, similarity_sums
from vllm_selfspec.lookup import NO_DRAFT, OutputHistory, lookup_draft
from vllm_selfspec.options import ADDITIONAL_CONFIG_KEY, make_options

# Steps without a request admitted after which the batch counts as draining: a row that
# finishes early frees a slot nobody takes (vllm_selfspec.controller, draining batches).
DRAIN_AFTER_STEPS = 4

# A child of vLLM's logger, so VLLM_LOGGING_LEVEL=DEBUG shows per-request skip counts.
logger = logging.getLogger("vllm.selfspec")


@dataclass
class ProposerCounters:
    """What the proposer did, for benchmarks and tests (read through collective_rpc)."""

    prompts_measured: int = 0
    prompt_tokens_measured: int = 0
    probe_seconds: float = 0.0
    warmup_seconds: float = 0.0  # the eager path's one-off set-up, paid at the first step
    draft_calls: int = 0
    draft_steps: int = 0
    draft_tokens: int = 0
    draft_seconds: float = 0.0
    lookup_tokens: int = 0  # from prompt lookup, own context or history
    history_tokens: int = 0  # of which from earlier requests' outputs
    # The last measured prompts, for diagnostics and tests: (prompt_key, attention similarity,
    # MLP similarity, mask). Bounded, so a long-running server does not grow it.
    measurements: deque = field(default_factory=lambda: deque(maxlen=4096))
    # The last steps as the controller saw them: (prompt tokens, logit rows, sampled logit
    # rows, draft tokens, seconds), to check its cost model against (benchmarks/step_costs.py).
    steps: deque = field(default_factory=lambda: deque(maxlen=4096))


def prompt_key(prompt_token_ids) -> str:
    """A short, stable name for a prompt's token ids (to match measurements to prompts)."""
    return hashlib.blake2b(np.asarray(prompt_token_ids, dtype=np.int64).tobytes(),
                           digest_size=8).hexdigest()


class SelfAdmgProposer:
    def __init__(self, vllm_config):
        from vllm_selfspec.patches import runner_hook

        runner_hook.install()
        self.vllm_config = vllm_config
        self.num_speculative_tokens = vllm_config.speculative_config.num_speculative_tokens
        self.options = make_options((vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY, {}))
        self.masks: dict[str, SkipMask] = {}
        self.counters = ProposerCounters()
        self.controller = DraftController()
        self._stream: ResidualStream | None = None
        self._head_rows: torch.Tensor | None = None
        # Last step's drafts: source, length, and the lookup tokens' (bin, prior) pairs.
        self._drafted: dict[str, tuple[str, int, list]] = {}
        self._history = (OutputHistory(self.options.lookup_history)
                         if self.options.lookup_ngram and self.options.lookup_history else None)
        self._step_end: float | None = None
        self._steps_since_admission = 0
        self._warmed_up = False

    # vLLM's CPU runner calls this unconditionally, the GPU runner when it exists. The target is
    # kept under another name than `model`: the runner treats `drafter.model` as a separate draft
    # network (graph wrappers, EPLB, get_draft_model).
    def load_model(self, target_model: torch.nn.Module) -> None:
        self._stream = ResidualStream(target_model)
        self._head_rows = self._stream.head_rows()
        self._device = next(target_model.parameters()).device
        self._sublayer_bytes = self._stream.sublayer_bytes()

    def propose(self, *args, **kwargs):
        raise RuntimeError(
            "SelfAdmgProposer is driven by vllm_selfspec's runner hook; it cannot run as a bare "
            "custom_class proposer (is the vllm_selfspec plugin loaded in this process?)")

    # ---- the step ------------------------------------------------------------------------
    def propose_for_runner(self, runner, scheduler_output, sampled_token_ids: list[list[int]],
                           common_attn_metadata) -> list[list[int]]:
        batch = runner.input_batch
        self._learn(runner, scheduler_output, sampled_token_ids, batch.req_ids)
        # Rows that sampled a token this step, with how many draft tokens each can still use
        # (a draft for a request that is about to hit max_tokens would be thrown away).
        left = {i: self._tokens_left(runner.requests[batch.req_ids[i]])
                for i, tokens in enumerate(sampled_token_ids) if tokens}
        budgets = {i: self._draft_budget(tokens_left) for i, tokens_left in left.items()}
        if not self._warmed_up and (warm_row := next((i for i, b in budgets.items() if b), None)) is not None:
            self._warm_up(runner, warm_row, common_attn_metadata)
        found = {}  # row: (lookup source, LookupDraft)
        if self.options.lookup_ngram:
            for i, budget in budgets.items():
                if budget:
                    context = batch.token_ids_cpu[i, :batch.num_tokens_no_spec[i]]
                    source, draft = lookup_draft(context, budget, self.options.lookup_ngram, self._history)
                    if len(draft):
                        found[i] = (source, draft)
        rows = list(budgets)
        offers = []
        for i in rows:
            source, draft = found.get(i, ("lookup", NO_DRAFT))
            req_id = batch.req_ids[i]
            offers.append(RowOffer(req_id, len(draft), source, budgets[i] > 0, self._samples(runner, req_id),
                                   draft.probs, draft.match, left[i], has_mask=req_id in self.masks))
        plan = self._plan(offers, max(budgets.values(), default=0))
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        sources, bins = {}, {}
        for i, offer, length in zip(rows, offers, plan.lookup_lengths):
            if length:
                drafts[i] = [int(t) for t in found[i][1].tokens[:length]]
                sources[i] = found[i][0]
                bins[i] = self.controller.calibration(offer, length)
        self_rows = [i for i, chosen in zip(rows, plan.self_rows) if chosen]
        if plan.self_length and self_rows:  # (a retry: the rows with a mask, or one new row)
            new_rows = [i for i in self_rows if batch.req_ids[i] not in self.masks]
            if new_rows:
                self._measure_prompts(runner, new_rows, common_attn_metadata)
            self_budgets = np.array([min(budgets[i], plan.self_length) for i in self_rows])
            masks = [self.masks[batch.req_ids[i]] for i in self_rows]
            self._draft(runner, self_rows, masks, self_budgets, common_attn_metadata, drafts)
        self._drafted = {batch.req_ids[i]: (sources.get(i, "self"), len(drafts[i]), bins.get(i, []))
                         for i in rows if drafts[i]}
        self.counters.lookup_tokens += sum(len(drafts[i]) for i in sources)
        self.counters.history_tokens += sum(len(drafts[i]) for i, s in sources.items() if s == "history")
        self._step_end = time.perf_counter()
        return drafts

    def _learn(self, runner, scheduler_output, sampled_token_ids, req_ids) -> None:
        """Feed the controller the step that just ran: its time against what it computed
        (prompt chunks included: under load few steps are decode-only), and what became of
        last step's drafts."""
        now = time.perf_counter()
        admitted = (scheduler_output.scheduled_new_reqs
                    or scheduler_output.scheduled_cached_reqs.resumed_req_ids)
        self._steps_since_admission = 0 if admitted else self._steps_since_admission + 1
        if self._step_end is not None and scheduler_output.total_num_scheduled_tokens:
            spec = scheduler_output.scheduled_spec_decode_tokens
            rows = {r: 1 + len(spec.get(r, ())) for r in scheduler_output.num_scheduled_tokens}
            logit_rows = sum(rows.values())
            sampled_rows = sum(n for r, n in rows.items() if self._samples(runner, r))
            prompt_tokens = max(scheduler_output.total_num_scheduled_tokens - logit_rows, 0)
            draft_tokens, seconds = logit_rows - len(rows), now - self._step_end
            self.controller.observe_step(prompt_tokens, logit_rows, sampled_rows, seconds, draft_tokens)
            self.counters.steps.append((prompt_tokens, logit_rows, sampled_rows, draft_tokens, seconds))
        self._step_end = None
        for i, tokens in enumerate(sampled_token_ids):
            if not tokens:  # no token this step (e.g. a partial prefill): nothing verified
                continue
            drafted = self._drafted.get(req_ids[i])
            if drafted:
                source, length, bins = drafted
                self.controller.observe_draft(req_ids[i], source, length, len(tokens) - 1, bins)
        self._drafted = {}

    @staticmethod
    def _samples(runner, req_id: str) -> bool:
        """Whether a request samples (temperature > 0) rather than taking the argmax."""
        from vllm.sampling_params import SamplingType

        request = runner.requests.get(req_id)
        params = request.sampling_params if request is not None else None
        return params is not None and params.sampling_type != SamplingType.GREEDY

    def _plan(self, offers: list[RowOffer], self_budget: int) -> DraftPlan:
        """How much of each kind of draft pays this step (everything offered, if not adaptive).
        Timing differs between tensor-parallel ranks, so rank 0's plan is the one used."""
        if not self.options.adaptive:
            return DraftPlan.everything(offers, self_budget)
        draining = self._steps_since_admission > DRAIN_AFTER_STEPS
        plan = self.controller.plan(offers, self_budget, draining)
        shared = same_on_all_ranks(torch.tensor(
            [plan.self_length, plan.explored, *plan.lookup_lengths, *plan.self_rows], device=self._device)).tolist()
        n = len(offers)
        return DraftPlan(shared[2:2 + n], shared[0], bool(shared[1]), [bool(x) for x in shared[2 + n:]])

    @staticmethod
    def _tokens_left(request) -> int | None:
        """Tokens a request may still generate before max_tokens (None: no limit)."""
        params = request.sampling_params
        if params is None or params.max_tokens is None:
            return None
        return params.max_tokens - len(request.output_token_ids)

    def _draft_budget(self, tokens_left: int | None) -> int:
        """How many draft tokens can still be used: verification emits accepted drafts plus one
        token, so a request with r tokens left can use at most r - 1."""
        k = self.num_speculative_tokens
        return k if tokens_left is None else max(0, min(k, tokens_left - 1))

    def forget(self, req_id: str, request=None) -> None:
        """The runner dropped this request (finished or aborted): drop its mask and rates, and
        keep its output for later requests to draft from."""
        self.masks.pop(req_id, None)
        self.controller.forget(req_id)
        if self._history is not None and request is not None and request.output_token_ids:
            self._history.add(np.array(request.output_token_ids))

    # ---- statistics: one probe pass over each new prompt ----------------------------------
    def _measure_prompts(self, runner, rows: list[int], cam) -> None:
        start_time = time.perf_counter()
        batch = runner.input_batch
        attn_mean, mlp_mean, query_lens = self._similarities(runner, rows, cam)
        for i, row in enumerate(rows):
            mask = select_skip_mask(attn_mean[i], mlp_mean[i], self.options, self._sublayer_bytes)
            req_id = batch.req_ids[row]
            self.masks[req_id] = mask
            key = prompt_key(batch.token_ids_cpu[row, :batch.num_prompt_tokens[row]])
            self.counters.measurements.append((key, attn_mean[i], mlp_mean[i], mask))
            logger.debug("self-admg request %s skips %d attention and %d MLP sublayers of %d layers",
                         req_id, sum(mask.attention), sum(mask.mlp), len(mask.attention))
        self.counters.prompts_measured += len(rows)
        self.counters.prompt_tokens_measured += int(query_lens.sum())
        seconds = time.perf_counter() - start_time
        self.counters.probe_seconds += seconds
        self.controller.observe_probe(len(rows), seconds)

    def _similarities(self, runner, rows: list[int], cam) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The probe: per row and layer, the mean cosine similarity over the prompt's last
        `stats_window` tokens across each attention and each MLP sublayer, and the tokens read."""
        batch = runner.input_batch
        prompt_lens = batch.num_prompt_tokens[rows].astype(np.int64)
        window = self.options.stats_window
        starts = np.maximum(prompt_lens - window, 0) if window else np.zeros_like(prompt_lens)
        query_lens = prompt_lens - starts
        ids = np.concatenate([batch.token_ids_cpu[r, s:p] for r, s, p in zip(rows, starts, prompt_lens)])
        positions = np.concatenate([np.arange(s, p) for s, p in zip(starts, prompt_lens)])
        row_of_token = np.repeat(np.arange(len(rows)), query_lens)
        device = runner.device
        # No slot mapping for any layer: the probe reads the prompt's cached KV, writes nothing.
        attn_md = self._attention_metadata(runner, cam, rows, query_lens, prompt_lens,
                                           slot_mapping=None, draft_index=0)
        with self._forward_context(attn_md, len(ids), slot_mapping={}):
            attn_sum, mlp_sum = similarity_sums(
                self._stream, torch.from_numpy(ids).to(device), torch.from_numpy(positions).to(device),
                torch.from_numpy(row_of_token).to(device), len(rows))
        means = torch.stack([attn_sum, mlp_sum]) / torch.from_numpy(query_lens)[:, None].to(attn_sum)
        attn_mean, mlp_mean = same_on_all_ranks(means).cpu().numpy()
        return attn_mean, mlp_mean, query_lens

    def _warm_up(self, runner, row: int, cam) -> None:
        """Pay the eager path's one-off set-up at the engine's first decode step rather than in
        the first request that self-drafts: on Qwen2.5-Coder-1.5B here the first probe cost 1.7 s
        more than later ones and the first draft step 1.2 s more, at any batch shape (NOTES,
        attempt 12). One row: a probe whose result is dropped, and a one-token draft whose KV at
        the row's next position the next step overwrites, as it does any draft's."""
        start_time = time.perf_counter()
        attn_mean, mlp_mean, _ = self._similarities(runner, [row], cam)
        mask = select_skip_mask(attn_mean[0], mlp_mean[0], self.options, self._sublayer_bytes)
        scratch: list[list[int]] = [[] for _ in range(row + 1)]
        self._draft(runner, [row], [mask], np.ones(1, np.int64), cam, scratch, record=False)
        self._warmed_up = True
        self.counters.warmup_seconds += time.perf_counter() - start_time

    # ---- drafting --------------------------------------------------------------------------
    def _draft(self, runner, rows: list[int], masks: list[SkipMask], budgets: np.ndarray, cam,
               drafts: list[list[int]], record: bool = True) -> None:
        """Greedy draft tokens for `rows` under their masks, appended to `drafts[row]`; with
        record=False (the warm-up) neither the counters nor the controller see the steps."""
        start_time = time.perf_counter()
        batch = runner.input_batch
        device = runner.device
        skip_attention = torch.tensor([m.attention for m in masks], dtype=torch.bool)
        skip_mlp = torch.tensor([m.mlp for m in masks], dtype=torch.bool)
        # q: the position of each row's last sampled token, the first one without KV.
        first_positions = batch.num_tokens_no_spec[rows].astype(np.int64) - 1
        tokens = batch.token_ids_cpu[rows, first_positions]
        active = np.arange(len(rows))  # indices into `rows` still drafting
        head_ids = self._head_ids(batch, rows, device)
        exit_threshold = self.options.draft_exit_threshold
        block_size = runner.input_batch.block_table[0].block_size
        for step in range(int(budgets.max())):
            step_start = time.perf_counter()
            positions = first_positions[active] + step
            active_rows = [rows[i] for i in active]
            positions_t = torch.from_numpy(positions).to(device)
            slots = self._slots(cam, active_rows, positions_t, block_size)
            attn_md = self._attention_metadata(
                runner, cam, active_rows, np.ones(len(active), np.int64), positions + 1,
                slot_mapping=slots, draft_index=step)
            with self._forward_context(attn_md, len(active), slot_mapping=self._slot_map(slots)):
                logits = draft_logits(self._stream, torch.from_numpy(tokens[active]).to(device),
                                      positions_t, skip_attention[active], skip_mlp[active], head_ids)
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
            active = active[confident & (budgets[active] > step + 1)]
            if record:
                self.counters.draft_steps += 1
                self.controller.observe_self_step(len(active_rows), time.perf_counter() - step_start)
            if len(active) == 0:
                break
        if not record:
            return
        self.counters.draft_calls += 1
        self.counters.draft_tokens += sum(len(drafts[r]) for r in rows)
        self.counters.draft_seconds += time.perf_counter() - start_time

    def _head_ids(self, batch, rows: list[int], device) -> HeadIds | None:
        """The draft's vocabulary for these rows (None: the full LM head)."""
        num_first = self.options.draft_vocab
        if not num_first or self._head_rows is None or num_first >= self._head_rows.shape[0]:
            return None
        contexts = np.concatenate([batch.token_ids_cpu[r, :batch.num_tokens_no_spec[r]] for r in rows])
        extra = np.unique(contexts[contexts >= num_first])
        return HeadIds(self._head_rows, num_first, torch.from_numpy(extra).to(device))

    # ---- vLLM plumbing -------------------------------------------------------------------
    @staticmethod
    def _slots(cam, rows: list[int], positions: torch.Tensor, block_size: int) -> torch.Tensor:
        """KV slots of `positions` through each row's block table (the same mapping vLLM uses)."""
        table = cam.block_table_tensor[torch.tensor(rows, device=positions.device)]
        blocks = table.gather(1, (positions // block_size).unsqueeze(1).to(table.device)).squeeze(1)
        return blocks.to(torch.int64) * block_size + positions % block_size

    def _slot_map(self, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: slots for name in self._layer_names}

    def _attention_metadata(self, runner, cam, rows, query_lens, seq_lens, slot_mapping,
                            draft_index: int) -> dict:
        """Per-layer attention metadata for a sub-batch: `rows` of this step's batch, each with a
        query of `query_lens` tokens ending at its position `seq_lens - 1`."""
        device = cam.query_start_loc.device
        query_start = torch.zeros(len(rows) + 1, dtype=torch.int32)
        query_start[1:] = torch.from_numpy(np.cumsum(query_lens)).to(torch.int32)
        seq_lens_cpu = torch.from_numpy(np.asarray(seq_lens)).to(torch.int32)
        num_tokens = int(query_start[-1])
        if slot_mapping is None:
            slot_mapping = torch.full((num_tokens,), -1, dtype=torch.int64, device=device)
        sub = dataclasses.replace(
            cam,
            query_start_loc=query_start.to(device), query_start_loc_cpu=query_start,
            seq_lens=seq_lens_cpu.to(device), num_reqs=len(rows), num_actual_tokens=num_tokens,
            max_query_len=int(np.max(query_lens)), max_seq_len=int(np.max(seq_lens)),
            block_table_tensor=cam.block_table_tensor[torch.tensor(rows, device=device)],
            slot_mapping=slot_mapping, positions=None, is_prefilling=None,
            seq_lens_cpu_upper_bound=seq_lens_cpu, req_idx=None,
            encoder_seq_lens=None, encoder_seq_lens_cpu=None,
            dcp_local_seq_lens=None, dcp_local_seq_lens_cpu_upper_bound=None,
            logits_indices_padded=None, num_logits_indices=None, max_logits_per_req=None,
            _num_computed_tokens_cache=None, _token_to_req_indices_cache=None,
        )
        per_layer = {}
        for group in runner.attn_groups[0]:
            metadata = group.build_metadata_for_drafting(sub, draft_index)
            for name in group.layer_names:
                per_layer[name] = metadata
        self._layer_names = list(per_layer)
        return per_layer

    def _forward_context(self, attn_metadata, num_tokens: int, slot_mapping):
        from vllm.config import CUDAGraphMode
        from vllm.forward_context import set_forward_context

        return set_forward_context(
            attn_metadata, self.vllm_config, num_tokens=num_tokens,
            cudagraph_runtime_mode=CUDAGraphMode.NONE, slot_mapping=slot_mapping,
            skip_compiled=True)


def same_on_all_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """Tensor-parallel ranks must take identical decisions (skip masks, draft tokens, draft
    exits), or their collectives fall out of step. Rank 0's values are used everywhere, so that
    holds by construction, whatever the rounding of each rank's all-reduce."""
    from vllm.distributed import get_tp_group

    return get_tp_group().broadcast(tensor.contiguous(), src=0)  # a no-op on one rank


def proposer_report(worker, measurements: bool = True) -> dict:
    """What a worker's self-admg proposer did, as plain (JSON-ready) data. Runs in the worker:
    `llm.collective_rpc(proposer_report)` (needs VLLM_ALLOW_INSECURE_SERIALIZATION=1, since
    vLLM pickles callables only when allowed), or by name through `SelfAdmgWorkerExtension`."""
    drafter = worker.model_runner.drafter
    if not isinstance(drafter, SelfAdmgProposer):
        return {}
    counters = drafter.counters
    report = {f.name: getattr(counters, f.name) for f in dataclasses.fields(counters)
              if f.name not in ("measurements", "steps")}
    report["live_requests"] = sorted(drafter.masks)
    if measurements:
        report["steps"] = [list(step) for step in counters.steps]
        report["measurements"] = [
            {"prompt_key": key, "attention_similarity": attn.tolist(), "mlp_similarity": mlp.tolist(),
             "skip_attention": [bool(x) for x in mask.attention], "skip_mlp": [bool(x) for x in mask.mlp]}
            for key, attn, mlp, mask in counters.measurements
        ]
    return report


class SelfAdmgWorkerExtension:
    """Lets a server report on its proposer by name, without pickled functions. Start it with
    `--worker-extension-cls vllm_selfspec.proposer.SelfAdmgWorkerExtension` and, in vLLM's dev
    mode (VLLM_SERVER_DEV_MODE=1), POST {"method": "self_admg_state"} to /collective_rpc."""

    def self_admg_state(self) -> dict:
        """Counters and the requests that currently hold a skip mask (one dict per worker)."""
        return proposer_report(self, measurements=False)


def spec_decode_counters(llm) -> dict[str, float]:
    """vLLM's own spec-decode counters of an `LLM` built with disable_log_stats=False:
    num_drafts, num_draft_tokens, num_accepted_tokens (names without the vllm: prefix)."""
    return {m.name.removeprefix("vllm:spec_decode_"): m.value for m in llm.get_metrics()
            if m.name.startswith("vllm:spec_decode_") and hasattr(m, "value")}
