"""Compiling one of this rank's pipeline stages at a micro-batch's shapes, when the executor first runs it at
them: a stage one rank holds whole compiles as it is; a hybrid stage (and 1f1b_plus's stage on every rank)
runs the compile path of a tp plan over its ranks (:func:`.plan_and_compile.plan_and_compile`), with the
placements the pipeline's plan gave it."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from .. import compat
from ..passes import PassContext
from ..passes.tag_recompute import tag_single_process
from ..runtime.mesh import Layout, layout_for
from ..runtime.program import CompiledPlan, ShardedProgram
from .capture import describe_inputs
from .compile import compile_program
from .plan_and_compile import plan_and_compile
from .split_backward import compiled_backward
from .stage_plans import stage_context, stage_plan


@dataclasses.dataclass(frozen=True)
class StageCompiler:
    """What a pipeline plan calls to compile a stage: ``(stage, args, stored) -> (the compiled program, what
    the executor calls)``; ``stored``: the tensors this rank holds for the stage's inputs (None where the
    argument is the tensor)."""

    pipeline: PassContext          # the pipeline's passes: its config, inputs and Plan
    schedule: Any                  # the configured schedule (zb1p splits the backward)
    layout: Layout
    key: str
    device_type: str

    def __call__(self, stage, args, stored):
        backward = None
        if self.schedule.splits_backward:    # zero bubble: weight gradients deferred to the W actions
            inputs = self.pipeline.inputs
            weights = {j for j, i in enumerate(stage.graph_inputs) if inputs[i].kind == "parameter"}
            backward = functools.partial(compiled_backward, weight_outputs=weights)
        tensors = [s if s is not None else a for a, s in zip(args, stored)]
        if self.schedule.on_every_rank(stage.index):     # 1f1b_plus: tensor parallel over the whole unit
            unit = layout_for(self.layout.plan_ngpus, self.device_type)
            return self._tensor_parallel(stage, tensors, unit, all_device=True)
        if self.layout.tp_size > 1:
            return self._tensor_parallel(stage, tensors, self.layout, backward)
        return self._whole(stage, args, backward)

    def _whole(self, stage, args, backward):
        """A stage this rank holds whole: compiled as it is, at the arguments' shapes."""
        config = self.pipeline.config
        examples = [torch.empty(a.shape, dtype=a.dtype, device=a.device).requires_grad_(a.requires_grad)
                    if isinstance(a, torch.Tensor) else a for a in args]
        stage_ctx = PassContext(config=config, outline=self.pipeline.plan, layout=self.layout,
                                inputs=self.pipeline.inputs, fake_mode=compat.new_fake_mode(), stage_program=True)
        module = tag_single_process(stage.module, examples, stage_ctx)    # recompute_modules, when asked for
        program = compile_program(module, examples, config.compiler, self.layout, config.inference_only,
                                  backward=backward, share_traces=config.share_traces)
        return program, program.run

    def _tensor_parallel(self, stage, args, layout: Layout, backward=None, all_device: bool = False):
        """A hybrid plan's stage: planned by the tp policy over the stage's tp ranks, as a whole graph would be,
        without data-parallel communication (the pipeline reduces gradients once per step). Its tensors are cut
        into tp shards in place here, before the first micro-batch; the placements are the pipeline Plan's
        (:mod:`.stage_plans`); ``backward``: zb1p's split backward."""
        inputs = describe_inputs(stage.module, args)
        given = None if all_device else stage_plan(self.pipeline.plan, stage.index, inputs)
        ctx = stage_context(self.pipeline, inputs, layout=layout, given=given)
        compiled = plan_and_compile(stage.module, ctx, self.device_type, backward=backward)
        plan = CompiledPlan(f"{self.key}/stage{stage.index}", inputs, ctx.placements, ctx.zero, layout, compiled,
                            ctx.propagation, ctx.timings, self.pipeline.config.inference_only)
        ShardedProgram(plan).prepare(args)
        # the compiled program itself: ShardedProgram's call would flush the pipeline's ZeRO accumulation
        return plan.program, plan.program.run
