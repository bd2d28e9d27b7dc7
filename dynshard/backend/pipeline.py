"""Planning a pipeline: cut the captured graph into stages, pick the schedules, and build the plan whose
stages each rank compiles (its own only) on first use, per micro-batch shape."""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.fx as fx

from .. import compat
from ..config import Config
from ..config.planner import Planner, planner
from ..passes import (PassContext, cast_to_compute_dtype, copy_graph, fold_eager_attention, recognize_causal_masks,
                      run_passes)
from ..passes.cut_stages import assign_stages, split_stages
from ..passes.lower_to_aten import draws_random
from ..planning import Plan, PlanFileError, TensorChoice
from ..planning.plan import mesh_of
from ..runtime.mesh import Layout
from ..runtime.pipeline.groups import PipelineGroups
from ..runtime.pipeline.program import PipelinePlan, ValueMeta
from ..runtime.buffer_sync import BufferSync
from ..runtime.graph_inputs import batch_size_inputs
from ..runtime.pipeline.schedules import build_schedule
from ..runtime.unit_inputs import InputCheck
from ..runtime.materialize import default_device
from .plan_once import plan_once
from .retrace import FrameCall, MicroBatchRetrace
from .shapes import check_micro_batch_split
from .stage_compile import StageCompiler
from .stage_plans import merge_stage_plans, plan_stages

log = logging.getLogger("dynshard")

# a pipeline's phases: lower (what the whole graph needs before it is cut) and cut (-> a graph per stage)
PIPELINE_LOWER = [
    fold_eager_attention,   # (before the masks: an eager attention's mask is then the attention op's)
    recognize_causal_masks,  # before the cut: a mask made in one stage and read in the next is a boundary value
    cast_to_compute_dtype,  # mixed precision: parameters (and inputs) enter in param_dtype
]
PIPELINE_CUT = [
    assign_stages,          # every op gets a stage: pipe_split(), pivots, or the model's layers by FLOPs
    split_stages,           # one graph per stage, with the values each boundary carries
]


def plan_pipeline(gm: fx.GraphModule, example_inputs, config: Config, outline: Plan, layout: Layout, inputs,
                  key: str, device_type: str, made_for=None, given: Plan | None = None) -> PipelinePlan:
    """``outline.pipeline`` (the given plan's, or the config's) planned for ``gm``: cut (as given, or by the
    pp policy), each hybrid stage placed, and the schedules built."""
    pipeline = outline.pipeline
    nstages, nranks, m = pipeline.nsegments, layout.pp_size, pipeline.nmicros
    first = pipeline.all_device_first
    schedule = build_schedule(pipeline.schedule, nstages, m, nranks, first)
    check_micro_batch_split(inputs, m)
    ctx = PassContext(config=config, outline=outline, layout=layout, inputs=inputs, fake_mode=compat.new_fake_mode(),
                      made_for=made_for, given=given)
    _cut_once(copy_graph(gm), ctx, key, schedule)
    forward_only = build_schedule("infer_pipe", nstages, m, nranks, first)
    gpipe = None
    if not config.inference_only:
        gpipe = schedule if pipeline.nchunks > 1 else build_schedule("gpipe", nstages, m, nranks, first)
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    outputs = output_node.args[0] if isinstance(output_node.args[0], (tuple, list)) else [output_node.args[0]]
    log.info("pipeline: %s\n%s", ctx.staged.describe(), schedule.format())
    device = default_device(device_type)

    def combine():
        from ..passes.microbatch_outputs import microbatch_combine

        # (a 0-d input has no batch dimension: every micro-batch reads it whole, as the split passes it;
        # Trainer's num_items_in_batch, the count a summed loss is divided by, is one)
        batch_inputs = [i.index for i in inputs if i.kind == "input" and len(i.shape) > 0]
        # by their metadata: by now this rank holds only its stages' parameters
        examples = [i.value if i.kind == "size" else torch.empty(i.shape, dtype=i.dtype, device="meta") for i in inputs]
        return microbatch_combine(gm, examples, batch_inputs, m, batch_size_inputs(inputs))

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    frame = FrameCall.capture(compat.compiling_frame(), {
        i.index: compat.grapharg_source_name(placeholders[i.index]) for i in inputs if i.kind == "input"})
    retrace = None if frame is None else MicroBatchRetrace(frame, dataclasses.replace(
        config, policy=replaying(ctx.plan), pas_config={}, load_plan_path=None))
    return PipelinePlan(
        key=key, retrace=retrace, config=config, inputs=inputs, staged=ctx.staged, schedule=schedule, gpipe=gpipe,
        forward_only=forward_only, groups=PipelineGroups(layout), layout=layout, device=device,
        output_metas=[_meta(o) for o in outputs], combine_fn=combine,
        compile_stage=StageCompiler(ctx, schedule, layout, key, device_type), pass_timings=ctx.timings, plan=ctx.plan,
        input_check=InputCheck.for_program(inputs, layout, config.verify_inputs_every,
                                           layout.tp_size > 1 and draws_random(gm, ctx)),
        buffer_sync=BufferSync.for_inputs(inputs, layout.dp_group, config.broadcast_buffers))


def replaying(plan: Plan) -> Planner:
    """The planner of the graph Dynamo traces again at the micro-batch shape (a graph that holds the batch's
    sizes): it runs ``plan`` again, its cut and placements by node key, at the shapes its inputs arrive in."""
    def replay(planning) -> Plan:
        tensors = {name: dataclasses.replace(choice, shape=planning.tensors[name].shape)
                   if name in planning.tensors else choice for name, choice in plan.tensors.items()}
        return dataclasses.replace(plan, made_for=planning.made_for, tensors=tensors)
    replay.__qualname__ = f"replay of plan {plan.digest()}"
    return planner(replay)


def _cut_once(gm: fx.GraphModule, ctx: PassContext, key: str, schedule) -> None:
    """The pipeline passes, with the pipeline planned once per job (:func:`.plan_once.plan_once`): rank 0
    measures and cuts (and, under hybrid, places each stage's tensors), the other ranks install its plan
    and measure nothing."""
    with plan_once(ctx, key) as agreement:
        graph = run_passes(gm, ctx, PIPELINE_LOWER)
        agreement.receive()        # the other ranks: rank 0's cut (and hybrid stages' placements)
        run_passes(graph, ctx, PIPELINE_CUT)
        ctx.plan = pipeline_plan(ctx, schedule)
        agreement.send()


def pipeline_plan(ctx: PassContext, schedule, place_stages: bool = True) -> Plan:
    """The pipeline's decisions (after the stage passes): the cut, the schedule, and its tensors (whole on
    every pipeline rank, or placed by each stage's tp policy under hybrid, :mod:`.stage_plans`; ZeRO rows
    over dp for trainable ones when use_zero). ``place_stages=False``: a hybrid plan's stages are left
    unplaced (``tp`` None: each stage's tp policy decides when it compiles)."""
    outline, layout, given = ctx.outline, ctx.layout, ctx.given
    tensors = {}
    input_stages = ctx.stage_info.input_stages
    for inp in ctx.inputs:
        zero = bool(outline.zero.level) and layout.dp_size > 1 and inp.is_state and inp.requires_grad
        tensors[inp.name] = TensorChoice.of(inp, "R" if layout.tp_size == 1 or not inp.is_state else None,
                                            "zero" if zero else None, tuple(input_stages[inp.index]))
    hybrid = layout.tp_size > 1
    if given is not None:
        for name, choice in given.tensors.items():
            if choice.dp != tensors[name].dp or (not hybrid and choice.tp != tensors[name].tp):
                raise PlanFileError(
                    f"dynshard: the plan gives {name} tp={choice.tp!r} dp={choice.dp!r} in a pipeline, which runs it "
                    f"as tp={tensors[name].tp!r} dp={tensors[name].dp!r}: per-tensor ZeRO choices inside pipelines, "
                    "and tp placements without tp ranks, are not built (edit the stage starts, schedule, ZeRO level, "
                    "recompute, or a hybrid stage's tp placements)")
    info = ctx.stage_info
    pipeline = dataclasses.replace(
        outline.pipeline, starts=tuple(info.starts), how=info.how, flops=tuple(info.flops),
        stage_ranks=tuple(schedule.ranks_of(s) for s in range(schedule.nstages)))
    plan = Plan(made_for=ctx.made_for, policy=outline.policy, mesh=mesh_of(layout), zero=outline.zero,
                tensors=tensors, recompute=outline.recompute, mixed_precision=outline.mixed_precision,
                pipeline=pipeline, predicted=outline.predicted)
    if not hybrid:
        return plan
    # the stages' placements as given; a given cut that leaves every stage to its tp policy (null) is placed
    # below, as each stage's tp policy will place it when it compiles
    if given is not None and any(given.tensors[n].tp is not None for n, t in tensors.items() if t.kind != "input"):
        return dataclasses.replace(plan, tensors={n: dataclasses.replace(t, tp=given.tensors[n].tp if t.kind != "input"
                                                                          else t.tp) for n, t in tensors.items()},
                                   activations=given.activations)
    if not place_stages:
        return plan
    placed = {s.index for s in ctx.staged.stages if not schedule.on_every_rank(s.index)}
    return merge_stage_plans(plan, plan_stages(ctx, ctx.staged.stages, placed))


def _meta(node) -> ValueMeta | None:
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    if not isinstance(value, torch.Tensor):
        return None
    return ValueMeta(value.shape, value.dtype, value.requires_grad)

