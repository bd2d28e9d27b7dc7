"""Planning a pipeline: cut the captured graph into stages, pick the schedules, and build the plan whose
stages each rank compiles (its own only) on first use, per micro-batch shape."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time

import torch
import torch.fx as fx

from .. import compat
from ..config import Config
from ..passes import PassContext, cast_to_compute_dtype, run_passes
from ..passes.cut_stages import assign_stages, split_stages
from ..passes.tag_recompute import tag_single_process
from ..runtime.mesh import Layout, layout_for
from ..runtime.pipeline.groups import PipelineGroups
from ..runtime.pipeline.program import PipelinePlan, ValueMeta
from ..runtime.pipeline.retrace import FrameCall
from ..runtime.buffer_sync import BufferSync
from ..runtime.pipeline.schedules import build_schedule
from ..runtime.program import CompiledPlan, ShardedProgram
from ..runtime.unit_inputs import InputCheck
from .capture import describe_inputs
from .compile import compile_program
from .split_backward import compiled_backward

log = logging.getLogger("dynshard")

PIPELINE_PASSES = [
    cast_to_compute_dtype,  # mixed precision: parameters (and inputs) enter in param_dtype
    assign_stages,          # every op gets a stage: pipe_split(), pivots, or the model's layers by FLOPs
    split_stages,           # one graph per stage, with the values each boundary carries
]


def plan_pipeline(gm: fx.GraphModule, example_inputs, config: Config, layout: Layout, inputs, key: str,
                  device_type: str) -> PipelinePlan:
    from ..runtime.materialize import default_device

    from . import copy_graph

    ctx = PassContext(config=config, layout=layout, inputs=inputs, fake_mode=compat.new_fake_mode())
    _cut_once(copy_graph(gm), ctx, key)
    options = config.pipeline
    nstages, nranks, m = options.nsegments(config), layout.pp_size, options.pipeline_nmicros
    first = options.all_device_first
    schedule = build_schedule(options.pipeline_scheduler, nstages, m, nranks, first)
    forward_only = build_schedule("infer_pipe", nstages, m, nranks, first)
    gpipe = None
    if not config.inference_only:
        gpipe = schedule if options.pipeline_nchunks > 1 else build_schedule("gpipe", nstages, m, nranks, first)
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    outputs = output_node.args[0] if isinstance(output_node.args[0], (tuple, list)) else [output_node.args[0]]
    log.info("pipeline: %s\n%s", ctx.staged.describe(), schedule.format())
    device = default_device(device_type)

    def compile_stage(stage, args, stored):
        backward = None
        if schedule.splits_backward:    # zero bubble: weight gradients deferred to the W actions
            weights = {j for j, i in enumerate(stage.graph_inputs) if inputs[i].kind == "parameter"}
            backward = functools.partial(compiled_backward, weight_outputs=weights)
        tensors = [s if s is not None else a for a, s in zip(args, stored)]
        if schedule.on_every_rank(stage.index):     # 1f1b_plus: tensor parallel over the whole unit
            unit = layout_for(config.plan_ngpus, device_type)
            return _tensor_parallel_stage(stage, tensors, config, unit, key, device_type)
        if layout.tp_size > 1:
            return _tensor_parallel_stage(stage, tensors, config, layout, key, device_type, backward)
        # (what it compiled, what the executor calls)
        examples = [torch.empty(a.shape, dtype=a.dtype, device=a.device).requires_grad_(a.requires_grad) for a in args]
        stage_ctx = PassContext(config=config, layout=layout, inputs=inputs, fake_mode=compat.new_fake_mode())
        module = tag_single_process(stage.module, examples, stage_ctx)    # recompute_modules, when asked for
        program = compile_program(module, examples, config.compiler, layout, config.inference_only, backward=backward,
                                  share_traces=config.share_traces)
        return program, program.run

    def combine():
        from ..passes.microbatch_outputs import microbatch_combine

        batch_inputs = [i.index for i in inputs if i.kind == "input"]
        # by their metadata: by now this rank holds only its stages' parameters
        examples = [torch.empty(i.shape, dtype=i.dtype, device="meta") for i in inputs]
        return microbatch_combine(gm, examples, batch_inputs, m)

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    frame_call = FrameCall.capture(compat.compiling_frame(), {
        i.index: compat.grapharg_source_name(placeholders[i.index]) for i in inputs if i.kind == "input"})
    return PipelinePlan(
        key=key, frame_call=frame_call, config=config, inputs=inputs, staged=ctx.staged, schedule=schedule, gpipe=gpipe,
        forward_only=forward_only, groups=PipelineGroups(layout), layout=layout, device=device,
        output_metas=[_meta(o) for o in outputs], compile_stage=compile_stage, combine_fn=combine,
        pass_timings=ctx.timings,
        input_check=InputCheck.for_inputs(inputs, layout.plan_ngpus, config.verify_inputs_every),
        buffer_sync=BufferSync.for_inputs(inputs, layout.dp_group, config.broadcast_buffers))


def _cut_once(gm: fx.GraphModule, ctx: PassContext, key: str) -> None:
    """The pipeline passes, with the stage cut planned once per job: rank 0 measures and cuts (or reads the
    cut in ``cache_dir``) and sends it; the other ranks install it and measure nothing (as placements are
    sent under the other policies, see ``backend._plan_once_and_compile``)."""
    from .agreement import plan_channel
    from . import PLANS

    config = ctx.config
    planned = PIPELINE_PASSES.index(assign_stages) + 1      # the passes up to the cut, then the rest
    channel = plan_channel()
    try:
        if channel is not None and not channel.planner:
            start = time.perf_counter()
            ctx.stage_info = json.loads(channel.receive())
            ctx.timings.append(("receive_plan", time.perf_counter() - start))
            run_passes(gm, ctx, PIPELINE_PASSES)
            return
        stored = PLANS.load_text(config, key)
        if stored is not None:
            ctx.stage_info = json.loads(stored)
        gm = run_passes(gm, ctx, PIPELINE_PASSES[:planned])
        if channel is not None:
            channel.send(json.dumps(ctx.stage_info))
        run_passes(gm, ctx, PIPELINE_PASSES[planned:])
    except BaseException as error:
        if channel is not None:
            channel.abandon(error)
        raise
    PLANS.save_text(config, key, json.dumps(ctx.stage_info), ctx.layout)


def _tensor_parallel_stage(stage, args, config: Config, layout: Layout, key: str, device_type: str, backward=None):
    """A hybrid plan's stage: planned by the tp policy over the stage's tp ranks, as a whole graph would be,
    without data-parallel communication (the pipeline reduces gradients once per step). Its tensors are cut
    into tp shards in place here, before the first micro-batch. ``backward``: zb1p's split backward."""
    from . import plan_and_compile

    # ZeRO is the pipeline's (rows gathered once per step), not the stage program's
    stage_config = dataclasses.replace(config, policy="tp", pas_config=config.pipeline.tp_options, use_zero=0,
                                       zero_ngroups=1, zero_use_reduce_scatter=False)
    inputs = describe_inputs(stage.module, args)
    ctx = PassContext(config=stage_config, layout=layout, inputs=inputs, fake_mode=compat.new_fake_mode(),
                      sync_grads=False)
    compiled = plan_and_compile(stage.module, ctx, device_type, backward=backward)
    plan = CompiledPlan(f"{key}/stage{stage.index}", inputs, ctx.placements, ctx.zero, layout, compiled,
                        ctx.propagation, ctx.timings, config.inference_only)
    program = ShardedProgram(plan)
    program.prepare(args)
    # the compiled program itself: ShardedProgram's call would flush the pipeline's ZeRO accumulation
    return plan.program, plan.program.run


def _meta(node) -> ValueMeta | None:
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    if not isinstance(value, torch.Tensor):
        return None
    return ValueMeta(value.shape, value.dtype, value.requires_grad)

