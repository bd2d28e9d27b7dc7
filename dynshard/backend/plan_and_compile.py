"""The compile path of one graph, top to bottom: the passes' four phases (lower, place, propagate, rewrite),
the plan agreed across ranks between the first two and the last two, then the per-rank compile of the
program they leave. Every planned program (a whole graph, a pipeline stage split over tp, the accumulation
variant) goes through it."""

from __future__ import annotations

from typing import Any, Sequence

import dataclasses
import logging
import warnings

import torch
import torch.fx as fx

from .. import compat
from ..config import Config
from ..passes import LOWER, PLACE, PROPAGATE, REWRITE, PassContext, copy_graph, run_passes
from ..passes.lower_to_aten import lowers
from ..runtime.graph_inputs import GraphInput
from ..runtime.materialize import default_device
from ..runtime.sharding import stored_shape
from ..runtime.zero import zero_groups
from .agreement import unit_ranks_succeeded
from .compile import compile_program
from .compiler import bucketing_patches
from .plan_once import PlanAgreement
from .reshard import reshard_pass

ASYNC_BUCKET_CAP_MB = 25
log = logging.getLogger("dynshard")


def plan_and_compile(gm: fx.GraphModule, ctx: PassContext, device_type: str, agreement: PlanAgreement | None = None,
                     backward=None, example_inputs: Sequence[Any] = ()):
    """The passes, then the per-rank compile of their program. ``agreement``: this rank's part in the plan
    agreed across ranks (:func:`.plan_once.plan_once`; None where the plan is known: a variant, a stage);
    ``backward``: compiles the backward graph, see compile_program; ``example_inputs``: Dynamo's, which a
    graph of symbolic sizes compiles on."""
    layout = ctx.layout
    lowered = run_passes(copy_graph(gm), ctx, LOWER)   # passes may edit the graph; the variant reuses gm
    if agreement is not None:
        agreement.receive()       # the other ranks: rank 0's plan, given from here on
    placed = run_passes(lowered, ctx, PLACE)
    if agreement is not None:
        agreement.send()          # rank 0: the plan it made, while every rank propagates it
    propagated = run_passes(placed, ctx, PROPAGATE)
    local_inputs = [local_example(inp, ctx.placements[inp.index], ctx.zero_of(inp), layout) for inp in ctx.inputs]
    if on_symbols(ctx):
        program = _program_on_symbols(gm, ctx, device_type, backward, example_inputs, local_inputs)
        if program is not None:
            return program
    return _compile(run_passes(propagated, ctx, REWRITE), ctx, device_type, backward,
                    # one program for every size of the family, compiled on Dynamo's symbols, where the passes
                    # did not lower the graph; else the program is compiled at the inputs' sizes (see .shapes)
                    not lowers(layout, ctx.outline) and any(inp.is_symbolic for inp in ctx.inputs),
                    example_inputs, local_inputs)


def on_symbols(ctx: PassContext) -> bool:
    """Whether the program of a symbolic graph whose passes lower it (a unit of several ranks) is made on
    Dynamo's symbols: once, for every size of the family. A pipeline's stages compile per micro-batch shape, and
    a program whose outputs stay split (``gather_outputs=False``) per size: its outputs' specs are static."""
    return (ctx.layout.tp_mesh is not None and not ctx.stage_program and ctx.config.gather_outputs
            and any(inp.is_symbolic for inp in ctx.inputs) and compat.dynamo_tracing_context() is not None)


def _program_on_symbols(gm: fx.GraphModule, planned: PassContext, device_type: str, backward, example_inputs,
                        local_inputs):
    """The passes again, on Dynamo's symbols and in its fake mode, with the plan made at the hints given (the
    policy and the agreement saw concrete sizes; DTensor's propagation and the rewrite run on symbols), then
    the compile on Dynamo's examples: one program for every size the frame's guards admit. Where that fails
    (an op DTensor cannot place on symbolic sizes), None, logged: the program is compiled per size. The
    propagation is tried first with no guard recorded, so that such a failure does not specialize the frame
    (a guard on the size it failed at would compile the next size again). Every rank of the unit learns
    whether every rank of it succeeded, so that they take the same path (another unit may take another:
    both paths run the plan's collectives)."""
    tracing = compat.dynamo_tracing_context()
    ctx = PassContext(config=planned.config, layout=planned.layout, inputs=symbolic_inputs(gm, planned.inputs),
                      fake_mode=tracing.fake_mode, outline=planned.plan, made_for=planned.made_for,
                      given=planned.plan, sync_grads=planned.sync_grads)
    failure = None
    try:
        with compat.dtensor_symbolic_tracing():
            rewritten = run_passes(run_passes(copy_graph(gm), ctx, LOWER), ctx, PLACE)
            with compat.guards_left_out(ctx.fake_mode), warnings.catch_warnings():   # a trial: where DTensor
                warnings.simplefilter("ignore")     # cannot place an op on symbols, the frame keeps no guard of it
                run_passes(rewritten, ctx, PROPAGATE)
                _check_no_new_fallbacks(ctx, planned)
            for phase in (PROPAGATE, REWRITE):
                rewritten = run_passes(rewritten, ctx, phase)
            program = _compile(rewritten, ctx, device_type, backward, True, example_inputs, local_inputs)
    except Exception as error:       # noqa: BLE001 (logged, and the program is compiled per size instead)
        failure, program = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}", None
        log.debug("dynshard: the program on symbolic sizes failed", exc_info=True)
    if not unit_ranks_succeeded(failure is None, ctx.layout):
        log.warning("dynshard: plan %s compiles a program per size: its program on symbolic sizes failed (%s)",
                    planned.made_for, failure or "on another rank")
        return None
    planned.timings.extend((f"{name} (on symbols)", t) for name, t in ctx.timings)
    return program


def _check_no_new_fallbacks(on_symbols: PassContext, planned: PassContext) -> None:
    """An op DTensor placed at the hints but runs whole (inputs gathered) on symbols would communicate what the
    agreed plan does not: such a program is not made on symbols. Ops are matched by their node keys (the two
    lowerings name their nodes apart)."""
    def key(ctx: PassContext, name: str) -> str:
        return ctx.node_keys.get(name, name)

    before = {key(planned, name) for name in planned.propagation.fallbacks}
    new = {name: reason for name, reason in on_symbols.propagation.fallbacks.items()
           if key(on_symbols, name) not in before}
    if new:
        name, reason = next(iter(new.items()))
        raise NotImplementedError(f"{len(new)} op(s) DTensor places at the hints run whole on symbols, "
                                  f"the first {name}: {reason}")


def symbolic_inputs(gm: fx.GraphModule, inputs: Sequence[GraphInput]) -> list[GraphInput]:
    """``inputs`` with Dynamo's symbolic sizes (its placeholders' example values) instead of their hints."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    found = []
    for inp, node in zip(inputs, placeholders):
        value = node.meta.get("example_value")
        if inp.is_symbolic and inp.kind == "size":
            inp = dataclasses.replace(inp, value=value)
        elif inp.is_symbolic:
            inp = dataclasses.replace(inp, shape=value.shape, stride=tuple(value.stride()))
        found.append(inp)
    return found


def _compile(rewritten: fx.GraphModule, ctx: PassContext, device_type: str, backward, symbolic: bool,
             example_inputs, local_inputs):
    config, layout = ctx.config, ctx.layout
    if symbolic:
        local_inputs = symbolic_examples(example_inputs, local_inputs)
    program = compile_program(rewritten, local_inputs, config.compiler, layout, config.inference_only,
                              freeze=config.constant_folding, partition_pass=_reshard_pass(ctx),
                              inductor_patches=bucketing_patches(
                                  bool(ctx.zero) and ctx.sync_grads, _bucket_cap_mb(config),
                                  config.use_async_reducer and device_type == "cuda"), backward=backward,
                              blocks_only=config.compile_scope == "blocks", share_traces=config.share_traces,
                              symbolic=symbolic)
    program.split_outputs = ctx.split_outputs     # recorded while the program was traced
    program.outlined = ctx.outlined
    return program


def symbolic_examples(example_inputs: Sequence[Any], local_inputs: Sequence[Any]) -> list[Any]:
    """The program's example inputs for a symbolic compile: Dynamo's own example where the program takes
    the input as Dynamo traced it (aot_autograd then finds its symbolic fake, and a wrapped float its
    symbolic value, in Dynamo's tracing context, whose ShapeEnv takes the compile's guards); elsewhere (a
    ZeRO shard, a meta parameter materialised at the first call) a static fake of the local tensor in
    Dynamo's mode."""
    fake_mode = compat.dynamo_fake_mode()
    return [example if not isinstance(example, torch.Tensor) or _as_traced(example, local)
            else compat.static_fake(fake_mode, local) for example, local in zip(example_inputs, local_inputs)]


def _as_traced(example: torch.Tensor, local: torch.Tensor) -> bool:
    return (tuple(example.shape) == tuple(local.shape) and example.dtype == local.dtype
            and example.device == local.device)


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
