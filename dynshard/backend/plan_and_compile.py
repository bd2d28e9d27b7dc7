"""The compile path of one graph, top to bottom: the passes' four phases (lower, place, propagate, rewrite),
the plan agreed across ranks between the first two and the last two, then the per-rank compile of the
program they leave. Every planned program (a whole graph, a pipeline stage split over tp, the accumulation
variant) goes through it."""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx as fx

from .. import compat
from ..config import Config
from ..passes import LOWER, PLACE, PROPAGATE, REWRITE, PassContext, copy_graph, run_passes
from ..passes.lower_to_aten import lowers
from ..runtime.materialize import default_device
from ..runtime.sharding import stored_shape
from ..runtime.zero import zero_groups
from .compile import compile_program
from .plan_once import PlanAgreement
from .reshard import reshard_pass

ASYNC_BUCKET_CAP_MB = 25


def plan_and_compile(gm: fx.GraphModule, ctx: PassContext, device_type: str, agreement: PlanAgreement | None = None,
                     backward=None, example_inputs: Sequence[Any] = ()):
    """The passes, then the per-rank compile of their program. ``agreement``: this rank's part in the plan
    agreed across ranks (:func:`.plan_once.plan_once`; None where the plan is known: a variant, a stage);
    ``backward``: compiles the backward graph, see compile_program; ``example_inputs``: Dynamo's, which a
    graph of symbolic sizes compiles on."""
    config, layout = ctx.config, ctx.layout
    lowered = run_passes(copy_graph(gm), ctx, LOWER)   # passes may edit the graph; the variant reuses gm
    if agreement is not None:
        agreement.receive()       # the other ranks: rank 0's plan, given from here on
    placed = run_passes(lowered, ctx, PLACE)
    if agreement is not None:
        agreement.send()          # rank 0: the plan it made, while every rank propagates it
    rewritten = run_passes(run_passes(placed, ctx, PROPAGATE), ctx, REWRITE)
    local_inputs = [local_example(inp, ctx.placements[inp.index], ctx.zero_of(inp), layout) for inp in ctx.inputs]
    # one program for every size of the family, compiled on Dynamo's symbols, where the passes do not lower
    # the graph; else the program is compiled at the inputs' sizes (see .shapes)
    symbolic = not lowers(layout, ctx.outline) and any(inp.is_symbolic for inp in ctx.inputs)
    if symbolic:
        local_inputs = compat.symbolic_examples(example_inputs, local_inputs)
    program = compile_program(rewritten, local_inputs, config.compiler, layout, config.inference_only,
                              freeze=config.constant_folding, partition_pass=_reshard_pass(ctx),
                              inductor_patches=compat.bucketing_patches(
                                  bool(ctx.zero) and ctx.sync_grads, _bucket_cap_mb(config),
                                  config.use_async_reducer and device_type == "cuda"), backward=backward,
                              blocks_only=config.compile_scope == "blocks", share_traces=config.share_traces,
                              symbolic=symbolic)
    program.split_outputs = ctx.split_outputs     # recorded while the program was traced
    program.outlined = ctx.outlined
    return program


def _bucket_cap_mb(config: Config) -> float | None:
    """nnScaler's and DDP's default: 25 MB buckets when reduction overlaps the backward, else one bucket."""
    if config.reducer_bucket_cap_mb:
        return config.reducer_bucket_cap_mb
    return ASYNC_BUCKET_CAP_MB if config.use_async_reducer else None


def _reshard_pass(ctx: PassContext):
    """ZeRO-3 frees gathered parameters after the forward (see :mod:`.reshard`)."""
    if ctx.outline.zero.level < 3 or not ctx.zero or not ctx.sync_grads:
        return None
    groups = {zero_groups(ctx.layout, spec.ngroups).shard_name for spec in ctx.zero.values()}
    return reshard_pass(groups)


def local_example(inp, placements, zero, layout) -> torch.Tensor:
    """A tensor of the shape and device ``inp`` arrives in at run time; a meta parameter (a meta-built model
    Dynamo traced as it is) arrives materialised on the current device."""
    shape = stored_shape(inp.shape, layout, placements, zero) if inp.is_state or inp.is_split_value else inp.shape
    device = default_device(layout.device_type) if inp.device.type == "meta" else inp.device
    if inp.kind == "size":
        return inp.value
    return torch.empty(shape, dtype=inp.dtype, device=device).requires_grad_(inp.requires_grad)
