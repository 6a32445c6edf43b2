# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""Eager forwards of the target over a sub-batch of this step's rows, in vLLM 0.32's terms.

The probe and the draft steps run the target's own modules outside its compiled graph. vLLM's
attention layers read their metadata and KV slots from the forward context, so each forward
gets: attention metadata for just its rows (a copy of the step's common metadata with the
batch fields replaced, and the caches that belong to the full batch cleared), the KV slots of
the positions it writes (through each row's block table, as vLLM maps them; none for the
probe, which only reads), and a forward context with compilation and CUDA graphs off.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

# KV cache group of the decoder's attention layers (self-admg refuses models with several).
KV_GROUP = 0


class DraftForward:
    def __init__(self, runner, vllm_config, common_attn_metadata):
        self.runner = runner
        self.vllm_config = vllm_config
        self.step_metadata = common_attn_metadata
        self.device = runner.device
        self.block_size = runner.input_batch.block_table[KV_GROUP].block_size

    def probe(self, rows: list[int], query_lens: np.ndarray, seq_lens: np.ndarray):
        """Context for one forward over each row's last `query_lens` prompt tokens, ending at
        position `seq_lens - 1`: reads the cached KV, writes none."""
        attn = self._attention_metadata(rows, query_lens, seq_lens, slot_mapping=None, draft_index=0)
        return self._context(attn, int(query_lens.sum()), slot_mapping={})

    def draft_step(self, rows: list[int], positions: np.ndarray, draft_index: int):
        """Context for one token per row at `positions`, writing its KV there."""
        positions_t = torch.from_numpy(positions).to(self.device)
        slots = self._slots(rows, positions_t)
        attn = self._attention_metadata(
            rows, np.ones(len(rows), np.int64), positions + 1, slot_mapping=slots, draft_index=draft_index
        )
        return self._context(attn, len(rows), slot_mapping={name: slots for name in attn})

    def _slots(self, rows: list[int], positions: torch.Tensor) -> torch.Tensor:
        """KV slots of `positions` through each row's block table (the same mapping vLLM uses)."""
        table = self.step_metadata.block_table_tensor[torch.tensor(rows, device=positions.device)]
        blocks = table.gather(1, (positions // self.block_size).unsqueeze(1).to(table.device)).squeeze(1)
        return blocks.to(torch.int64) * self.block_size + positions % self.block_size

    def _attention_metadata(self, rows, query_lens, seq_lens, slot_mapping, draft_index: int) -> dict:
        """Per-layer attention metadata for `rows` of this step's batch, each with a query of
        `query_lens` tokens ending at its position `seq_lens - 1`."""
        cam = self.step_metadata
        device = cam.query_start_loc.device
        query_start = torch.zeros(len(rows) + 1, dtype=torch.int32)
        query_start[1:] = torch.from_numpy(np.cumsum(query_lens)).to(torch.int32)
        seq_lens_cpu = torch.from_numpy(np.asarray(seq_lens)).to(torch.int32)
        num_tokens = int(query_start[-1])
        if slot_mapping is None:
            slot_mapping = torch.full((num_tokens,), -1, dtype=torch.int64, device=device)
        sub = dataclasses.replace(
            cam,
            query_start_loc=query_start.to(device),
            query_start_loc_cpu=query_start,
            seq_lens=seq_lens_cpu.to(device),
            num_reqs=len(rows),
            num_actual_tokens=num_tokens,
            max_query_len=int(np.max(query_lens)),
            max_seq_len=int(np.max(seq_lens)),
            block_table_tensor=cam.block_table_tensor[torch.tensor(rows, device=device)],
            slot_mapping=slot_mapping,
            positions=None,
            is_prefilling=None,
            seq_lens_cpu_upper_bound=seq_lens_cpu,
            req_idx=None,
            encoder_seq_lens=None,
            encoder_seq_lens_cpu=None,
            dcp_local_seq_lens=None,
            dcp_local_seq_lens_cpu_upper_bound=None,
            logits_indices_padded=None,
            num_logits_indices=None,
            max_logits_per_req=None,
            _num_computed_tokens_cache=None,
            _token_to_req_indices_cache=None,
        )
        per_layer = {}
        for group in self.runner.attn_groups[KV_GROUP]:
            metadata = group.build_metadata_for_drafting(sub, draft_index)
            for name in group.layer_names:
                per_layer[name] = metadata
        return per_layer

    def _context(self, attn_metadata: dict, num_tokens: int, slot_mapping: dict):
        from vllm.config import CUDAGraphMode
        from vllm.forward_context import set_forward_context

        return set_forward_context(
            attn_metadata,
            self.vllm_config,
            num_tokens=num_tokens,
            cudagraph_runtime_mode=CUDAGraphMode.NONE,
            slot_mapping=slot_mapping,
            skip_compiled=True,
        )


def same_on_all_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """Tensor-parallel ranks must take identical decisions (skip masks, draft tokens, draft
    exits, plans), or their collectives fall out of step. Rank 0's values are used everywhere,
    so that holds by construction, whatever the rounding of each rank's all-reduce."""
    from vllm.distributed import get_tp_group

    return get_tp_group().broadcast(tensor.contiguous(), src=0)  # a no-op on one rank


def rank0_ints(values: list[int], device) -> list[int]:
    """Rank 0's list of ints on every rank (`same_on_all_ranks`); on one rank, the list itself,
    with no tensor made: this is asked every step."""
    from vllm.distributed import get_tp_group

    if get_tp_group().world_size == 1:
        return list(values)
    return same_on_all_ranks(torch.tensor(values, device=device)).tolist()


def max_over_ranks(flags: list[int]) -> list[int]:
    """The element-wise maximum of each tensor-parallel rank's flags: the ranks' one agreement
    per step on whether to draft (`fail_safe`). One small all-reduce on the group's CPU (gloo)
    communicator; on one rank, the flags themselves."""
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    if group.world_size == 1:
        return list(flags)
    values = torch.tensor(flags, dtype=torch.int64)
    torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX, group=group.cpu_group)
    return values.tolist()


def meet_after(work):
    """`work()`, this rank's own part of a draft up to its next collective, then a checkpoint
    where the tensor-parallel ranks meet (one small all-reduce; nothing on one rank): if any
    rank's part failed, every rank stops here together, so that none waits in a collective the
    others never reach. This rank's own fault is raised as it is; another's as `RanksStopped`."""
    from vllm_selfspec.operations.fail_safe import RanksStopped

    try:
        result, fault = work(), None
    except Exception as err:
        result, fault = None, err
    (failed,) = max_over_ranks([int(fault is not None)])
    if fault is not None:
        raise fault
    if failed:
        raise RanksStopped("another tensor-parallel rank failed its part of this draft")
    return result


def tensor_parallel_rank() -> int:
    from vllm.distributed import get_tp_group

    return get_tp_group().rank_in_group
