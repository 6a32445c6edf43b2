# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""What the proposer tracks per request for drafts that cost no forward: each row's tenant, its
quarantine, its tenant's history of earlier outputs, and where its output stands in its own
prediction, if it sent one. The proposer asks `find` for each row's draft in a step: the
prediction's where the output follows it (the request's own guess of its answer), unless a
lookup draft matches more of the context than the output has followed the prediction, else the
best lookup draft; and hands every request that ends to `forget`.
No vLLM: the step is read through `vllm_integration.runner_state.StepView`.

A row whose own lookup raises while the others' do not is that request's fault: it is
quarantined with its prompt (`fail_safe.RequestQuarantine`), drafts no more, and its output is
not kept; the other rows' drafts go on. If every row's lookup raises, the step faults (nobody is
blamed for what strikes all). A history that raises is dropped for its tenant.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from vllm_selfspec.control import DraftSource
from vllm_selfspec.control.acceptance import SOURCE_INDEX
from vllm_selfspec.operations import fail_safe
from vllm_selfspec.operations.fail_safe import FailSafe, RequestQuarantine, fault_point
from vllm_selfspec.options import SelfAdmgOptions
from vllm_selfspec.sources.lookup import (
    UNKNOWN_TENANT,
    OutputHistory,
    TenantHistories,
    context_drafts,
    lookup_draft,
)
from vllm_selfspec.sources.request_predictions import RequestPredictions
from vllm_selfspec.sources.step_drafts import Found, StepDrafts
from vllm_selfspec.vllm_integration.runner_state import StepRows

logger = logging.getLogger("vllm.selfspec")


class RowLookup:
    def __init__(self, options: SelfAdmgOptions, fail_safe: FailSafe):
        self.options = options
        self.fail_safe = fail_safe
        self.history = (
            TenantHistories(
                options.lookup_history,
                max_tenants=options.lookup_history_tenants,
                share_unsalted=options.lookup_history_unsalted,
            )
            if options.lookup and options.lookup_history
            else None
        )
        self.quarantine = RequestQuarantine()
        self.tenants: dict[str, bytes | None] = {}  # live requests' salt digests (None: no salt)
        self.predictions = RequestPredictions(options.max_prediction_tokens)
        self.seconds = 0.0  # the last `find`'s time and rows looked up, for the lookup gate
        self.batch_failed = False  # whether a batch's lookup at once (`context_drafts`) has raised
        self.rows_looked_up = 0

    def admit(self, tenants, live_requests) -> None:
        """The tenants of the requests a step admitted (`first_tokens.SchedulerNote.tenants`).
        Requests leave through `forget`; should one never be forgotten, those the runner no
        longer holds are dropped (with their cursors) once a map outgrows the runner's requests."""
        self.tenants.update(tenants)
        if len(self.tenants) > 2 * len(live_requests) + 64:
            self.tenants = {r: t for r, t in self.tenants.items() if r in live_requests}
        self.predictions.keep_only(live_requests)

    def tenant(self, req_id: str):
        return self.tenants.get(req_id, UNKNOWN_TENANT)

    def allowed(self, step, row) -> bool:
        """Whether the row's request is out of quarantine: neither blamed itself nor a twin of
        one blamed (n > 1, or its prompt resent within its tenant)."""
        return self.quarantine.allows(row.req_id, lambda: (self.tenant(row.req_id), step.prompt(row.index)))

    def budgets(self, step, rows: StepRows, k: int) -> list[int]:
        """Each row's draft budget of at most k tokens: 0 for a row whose sampling only the plain
        sampler applies, or whose request is in quarantine (none is, mostly: then no row asks)."""
        budgets = rows.budgets(k).tolist()
        if not self.quarantine.empty:  # (asked of every row that may draft: a twin is found so)
            may_draft = rows.may_draft.tolist()
            budgets = [b if not may_draft[i] or self.allowed(step, rows[i]) else 0 for i, b in enumerate(budgets)]
        return budgets

    def find(self, step, rows, budgets: list[int], look_up: bool) -> StepDrafts:
        """Each row's draft: its prediction's or its best lookup draft if `look_up`, whichever
        matches more (the prediction's on a tie; none where neither offers one or the budget
        is 0). `budgets`: 0 for a row out of quarantine (`allowed`); a row whose lookup raises
        is quarantined now, and its budget set to 0. The rows' predictions are followed in one
        compiled call (`request_predictions`), and the rows look up their contexts, with their
        tenant's history where it has one, in one more call per history (`lookup.context_drafts`)."""
        fault_point("lookup")
        rows = rows if isinstance(rows, StepRows) else StepRows.of(rows)
        drafts = StepDrafts.empty(len(rows), max(budgets, default=0))
        drafting = [i for i, budget in enumerate(budgets) if budget]
        failed: list = []  # (index into rows, row, error)
        stands_alone = self.predictions.drafts(
            step, rows, budgets, drafting, drafts, failed, self.options.lookup_max_match
        )
        lookup_seconds, self.rows_looked_up = 0.0, 0
        if self.options.lookup and look_up:
            looked_up = drafting
            # (a row whose prediction stands alone, or raised, is not looked up)
            if failed or np.count_nonzero(stands_alone):
                skipped = stands_alone.tolist()
                for i, _, _ in failed:
                    skipped[i] = True
                looked_up = [i for i in drafting if not skipped[i]]
            self.rows_looked_up = len(looked_up)
            for pool, at in self._by_pool(step, rows, looked_up, failed):
                looked_up_at = time.perf_counter()
                self._look_up(step, rows, budgets, at, drafts, failed, pool)
                lookup_seconds += time.perf_counter() - looked_up_at
        if failed and len(failed) == len(drafting) > 1:
            raise failed[0][2]
        for i, row, err in failed:
            self.fail_safe.record(err, one_request=True)
            self.quarantine.blame(row.req_id, self.tenant(row.req_id), step.prompt(row.index))
            budgets[i] = 0
        self.seconds = lookup_seconds  # what the lookup gate weighs: lookups only, not predictions
        return drafts

    def _by_pool(self, step, rows, at: list[int], failed: list) -> list[tuple[OutputHistory | None, list[int]]]:
        """The rows `at` (by index into `rows`) grouped by their tenant's history (None: the rows
        whose tenant has none), each group looked up in one call. A row whose history cannot be
        found is failed."""
        # (no tenant has a pool yet, mostly: then every row looks up its own context)
        if (self.history is None or not self.history.tenants) and fail_safe.fault_hook is None:
            return [(None, at)] if at else []
        groups: dict[int, tuple[OutputHistory | None, list[int]]] = {}
        for i in at:
            row = rows[i]
            try:
                pool = self.history.pool(self.tenant(row.req_id)) if self.history is not None else None
                fault_point("lookup", tokens=step.context(row.index))
            except Exception as err:
                failed.append((i, row, err))
                continue
            groups.setdefault(id(pool), (pool, []))[1].append(i)
        return list(groups.values())

    def _look_up(self, step, rows, budgets, at: list[int], drafts: StepDrafts, failed: list, pool) -> None:
        """The lookup drafts of the rows `at` (by index into `rows`), from their own contexts and
        their tenant's history `pool` (or none), in one call (a single row without a history
        alone), each kept in `drafts` where it matches more than the row's prediction. Should
        the call raise, each row is looked up alone, so that a fault is blamed on its row (or its
        tenant's history)."""
        full = [budgets[i] for i in at]
        # (one row without a history is looked up alone: a call over a batch costs it more than
        # it saves; a history's lookup costs less in one call even for one row)
        if len(at) > 1 or pool is not None:
            try:
                at_rows = np.array(at, dtype=np.int64)
                indices, full_budgets = rows.index[at_rows], np.array(full, dtype=np.int64)
                context_drafts(
                    step.token_ids,
                    indices,
                    step.context_lengths(indices),
                    self.options.uncopied_budgets(full_budgets),
                    full_budgets=full_budgets,
                    max_match=self.options.lookup_max_match,
                    into=drafts,
                    at=at_rows,
                    source=SOURCE_INDEX[DraftSource.LOOKUP],
                    pool=pool,
                    pool_source=SOURCE_INDEX[DraftSource.HISTORY],
                )
            except Exception as err:
                # (visible once: each row alone still drafts, but the step pays for both)
                logger.log(
                    logging.DEBUG if self.batch_failed else logging.WARNING,
                    "self-admg's lookup of a batch's rows at once failed; each row is looked up alone: %r",
                    err,
                    exc_info=not self.batch_failed,
                )
                self.batch_failed = True
            else:
                return
        for i, budget in zip(at, full):
            try:
                # (its history found anew: a row before it may have found it at fault, and dropped it)
                history = self.history.pool(self.tenant(rows[i].req_id)) if pool is not None else None
                looked_up = self._row(step, rows[i], budget, history)
                if better_draft(drafts[i], looked_up) is looked_up:
                    drafts.put(i, looked_up)
            except Exception as err:
                failed.append((i, rows[i], err))

    def _row(self, step, row, budget: int, history: OutputHistory | None = None) -> Found:
        """The row's lookup draft, alone: from its own context and its tenant's `history`."""
        context = step.context(row.index)
        fault_point("lookup", tokens=context)
        try:
            return budgeted_lookup_draft(context, budget, history, self.options)
        except Exception as err:
            if history is None:
                raise
            # The tenant's history may be what raises: it goes, and the row drafts from its own
            # context (if that raises too, the row is at fault).
            self.history.forget(self.tenant(row.req_id))
            self.fail_safe.record(err, one_request=True)
            return budgeted_lookup_draft(context, budget, None, self.options)

    def forget(self, req_id: str, request=None) -> None:
        """The request ended: keep its output for its tenant's later requests, unless it was
        quarantined (its output may be what faults) or a stop string ended it (the front end
        cut it at a point the worker does not know: its tail was never sent)."""
        tenant = self.tenants.pop(req_id, UNKNOWN_TENANT)
        self.predictions.forget(req_id)
        quarantined = req_id in self.quarantine.requests
        self.quarantine.forget(req_id)
        params = getattr(request, "sampling_params", None)
        if (
            self.history is not None
            and not quarantined
            and request is not None
            and request.output_token_ids
            and not (params is not None and params.stop)
        ):
            self.history.add(tenant, request.output_token_ids)  # (read only where it has a pool)

    def forget_history(self) -> None:
        """Forget every earlier output (vLLM reset its prefix cache, or the worker sleeps)."""
        if self.history is not None:
            self.history.clear()


def better_draft(found: Found, looked_up: Found) -> Found:
    """A row's lookup draft where it matches more than the draft `found` (its prediction's,
    or none)."""
    if len(looked_up[1]) and (not len(found[1]) or looked_up[1].match > found[1].match):
        return looked_up
    return found


def budgeted_lookup_draft(context, budget: int, history, options: SelfAdmgOptions) -> Found:
    """A row's lookup draft of at most `max_draft_unless_copying` tokens, as a lookup of that
    budget finds it; only a copy (it matches as many of the context's last tokens as a lookup
    compares, `lookup_max_match`) is looked up again for the row's whole budget."""
    max_match = options.lookup_max_match
    capped = options.uncopied_budget(budget)
    found = lookup_draft(context, capped, max_match, history)
    if capped < budget and found[1].match >= max_match:
        found = lookup_draft(context, budget, max_match, history)
    return found
