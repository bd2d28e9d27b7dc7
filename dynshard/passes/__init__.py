"""The ordered pass pipeline: each pass is ``(graph_module, context) -> graph_module``."""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch.fx as fx

from .assign_placements import assign_placements
from .cast_to_compute_dtype import cast_to_compute_dtype
from .context import PassContext
from .exact_mean_losses import exact_mean_losses
from .insert_collectives import insert_collectives
from .lower_to_aten import lower_to_aten
from .outline_repeated_blocks import outline_repeated_blocks
from .propagate_sharding import propagate_sharding
from .split_fused_experts import split_fused_experts
from .split_fused_projections import split_fused_projections
from .tag_recompute import tag_recompute
from .warn_gathered_outputs import warn_gathered_outputs

Pass = Callable[[fx.GraphModule, PassContext], fx.GraphModule]

PASSES: list[Pass] = [
    cast_to_compute_dtype,  # mixed precision: parameters (and inputs) enter in param_dtype
    lower_to_aten,        # Dynamo graph -> ATen graph on FakeTensors (global shapes)
    split_fused_projections,  # c_attn(x).split(C) -> one matmul per block of the fused weight
    split_fused_experts,  # MoE: gate_up_proj's expert matmul -> one per block (gate, up)
    exact_mean_losses,    # mean nll_loss -> its sum / its total weight (exact over split rows: padding)
    assign_placements,    # the policy places parameters, buffers and inputs
    propagate_sharding,   # every node's placement, the collectives the plan costs, fallbacks
    warn_gathered_outputs,  # outputs split in the unit that every step gathers whole (logits, KV cache)
    insert_collectives,   # -> the per-rank program: local tensors in and out, DTensor in between
    tag_recompute,        # recompute_modules: partitioner recompute tags (after the collectives exist,
                          # so that dynshard's own communication stays saved, never recomputed)
    outline_repeated_blocks,  # regional compilation: each repeated block becomes a call of one subgraph
]

log = logging.getLogger("dynshard")


def run_passes(gm: fx.GraphModule, ctx: PassContext, passes: list[Pass] | None = None) -> fx.GraphModule:
    for graph_pass in PASSES if passes is None else passes:
        start = time.perf_counter()
        gm = graph_pass(gm, ctx)
        elapsed = time.perf_counter() - start
        ctx.timings.append((graph_pass.__name__, elapsed))
        log.debug("pass %s: %.3fs, %d nodes", graph_pass.__name__, elapsed, len(gm.graph.nodes))
    return gm


__all__ = ["PASSES", "PassContext", "run_passes", "cast_to_compute_dtype", "lower_to_aten", "assign_placements",
           "propagate_sharding", "insert_collectives", "split_fused_projections", "tag_recompute",
           "outline_repeated_blocks", "exact_mean_losses", "warn_gathered_outputs", "split_fused_experts"]
