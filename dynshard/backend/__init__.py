"""The ``dynshard`` torch.compile backend: capture -> passes -> per-rank compile -> sharded program."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Sequence

import torch
import torch.fx as fx

from .. import compat
from ..config import Config
from ..config.planner import Planner
from ..passes import PassContext, cast_to_compute_dtype
from ..passes.assign_placements import record_plan
from ..passes.tag_recompute import tag_single_process
from ..planning.costs import with_forward_collectives
from ..planning.outline import check_runs, outline_of
from ..planning import Plan
from ..planning.plan import fingerprint
from ..policies import place
from ..runtime.mesh import ensure_process_group, layout_for, world_size
from ..runtime.pipeline.program import PipelineProgram
from ..runtime.program import CompiledPlan, ShardedProgram
from ..runtime.buffer_sync import BufferSync
from ..runtime.compile_hooks import around_dynamo_compiles
from ..runtime.graph_inputs import sizes_of
from ..runtime.ddp import watch as watch_ddp_wraps
from ..runtime.eager_guard import refuse_recompile_limit
from ..runtime.sharding import is_sharded, present_global_shapes, restore_local_shards
from ..runtime.unit_inputs import InputCheck
from .agreement import agreed_compiles, ensure_ranks_agree, ensure_ranks_agree_on_source
from .capture import describe_inputs, keep_floats_constant, raising_not_breaking
from .compile import compile_program
from .compiler import start_cpu_isa_probe
from .families import check_alone, check_together, family_key, recorded_for
from .pipeline import plan_pipeline
from .plan_and_compile import local_example, plan_and_compile
from .plan_cache import job_plans, modes_token, plan_key
from .plan_files import job_plan_files
from .plan_once import plan_once
from .shapes import at_sizes, check_symbolic_shapes, compiles_per_size, limit_automatic_dynamic
from .planner import autodist_plan, planner_plan

log = logging.getLogger("dynshard")
_logged_configs: set[str] = set()


@raising_not_breaking
def dynshard_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], options: Any = None, **kwargs):
    """Dynamo backend entry point (``torch.compile(model, backend="dynshard", options=...)``)."""
    if kwargs:
        raise TypeError(f"dynshard: unexpected backend arguments {sorted(kwargs)}; pass settings in options=")
    _hook_into_dynamo()
    config = Config.from_options(options)
    device_type = _device_type(example_inputs)
    ensure_process_group(device_type)
    inputs = describe_inputs(gm, example_inputs)
    made_for = fingerprint(gm.code, world_size(), modes_token())
    family = family_key(inputs, config) if world_size() > 1 else None
    plans = job_plans()
    known = plans.family(family)         # (first program, compile #): this one is compiled alone, see .families
    if known is None:
        ensure_ranks_agree_on_source(config)                # rank 0 sends a file's plan or a search's
    given = _given_plan(gm, inputs, config, made_for, device_type)
    config = config.resolve(world_size(), plan_fields=given is None)
    if given is not None:
        check_runs(given, config)
    outline = given if given is not None else outline_of(config, world_size(), made_for)   # what runs: a plan
    if config.compiler == "inductor" and device_type == "cpu":
        start_cpu_isa_probe()     # overlaps planning and aot_autograd; Inductor needs it to generate code
    if config.describe() not in _logged_configs:
        _logged_configs.add(config.describe())
        log.info("%s", config.describe())
    layout = layout_for(outline.mesh.plan_ngpus, device_type, outline.mesh.pp)
    check_symbolic_shapes(inputs, layout)
    limit_automatic_dynamic(layout, config)

    key = plan_key(gm.code, inputs, config, layout, None if given is None else given.digest())
    alone = known is not None       # planned on this rank, with no message
    if known is None:
        alone = not ensure_ranks_agree(key, gm.code, inputs, config, layout,
                                       family if recorded_for(layout, outline) else None)
    if outline.pipeline is not None:
        return _pipeline_program(gm, example_inputs, config, outline, layout, inputs, key, device_type, made_for, given)
    plan = plans.get(key)
    if plan is not None:
        plan.hits += 1
        log.debug("plan %s served from cache (hit %d)", key, plan.hits)
        _drop_guards_on_sharded(gm, plan)
        return ShardedProgram(plan)

    ctx = PassContext(config=config, outline=outline, layout=layout, inputs=inputs, fake_mode=compat.new_fake_mode(),
                      made_for=made_for, given=given, policy=place)
    per_size = compiles_per_size(inputs, layout, outline)
    if layout.mesh is None:   # a single process: nothing to place, compile as it is
        ctx.placements = {i.index: () for i in inputs}
        ctx.plan = record_plan(gm, ctx)
        gm = cast_to_compute_dtype(gm, ctx)
        compiled = _single_process_at(gm, ctx, inputs) if per_size else compile_program(
            tag_single_process(gm, example_inputs, ctx), example_inputs, config.compiler, layout,
            config.inference_only, symbolic=any(inp.is_symbolic for inp in inputs))
        plan = CompiledPlan(key, inputs, ctx.placements, {}, layout, compiled, None, [], config.inference_only,
                            build_sized=(lambda args, sync: _single_process_at(gm, ctx, at_sizes(inputs, args)))
                            if per_size else None)
    else:
        with plan_once(ctx, key, alone=alone) as agreement:
            compiled = plan_and_compile(gm, ctx, device_type, agreement, example_inputs=example_inputs)
            ctx.plan = with_forward_collectives(ctx.plan, ctx.propagation, ctx.node_keys)   # (as saved)
        plan = CompiledPlan(key, inputs, ctx.placements, ctx.zero, layout, compiled, ctx.propagation,
                            ctx.timings, config.inference_only,
                            build_no_sync=_no_sync_builder(gm, ctx, device_type, example_inputs) if layout.dp_group
                            else None,
                            input_check=InputCheck.for_program(inputs, layout, config.verify_inputs_every,
                                                                ctx.draws_random),
                            buffer_sync=BufferSync.for_inputs(inputs, layout.dp_group, config.broadcast_buffers),
                            build_sized=_sized_builder(gm, ctx, device_type) if per_size and not compiled.symbolic
                            else None)
    plan.plan = ctx.plan
    if known is not None:
        check_alone(plan, *known)
    elif alone:       # the first programs, at each rank's own sizes
        check_together(plan)
    if known is None and family is not None and recorded_for(layout, outline):
        plans.add_family(family, plan, agreed_compiles() - 1)
    job_plan_files().record(config, ctx.plan, layout.rank)
    _drop_guards_on_sharded(gm, plan)
    log.info("compiled plan %s in %.2fs (passes: %s)", key, plan.program.seconds,
             ", ".join(f"{name} {t:.2f}s" for name, t in plan.pass_timings))
    plans.put(key, plan)
    return ShardedProgram(plan)


def _hook_into_dynamo() -> None:
    """What dynshard changes in Dynamo for its frames, at every compile (again after a torch._dynamo.reset(),
    which drops Dynamo's callbacks)."""
    compat.register_logger("dynshard")
    compat.keep_dynamism_local()
    keep_floats_constant()
    compat.on_recompile_limit(refuse_recompile_limit)   # a dynshard frame never runs eagerly
    around_dynamo_compiles(present_global_shapes, restore_local_shards)
    watch_ddp_wraps()


def _given_plan(gm: fx.GraphModule, inputs, config: Config, made_for, device_type: str) -> Plan | None:
    """The plan that runs without a policy: a plan file's (load_plan_path), or the one autodist or the user's
    planner chooses before the layout (rank 0 searches, the others receive it); None: the policy places."""
    given = job_plan_files().given(config, made_for, inputs)
    if given is None and config.policy == "autodist":
        given = autodist_plan(gm, inputs, config, world_size(), made_for, device_type)
    if given is None and isinstance(config.policy, Planner):
        given = planner_plan(gm, inputs, config, world_size(), made_for, device_type)
    return given


def _pipeline_program(gm, example_inputs, config, outline, layout, inputs, key, device_type, made_for,
                      given) -> PipelineProgram:
    plans = job_plans()
    plan = plans.get(key)
    if plan is None or not plan.serves(example_inputs):     # (a second model of the same graph: its own)
        plan = plan_pipeline(gm, example_inputs, config, outline, layout, inputs, key, device_type, made_for, given)
        plans.put(key, plan)
        job_plan_files().record(config, plan.plan, layout.rank)
        log.info("planned pipeline %s (passes: %s)", key, ", ".join(f"{n} {t:.2f}s" for n, t in plan.pass_timings))
    else:
        plan.hits += 1
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for inp in inputs:     # a rank holds only its stages' tensors: the others' shapes change in place
        if inp.is_state:
            compat.drop_guards_on(placeholders[inp.index])
    return PipelineProgram(plan)


def _no_sync_builder(gm: fx.GraphModule, planned: PassContext, device_type: str, example_inputs):
    """Compiles, on first use, the variant of a plan that communicates nothing across units (same
    placements, ZeRO parameters as whole replicas): gradient accumulation's micro-steps. A symbolic graph's
    variant is compiled in the frame's tracing context, on its symbols (and Dynamo's example inputs, kept
    for it: the model's own parameters and one batch)."""
    symbolic = any(inp.is_symbolic for inp in planned.inputs)
    context = compat.dynamo_tracing_context() if symbolic else None
    examples = list(example_inputs) if symbolic else ()

    def build():
        ctx = PassContext(config=planned.config, outline=planned.plan, layout=planned.layout, inputs=planned.inputs,
                          fake_mode=compat.new_fake_mode(), made_for=planned.made_for, given=planned.plan,
                          sync_grads=False)
        with compat.traced_in(context) if symbolic else contextlib.nullcontext():
            return plan_and_compile(gm, ctx, device_type, example_inputs=examples)
    return build


def _sized_builder(gm: fx.GraphModule, planned: PassContext, device_type: str):
    """A symbolic graph under a unit of several ranks: its program at a call's sizes (the accumulation variant
    too, ``sync=False``), from the plan made at the traced sizes. Only the passes and the compile run, on this
    rank alone: the unit's ranks read one batch, so they build the same program at the same call."""
    def build(args, sync: bool):
        ctx = PassContext(config=planned.config, outline=planned.plan, layout=planned.layout,
                          inputs=at_sizes(planned.inputs, args), fake_mode=compat.new_fake_mode(),
                          made_for=planned.made_for, given=planned.plan, sync_grads=sync)
        program = plan_and_compile(gm, ctx, device_type)
        log.info("compiled plan %s at the sizes %s in %.2fs", planned.made_for, sizes_of(ctx.inputs), program.seconds)
        return program
    return build


def _single_process_at(gm: fx.GraphModule, ctx: PassContext, inputs):
    """One process's program at the sizes of ``inputs`` (a symbolic graph lowered to ATen for recompute)."""
    examples = [local_example(inp, (), None, ctx.layout) for inp in inputs]
    return compile_program(tag_single_process(gm, examples, ctx), examples, ctx.config.compiler, ctx.layout,
                           ctx.config.inference_only)


def _drop_guards_on_sharded(gm: fx.GraphModule, plan: CompiledPlan) -> None:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for inp in plan.inputs:
        if inp.is_state and (is_sharded(plan.placements[inp.index]) or inp.index in plan.zero):
            compat.drop_guards_on(placeholders[inp.index])


def _device_type(example_inputs: Sequence[Any]) -> str:
    for value in example_inputs:
        if isinstance(value, torch.Tensor) and value.device.type != "meta":
            return value.device.type
    return "cpu"


