"""The callable a pipeline plan hands back to Dynamo, and the plan it runs.

A call ``model(batch)`` reaches :class:`PipelineProgram` with the captured graph's inputs (parameters and
the batch). It runs in one of three ways:

- inside :func:`dynshard.train_step` / :func:`dynshard.infer_step` (a recorder is active): the call only
  records its inputs, one micro-batch per call, and returns empty outputs that the step fills in place
  once its schedule has run;
- with autograd (``loss = model(batch); loss.backward()``): GPipe over ``pipeline_nmicros`` micro-batches
  of the batch (every tensor input split along dim 0), through one autograd function whose forward runs
  every micro-batch's forward and whose backward runs every micro-batch's backward. GPipe because it is
  the only order in which all forwards come before any backward, as autograd's calls do;
- without autograd (``torch.no_grad()``, ``inference_only``): the forward-only order.

The outputs of the micro-batches are combined into the whole batch's (concatenated, averaged or summed, as
:mod:`dynshard.passes.microbatch_outputs` finds from the graph; a cross-entropy over padded targets averaged
with each micro-batch weighted by its count of counted targets) and sent from the last stage to every
rank of the unit. Each rank compiles only its own stages, once per micro-batch shape.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from ... import compat
from .executor import StepRun
from .. import materialize
from ..ddp import check_active_ddp
from ..eager_guard import guard_modules
from ..graph_inputs import batch_size_inputs
from ..program import PREPARE_HOOKS, hook_frame_modules
from .ownership import FreshGradients, Ownership, materialize_stages, reduce_gradients, take_ownership
from .recorder import active_recorder, recording
from .actions import ALL
from .trace import idle_fraction, writer_for


@dataclasses.dataclass(frozen=True)
class ValueMeta:
    shape: torch.Size
    dtype: torch.dtype
    requires_grad: bool


@dataclasses.dataclass(eq=False)
class PipelinePlan:
    key: str
    config: Any
    inputs: list                    # backend.capture.GraphInput
    staged: Any                     # passes.cut_stages.StagedGraph
    schedule: Any                   # the configured schedule (train_step)
    gpipe: Any                      # GPipe's order (plain calls with autograd); None for inference_only
    forward_only: Any               # infer_pipe's order (no-grad calls, infer_step)
    groups: Any                     # runtime.pipeline.groups.PipelineGroups
    layout: Any
    device: torch.device
    output_metas: list              # the captured graph's outputs (ValueMeta, or None for non-tensors)
    compile_stage: Callable         # backend.stage_compile.StageCompiler: (stage, args, stored) -> (program, its run)
    # backend.retrace.MicroBatchRetrace: a micro-batch's graph inputs -> the frame called on them (Dynamo traces
    # it at the micro-batch shape); None where the frame cannot be called again
    retrace: Callable | None
    combine_fn: Callable            # () -> per output "cat" / "mean" / "sum" / "same"
    pass_timings: list
    seconds: float = 0.0
    hits: int = 0
    ownership: Ownership | None = None
    input_check: Any = None          # runtime.unit_inputs.InputCheck: the unit's ranks were fed the same batch
    buffer_sync: Any = None          # runtime.buffer_sync.BufferSync: written buffers equal over the units
    plan: Any = None                 # planning.Plan: the decisions this pipeline executes
    steps: int = 0                  # steps run (a plain call with autograd is one step: forward + backward)
    last_step: dict = dataclasses.field(default_factory=dict)   # sent bytes, idle fraction of the latest step
    all_device_generator: Any = None  # shared_generator.SharedGenerator: what 1f1b_plus's all-device stage draws
    _combine: list | None = None
    _programs: dict = dataclasses.field(default_factory=dict)
    compiled: dict = dataclasses.field(default_factory=dict)    # stage -> its latest CompiledProgram here
    _metas: dict = dataclasses.field(default_factory=dict)   # input shapes -> boundary metas, or the failure

    def serves(self, args) -> bool:
        """Whether this plan runs for the tensors in ``args``: a plan that has taken its tensors serves only
        the model they belong to (another model with the same graph, config and shapes gets its own)."""
        return self.ownership is None or all(args[i] is t for i, t in self.ownership.held.items())

    def fork(self) -> "PipelinePlan":
        """The same plan for another model's tensors: what it planned, none of what it took or compiled."""
        return dataclasses.replace(self, hits=0, ownership=None, steps=0, last_step={}, _combine=None,
                                   _programs={}, compiled={}, _metas={})

    @property
    def compiled_shapes(self) -> tuple[tuple, ...]:
        """The micro-batch shapes this rank's stage programs were compiled at: (grad mode, the user inputs'
        shapes) each, in compile order."""
        return tuple(self._programs)

    @property
    def nmicros(self) -> int:
        return self.plan.pipeline.nmicros

    @property
    def combine(self) -> list[str]:
        if self._combine is None:
            self._combine = self.combine_fn()
        return self._combine

    def finish_step(self, run: StepRun) -> None:
        """Account for a finished step (and write it to the trace with ``Config.trace_dir``)."""
        wall = run.trace.now()
        self.last_step = {"sent_bytes": run.sent_bytes, "idle_fraction": idle_fraction(run.trace, wall),
                          "seconds": wall / 1e6}
        if self.config.trace_dir:
            writer_for(self.config.trace_dir).add(run.trace, wall)
        self.steps += 1

    def p2p_bytes(self) -> int:
        """Bytes a step sends between the stages of a unit: every boundary tensor once per micro-batch
        forward, and its gradient once backward (those that need one); after an all-device stage, only the
        gradients, broadcast to the other ranks; 0 before the first step."""
        if not self._programs:
            return 0
        metas = next(reversed(self._programs.values()))[1]
        schedule, train = self.schedule, not self.config.inference_only
        total = 0
        for s, boundary in enumerate(self.staged.boundaries):
            values = [metas[name] for name in boundary]
            forward = sum(m.shape.numel() * m.dtype.itemsize for m in values)
            backward = sum(m.shape.numel() * m.dtype.itemsize for m in values if m.requires_grad) if train else 0
            for mb in range(self.nmicros):
                here, there = schedule.rank_of(s, mb), schedule.rank_of(s + 1, mb)
                if here == ALL:
                    total += backward * (self.groups.pp_size - 1)
                elif here != there:    # (a micro-batch whose two stages share a rank hands them over inside it)
                    total += forward + backward
        return total

    def _input_shapes(self, mb_args: list[list[Any]]) -> tuple:
        """The user inputs' shapes of micro-batches like ``mb_args[0]`` (and a symbolic graph's size inputs)."""
        first = mb_args[0]
        return (tuple(tuple(first[i.index].shape) for i in self.inputs if i.kind == "input")
                + tuple(int(first[i.index]) for i in self.inputs if i.kind == "size"))

    def boundary_metas(self, mb_args: list[list[Any]]) -> dict[str, ValueMeta] | Exception:
        """The boundary metadata for micro-batches shaped like ``mb_args[0]``, found once per shape: or
        why the stage graphs do not run at that shape (a graph holding sizes of the batch it was traced with)."""
        shapes = self._input_shapes(mb_args)
        if shapes not in self._metas:
            # a failure is an answer, not an error to report (fx prints a failing call of a traced module)
            with compat.fake_tensor_log_quiet(), contextlib.redirect_stderr(io.StringIO()):
                try:
                    self._metas[shapes] = _boundary_metas(self, mb_args[0])
                except Exception as error:   # noqa: BLE001 (any failure of the fake run means the same)
                    self._metas[shapes] = error
        return self._metas[shapes]

    def outputs_at(self, mb_args: list[list[Any]], whole: bool) -> list[ValueMeta | None]:
        """The graph's outputs' metadata for micro-batches shaped like ``mb_args[0]`` (``whole``: for the
        batch they were split from): ``output_metas`` where the graph's sizes are static, else found by the
        fake run of the stages at that shape."""
        if not any(inp.is_symbolic for inp in self.inputs):
            return self.output_metas
        metas = self.boundary_metas(mb_args)
        outputs = []
        for position, (ref, meta) in enumerate(zip(self.staged.outputs, self.output_metas)):
            if ref[0] != "value" or meta is None:
                outputs.append(meta)
                continue
            micro = metas[ref[1]]
            shape = micro.shape
            if whole and self.combine[position] == "cat":
                shape = torch.Size([shape[0] * len(mb_args), *shape[1:]])
            outputs.append(dataclasses.replace(micro, shape=shape))
        return outputs

    def runs_micro_batches(self, mb_args: list[list[Any]]) -> bool:
        """Whether the stage graphs run on micro-batches shaped like ``mb_args[0]``."""
        return not isinstance(self.boundary_metas(mb_args), Exception)

    def programs_for(self, mb_args: list[list[Any]]) -> tuple[dict[int, Callable], dict[str, ValueMeta]]:
        """This rank's compiled stages and the boundary metadata for micro-batches shaped like ``mb_args[0]``."""
        # aot_autograd compiles an inference program without grad mode: one set of programs per mode
        shapes = (torch.is_grad_enabled(),) + self._input_shapes(mb_args)
        if shapes not in self._programs:
            start = time.perf_counter()
            metas = self.boundary_metas(mb_args)
            if isinstance(metas, Exception):
                raise RuntimeError(
                    "dynshard: the captured graph does not run on micro-batches of its batch; it was traced with "
                    "the whole batch and holds sizes taken from it (e.g. x.view(B, T, ...) with B = x.shape[0]). "
                    "Call the model once per micro-batch through dynshard.train_step(model, samples), or write "
                    f"such sizes as -1 ({type(metas).__name__}: {metas})")
            programs = {}
            held = self.ownership.held
            for s in self.schedule.stages_of(self.groups.pp_rank):
                stage = self.staged.stages[s]
                args = [mb_args[0][i] for i in stage.graph_inputs]
                # (hybrid: the stage program plans from the held tensors, tagged; not from ZeRO replicas)
                stored = [held.get(i) for i in stage.graph_inputs] + [None] * len(stage.received)
                args += [torch.empty(metas[n].shape, dtype=metas[n].dtype, device=self.device)
                         .requires_grad_(metas[n].requires_grad) for n in stage.received]
                # hybrid: also cuts its tensors into tp shards
                self.compiled[s], programs[s] = self.compile_stage(stage, args, stored)
            self.ownership.settle()
            self.seconds += time.perf_counter() - start
            self._programs[shapes] = (programs, metas)
        return self._programs[shapes]


def _example(inp, value, device) -> torch.Tensor | int:
    if inp.kind == "size":
        return int(value)
    shape = inp.shape if inp.is_state else value.shape
    return torch.empty(shape, dtype=inp.dtype, device=device).requires_grad_(inp.requires_grad)


def _boundary_metas(plan: PipelinePlan, args: list[Any]) -> dict[str, ValueMeta]:
    """Shapes, dtypes and whether they need gradients, of every value a stage returns, for one
    micro-batch: the stages run on FakeTensors in order."""
    metas: dict[str, ValueMeta] = {}
    fake_mode = compat.new_fake_mode()
    with fake_mode, torch.enable_grad():
        env: dict[str, torch.Tensor] = {}
        fakes = [_example(inp, value, plan.device) for inp, value in zip(plan.inputs, args)]
        for stage in plan.staged.stages:
            outputs = stage.module(*[fakes[i] for i in stage.graph_inputs], *[env[n] for n in stage.received])
            for name, value in zip(stage.produced, outputs):
                env[name] = value
                metas[name] = ValueMeta(value.shape, value.dtype, value.requires_grad)
    return metas


def _first_backward(actions) -> int:
    return next((i for i, a in enumerate(actions) if a.kind in ("B", "I", "W", "RECV_B", "BCAST_B")), len(actions))


class PipelineProgram:
    """What Dynamo calls for a graph planned with a pipeline policy (see the module docstring)."""

    def __init__(self, plan: PipelinePlan):
        self.plan = plan
        # built while Dynamo compiles a frame: the meta-built models of that frame, initialised on the first run
        self._meta_models = materialize.frame_models()
        materialize.install()      # the trace hook, again after a torch._dynamo.reset()
        self._roots = materialize.frame_roots()     # their modules refuse eager calls once they hold shards
        self._others: list[PipelineProgram] = []      # the same plan for other models of the same graph
        hook_frame_modules(self._roots)

    def __call__(self, *args: Any):
        check_active_ddp()
        if not self.plan.serves(args):     # Dynamo serves one compiled frame to every model of its class
            return self._for_other_model(args)(*args)
        plan = self.plan
        if plan.ownership is None:
            materialize_stages(self._meta_models, args, plan)
            self._meta_models = []
            plan.ownership = take_ownership(args, plan)
        if plan.input_check is not None:
            plan.input_check(args)
        recorder = active_recorder()
        if recorder is not None:
            return recorder.record(self, args)
        if torch.is_grad_enabled() and any(args[i.index].requires_grad for i in plan.inputs if i.kind == "input"):
            raise RuntimeError(
                "dynshard: a pipelined graph received an input that needs a gradient: a graph break splits the "
                "model into several graphs, and gradients do not flow between separately pipelined graphs yet. "
                "Remove the graph break (TORCH_LOGS=graph_breaks shows where it is)")
        _ = plan.combine  # how the micro-batch outputs make the batch's: found, or refused, on every rank first
        runner, mb_args = self.micro_batches(args)
        if plan.config.inference_only or not torch.is_grad_enabled():
            run = runner.run(runner.plan.forward_only, mb_args, train=False)
            outputs = self.whole_outputs(run, args)
            runner.plan.finish_step(run)
            return outputs
        if runner.plan.ownership.pending:
            # hybrid's first call: the stage programs cut the tensors into tp shards, before autograd records
            # their shapes (the gradient accumulator of a parameter keeps the shape it first saw)
            with torch.enable_grad():
                runner.plan.programs_for(mb_args)
        trainable = [t for t in runner.plan.ownership.held.values() if t.requires_grad]
        return _GPipe.apply(self, runner, args, mb_args, *trainable)

    def _for_other_model(self, args) -> "PipelineProgram":
        for program in self._others:
            if program.plan.serves(args):
                return program
        program = PipelineProgram.__new__(PipelineProgram)
        program.plan, program._meta_models, program._others = self.plan.fork(), [], []
        state = next((args[i.index] for i in self.plan.inputs if i.is_state), None)
        program._roots = materialize.roots_holding(state) if state is not None else []
        hook_frame_modules(program._roots)      # another model of the class: its modules, found on the stack
        self._others.append(program)
        return program

    def micro_batches(self, args) -> tuple["PipelineProgram", list[list[Any]]]:
        """The program that runs a plain call's micro-batches, and their graph inputs: this program on the
        batch split along dim 0 when its graph runs on micro-batches; else the program of the graph Dynamo
        traces again at the micro-batch shape (the backend's re-trace, ``PipelinePlan.retrace``)."""
        mb_args = self.split(args)
        if self.plan.runs_micro_batches(mb_args):
            return self, mb_args
        if self.plan.retrace is None:
            self.plan.programs_for(mb_args)      # raises: the graph holds the whole batch's sizes
        with recording() as recorder:
            for mb in mb_args:
                self.plan.retrace(mb)
        plans = {id(call.program.plan) for call in recorder.calls}
        if len(recorder.calls) != len(mb_args) or len(plans) != 1:
            raise RuntimeError(f"dynshard: traced at the micro-batch shape, the model gave {len(recorder.calls)} "
                               f"pipelined graph(s) of {len(plans)} plan(s) for {len(mb_args)} micro-batches; remove "
                               "graph breaks (TORCH_LOGS=graph_breaks shows them)")
        micro = recorder.calls[0].program
        if len(micro.plan.staged.outputs) != len(self.plan.staged.outputs):
            raise RuntimeError("dynshard: the model's graph at the micro-batch shape returns other outputs than at "
                               "the batch's; call it through dynshard.train_step")
        return micro, [call.args for call in recorder.calls]

    # -- pieces the steps share ----------------------------------------------------------------------
    def split(self, args) -> list[list[Any]]:
        """The micro-batches of a call: every tensor input split along dim 0 into pipeline_nmicros, and a
        symbolic size that is the batch's (the symbol of a split input's dim 0) divided with it."""
        m = self.plan.nmicros
        mb_args = [list(args) for _ in range(m)]
        for inp in self.plan.inputs:
            value = args[inp.index]
            if inp.kind != "input" or value.dim() == 0:
                continue
            if value.shape[0] % m:
                raise ValueError(f"dynshard: the pipeline splits input {inp.name} (batch {value.shape[0]}) into "
                                 f"pipeline_nmicros={m} micro-batches along dim 0; use a batch divisible by {m}")
            for mb, piece in enumerate(value.chunk(m)):     # (contiguous: what the stages are compiled for)
                mb_args[mb][inp.index] = piece.contiguous()
        for index in batch_size_inputs(self.plan.inputs):
            for mb in range(m):
                mb_args[mb][index] = int(args[index]) // m
        return mb_args

    def run(self, schedule, mb_args, train: bool, seed_fn=None, actions=None) -> StepRun:
        sync = self.plan.buffer_sync
        before = sync.versions(mb_args[0]) if sync is not None else None
        with torch.set_grad_enabled(train):
            if self.plan.ownership.pending:       # hybrid's first call: the stage programs cut the tensors
                self.plan.programs_for(mb_args)
            mb_args = self.plan.ownership.with_replicas(mb_args, train)
            programs, metas = self.plan.programs_for(mb_args)
            run = StepRun(self.plan, schedule, programs, metas, mb_args, train, seed_fn)
            run.run(schedule.actions[self.plan.groups.pp_rank] if actions is None else actions)
        run.finish()
        if self._roots:       # (after the first run: hybrid's stage programs cut their tp shards in it)
            guard_modules(self._roots)
            self._roots = []
            for hook in PREPARE_HOOKS:
                hook()
        if sync is not None:
            sync.after_call(mb_args[0], before)
        return run

    def last_stage_rank(self, schedule, mb: int) -> int:
        """The global rank that runs micro-batch ``mb``'s last stage under ``schedule``."""
        plan = self.plan
        return plan.groups.global_rank(schedule.rank_of(len(plan.staged.stages) - 1, mb))

    def broadcast(self, tensors: list[torch.Tensor], sources: list[int]) -> None:
        """Each tensor from its source (global rank: that of the last stage which computed it) to every rank
        of the unit, in place."""
        group = self.plan.groups.pp_group
        if group is None:
            return
        batches: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        for tensor, source in zip(tensors, sources):
            batches.setdefault((source, tensor.dtype), []).append(tensor)
        for (source, _), same in batches.items():      # one broadcast per source and dtype
            flat = torch.cat([t.reshape(-1) for t in same])
            dist.broadcast(flat, src=source, group=group)
            offset = 0
            for tensor in same:
                tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()

    def whole_outputs(self, run: StepRun, args) -> list[Any]:
        """The whole batch's outputs on every rank, from the micro-batches' on the last stage's rank."""
        plan = self.plan
        outputs, tensors = [], []
        for position, (ref, meta) in enumerate(zip(plan.staged.outputs, plan.outputs_at(run.args, whole=True))):
            if ref[0] == "constant":
                outputs.append(ref[1])
                continue
            if ref[0] == "input":
                outputs.append(args[ref[1]])
                continue
            if run.outputs:
                pieces = [run.outputs[mb][position].detach() for mb in range(len(run.outputs))]
                value = _combine(plan.combine[position], pieces, args)
            else:
                value = torch.empty(meta.shape, dtype=meta.dtype, device=plan.device)
            outputs.append(value)
            tensors.append(value)
        # plain calls run single-lane schedules (gpipe, infer_pipe): every micro-batch ends on one rank
        self.broadcast(tensors, [self.last_stage_rank(plan.forward_only, 0)] * len(tensors))
        return outputs


def _combine(rule: str, pieces: list[torch.Tensor], args) -> torch.Tensor:
    """The whole batch's output from the micro-batches' (``args``: the whole batch's graph inputs)."""
    if hasattr(rule, "combine"):      # a mean weighted by each micro-batch's counted targets (WeightedMean)
        return rule.combine(pieces, args)
    if rule == "cat":
        return torch.cat(pieces)
    if rule == "mean":
        return torch.stack(pieces).mean(0)
    if rule == "sum":
        return torch.stack(pieces).sum(0)
    return pieces[0].clone()


def _seed(rule: str, grad: torch.Tensor, mb: int, m: int, scales=None) -> torch.Tensor | None:
    """The gradient of micro-batch ``mb``'s output from the gradient of the whole batch's (``scales``: each
    micro-batch's weight in a weighted mean, W_i / W: one with no counted target, whose loss is 0/0, adds
    nothing and runs no backward)."""
    if scales is not None:
        return grad * scales[mb] if scales[mb] else None
    if rule == "cat":
        return grad.chunk(m)[mb]
    if rule == "mean":
        return grad / m
    if rule == "sum":
        return grad
    return grad if mb == 0 else None


class _GPipe(torch.autograd.Function):
    """``loss = model(batch); loss.backward()`` as GPipe: forwards here, backwards in :meth:`backward`."""

    @staticmethod
    def forward(ctx, whole: PipelineProgram, runner: PipelineProgram, args, mb_args, *trainable):
        """``whole``: the program of the call's graph (its outputs, how they combine); ``runner``: the program
        that runs the micro-batches ``mb_args`` (the same one, or the graph traced at the micro-batch shape)."""
        plan = runner.plan
        if plan.gpipe is None:
            raise RuntimeError("dynshard: this pipeline plan has no training schedule (inference_only)")
        actions = plan.gpipe.actions[plan.groups.pp_rank]
        cut = _first_backward(actions)
        run = runner.run(plan.gpipe, mb_args, train=True, actions=actions[:cut])
        ctx.whole, ctx.runner, ctx.run, ctx.rest, ctx.args = whole, runner, run, actions[cut:], args
        outputs = whole.whole_outputs(run, args)
        ctx.mark_non_differentiable(*[o for o, meta in zip(outputs, whole.plan.output_metas)
                                      if isinstance(o, torch.Tensor) and (meta is None or not meta.requires_grad)])
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        run, plan, combine = ctx.run, ctx.runner.plan, ctx.whole.plan.combine
        m = len(run.args)
        scales: dict[int, list[float]] = {}       # weighted means: W_i / W, found where a seed needs them

        def scales_of(position: int):
            rule = combine[position]
            if not hasattr(rule, "scales"):
                return None
            if position not in scales:
                scales[position] = rule.scales(ctx.args, m).tolist()
            return scales[position]

        def seed(mb, outputs):
            tensors, seeds = [], []
            for position, (out, grad) in enumerate(zip(outputs, grads)):
                if grad is None or not isinstance(out, torch.Tensor) or not out.requires_grad:
                    continue
                piece = _seed(combine[position], grad, mb, m, scales_of(position))
                if piece is not None:
                    tensors.append(out)
                    seeds.append(piece)
            return tensors, seeds

        run.seed_fn = seed
        with FreshGradients(plan.ownership):
            with torch.enable_grad():
                run.run(ctx.rest)
            run.finish()
            reduce_gradients(plan.ownership, plan.groups)
        plan.finish_step(run)
        ctx.run = ctx.args = None
        return (None,) * len(ctx.needs_input_grad)

