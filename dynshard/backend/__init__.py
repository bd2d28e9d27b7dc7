"""The ``dynshard`` torch.compile backend: capture -> passes -> per-rank compile -> sharded program."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from .. import compat
from ..config import Config
from ..passes import PASSES, PassContext, assign_placements, cast_to_compute_dtype, run_passes
from ..passes.tag_recompute import tag_single_process
from ..runtime.mesh import ensure_process_group, layout_for, world_size
from ..runtime.pipeline.program import PipelineProgram
from ..runtime.program import CompiledPlan, ShardedProgram
from ..runtime.buffer_sync import BufferSync
from ..runtime.ddp import watch as watch_ddp_wraps
from ..runtime.sharding import is_sharded, present_global_shapes, restore_local_shards, stored_shape
from ..runtime.unit_inputs import InputCheck
from ..runtime.zero import zero_groups
from .agreement import PlanChannel, ensure_ranks_agree, plan_channel
from .capture import describe_inputs
from .compile import compile_program
from .pipeline import plan_pipeline
from .plan_cache import PlanCache, modes_token, plan_key
from .plan_files import PlanFiles
from .reshard import reshard_pass
from ..passes.assign_placements import record_plan
from ..planning import Plan
from ..planning.costs import with_forward_collectives
from ..planning.plan import config_for, fingerprint

log = logging.getLogger("dynshard")
ASYNC_BUCKET_CAP_MB = 25
PLANS = PlanCache()
PLAN_FILES = PlanFiles()
_logged_configs: set[str] = set()


def dynshard_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], options: Any = None, **kwargs):
    """Dynamo backend entry point (``torch.compile(model, backend="dynshard", options=...)``)."""
    if kwargs:
        raise TypeError(f"dynshard: unexpected backend arguments {sorted(kwargs)}; pass settings in options=")
    compat.register_logger("dynshard")
    compat.keep_shapes_static()
    compat.around_dynamo_compiles(present_global_shapes, restore_local_shards)
    watch_ddp_wraps()       # (again after a torch._dynamo.reset(), which drops Dynamo's callbacks)
    config = Config.from_options(options)
    device_type = _device_type(example_inputs)
    ensure_process_group(device_type)
    inputs = describe_inputs(gm, example_inputs)
    made_for = fingerprint(gm.code, world_size(), modes_token())
    given = PLAN_FILES.given(config, made_for, inputs)      # load_plan_path: the plan runs, no policy
    if given is not None:
        config = config_for(given, config)
    config = config.resolve(world_size())
    if config.compiler == "inductor" and device_type == "cpu":
        compat.start_cpu_isa_probe()     # overlaps planning and aot_autograd; Inductor needs it to generate code
    if config.describe() not in _logged_configs:
        _logged_configs.add(config.describe())
        log.info("%s", config.describe())
    layout = layout_for(config.plan_ngpus, device_type, config.pipeline_ranks)

    key = plan_key(gm.code, inputs, config, layout, None if given is None else given.digest())
    ensure_ranks_agree(key, gm.code, inputs, config, layout)
    if config.is_pipeline:
        return _pipeline_program(gm, example_inputs, config, layout, inputs, key, device_type, made_for, given)
    plan = PLANS.get(key)
    if plan is not None:
        plan.hits += 1
        log.debug("plan %s served from cache (hit %d)", key, plan.hits)
        _drop_guards_on_sharded(gm, plan)
        return ShardedProgram(plan)

    ctx = PassContext(config=config, layout=layout, inputs=inputs, fake_mode=compat.new_fake_mode(),
                      made_for=made_for, given=given)
    if layout.mesh is None:   # a single process: nothing to place, compile as it is
        ctx.placements = {i.index: () for i in inputs}
        ctx.plan = record_plan(gm, ctx)
        gm = cast_to_compute_dtype(gm, ctx)
        compiled = compile_program(tag_single_process(gm, example_inputs, ctx), example_inputs, config.compiler,
                                   layout, config.inference_only)
        plan = CompiledPlan(key, inputs, ctx.placements, {}, layout, compiled, None, [],
                            config.inference_only)
    else:
        compiled = _plan_once_and_compile(gm, ctx, key, device_type)
        plan = CompiledPlan(key, inputs, ctx.placements, ctx.zero, layout, compiled, ctx.propagation,
                            ctx.timings, config.inference_only,
                            build_no_sync=_no_sync_builder(gm, ctx, device_type) if layout.dp_group else None,
                            input_check=InputCheck.for_inputs(inputs, layout.plan_ngpus, config.verify_inputs_every),
                            buffer_sync=BufferSync.for_inputs(inputs, layout.dp_group, config.broadcast_buffers))
    plan.plan = ctx.plan
    PLAN_FILES.record(config, ctx.plan, layout.rank)
    _drop_guards_on_sharded(gm, plan)
    log.info("compiled plan %s in %.2fs (passes: %s)", key, plan.program.seconds,
             ", ".join(f"{name} {t:.2f}s" for name, t in plan.pass_timings))
    PLANS.put(key, plan)
    return ShardedProgram(plan)


def _pipeline_program(gm, example_inputs, config, layout, inputs, key, device_type, made_for, given) -> PipelineProgram:
    plan = PLANS.get(key)
    if plan is None or not plan.serves(example_inputs):     # (a second model of the same graph: its own)
        plan = plan_pipeline(gm, example_inputs, config, layout, inputs, key, device_type, made_for, given)
        PLANS.put(key, plan)
        PLAN_FILES.record(config, plan.plan, layout.rank)
        log.info("planned pipeline %s (passes: %s)", key, ", ".join(f"{n} {t:.2f}s" for n, t in plan.pass_timings))
    else:
        plan.hits += 1
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for inp in inputs:     # a rank holds only its stages' tensors: the others' shapes change in place
        if inp.is_state:
            compat.drop_guards_on(placeholders[inp.index])
    return PipelineProgram(plan)


def _plan_once_and_compile(gm: fx.GraphModule, ctx: PassContext, key: str, device_type: str):
    """Planned once per job: rank 0 runs the policy, or reads the plan in ``cache_dir``, and sends the plan
    to the other ranks, which install it as a given plan and skip the policy (see ``PlanChannel``). A plan
    from ``load_plan_path`` is on every rank already.

    The others lower the graph while rank 0 plans and wait for the plan just before the policy pass. A
    rank whose planning raises still takes part in the one message of the compile (rank 0 sends its error
    instead of the plan; another rank waits for rank 0's message), so every rank raises and the ranks stay
    in step for the next compile. A process that plans alone (one rank, a fake group) plans as before.
    """
    config, layout = ctx.config, ctx.layout
    if ctx.given is not None:       # a plan file: every rank holds the plan, nothing to send
        compiled = plan_and_compile(gm, ctx, device_type)
        ctx.plan = with_forward_collectives(ctx.plan, ctx.propagation, ctx.node_keys)
        PLANS.save_plan(config, key, ctx.plan, layout)
        return compiled
    channel = plan_channel()
    try:
        if channel is not None and not channel.planner:
            return plan_and_compile(gm, ctx, device_type, before_policy=lambda ctx: _receive_plan(ctx, channel))
        ctx.given = PLANS.load_plan(config, key)
        if ctx.given is not None and channel is not None:   # at once: the others need not wait for this rank's lowering
            channel.send(ctx.given.to_json())
        compiled = plan_and_compile(gm, ctx, device_type,
                                    after_policy=None if channel is None else lambda ctx: _send_plan(ctx, channel))
    except BaseException as error:
        if channel is not None:
            channel.abandon(error)
        raise
    ctx.plan = with_forward_collectives(ctx.plan, ctx.propagation, ctx.node_keys)
    PLANS.save_plan(config, key, ctx.plan, layout)
    return compiled


def _send_plan(ctx: PassContext, channel: PlanChannel) -> None:
    if not channel.finished:      # (a plan read from cache_dir went out before the passes)
        channel.send(ctx.plan.to_json())


def _receive_plan(ctx: PassContext, channel: PlanChannel) -> None:
    start = time.perf_counter()
    ctx.given = Plan.from_json(channel.receive(), "the plan rank 0 sent")
    ctx.timings.append(("receive_plan", time.perf_counter() - start))     # mostly waiting for rank 0


def plan_and_compile(gm: fx.GraphModule, ctx: PassContext, device_type: str,
                     before_policy: Callable[[PassContext], Any] | None = None,
                     after_policy: Callable[[PassContext], Any] | None = None, backward=None):
    """The passes, then the per-rank compile of their program (``before_policy``/``after_policy``: called
    around the ``assign_placements`` pass; ``backward``: compiles the backward graph, see compile_program)."""
    config, layout = ctx.config, ctx.layout
    policy = PASSES.index(assign_placements)
    lowered = run_passes(copy_graph(gm), ctx, PASSES[:policy])   # passes may edit the graph; the variant reuses gm
    if before_policy is not None:
        before_policy(ctx)
    lowered = run_passes(lowered, ctx, PASSES[policy:policy + 1])
    if after_policy is not None:
        after_policy(ctx)
    lowered = run_passes(lowered, ctx, PASSES[policy + 1:])
    local_inputs = [_local_example(inp, ctx.placements[inp.index], ctx.zero_of(inp), layout) for inp in ctx.inputs]
    program = compile_program(lowered, local_inputs, config.compiler, layout, config.inference_only,
                              freeze=config.constant_folding, partition_pass=_reshard_pass(config, ctx),
                              inductor_patches=compat.bucketing_patches(
                                  bool(ctx.zero) and ctx.sync_grads, _bucket_cap_mb(config),
                                  config.use_async_reducer and device_type == "cuda"), backward=backward,
                              blocks_only=config.compile_scope == "blocks", share_traces=config.share_traces)
    program.split_outputs = ctx.split_outputs     # recorded while the program was traced
    program.outlined = ctx.outlined
    return program


def _bucket_cap_mb(config: Config) -> float | None:
    """nnScaler's and DDP's default: 25 MB buckets when reduction overlaps the backward, else one bucket."""
    if config.reducer_bucket_cap_mb:
        return config.reducer_bucket_cap_mb
    return ASYNC_BUCKET_CAP_MB if config.use_async_reducer else None


def copy_graph(gm: fx.GraphModule) -> fx.GraphModule:
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return fx.GraphModule(gm, graph)


def _no_sync_builder(gm: fx.GraphModule, planned: PassContext, device_type: str):
    """Compiles, on first use, the variant of a plan that communicates nothing across units (same
    placements, ZeRO parameters as whole replicas): gradient accumulation's micro-steps."""
    def build():
        ctx = PassContext(config=planned.config, layout=planned.layout, inputs=planned.inputs,
                          fake_mode=compat.new_fake_mode(), made_for=planned.made_for, given=planned.plan,
                          sync_grads=False)
        return plan_and_compile(gm, ctx, device_type)
    return build


def _reshard_pass(config: Config, ctx: PassContext):
    """ZeRO-3 frees gathered parameters after the forward (see :mod:`.reshard`)."""
    if config.zero < 3 or not ctx.zero or not ctx.sync_grads:
        return None
    groups = {zero_groups(ctx.layout, spec.ngroups).shard_name for spec in ctx.zero.values()}
    return reshard_pass(groups)


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


def _local_example(inp, placements, zero, layout) -> torch.Tensor:
    """A tensor of the shape and device ``inp`` arrives in at run time; a meta parameter (a meta-built model
    Dynamo traced as it is) arrives materialised on the current device."""
    from ..runtime.materialize import default_device

    shape = stored_shape(inp.shape, layout, placements, zero) if inp.is_state or inp.is_split_value else inp.shape
    device = default_device(layout.device_type) if inp.device.type == "meta" else inp.device
    return torch.empty(shape, dtype=inp.dtype, device=device).requires_grad_(inp.requires_grad)
