"""What runs every step: the compiled per-rank program, called with this rank's local tensors.

The plan's inputs and program are the backend's (``backend.capture.GraphInput``,
``backend.compile.CompiledProgram``); the runtime reads them and does not import the backend, a later layer.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
import time
from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor, Placement

from . import materialize
from .accumulation import Accumulation, job_accumulation
from .buffer_sync import BufferSync
from .ddp import check_active_ddp
from .eager_guard import guard_modules
from .graph_inputs import sizes_of
from .mesh import Layout
from .sharding import get_tag, shard_in_place
from .split_values import adopt_split_inputs, local_arguments, mark_split_outputs, split_input_indices
from .unit_inputs import InputCheck
from .zero import ZeroSpec


# Called with each outermost module of the frame a ShardedProgram is built for (while Dynamo compiles it).
# Later layers add to it rather than being imported from here: dynshard.checkpoint.rank_state adds the hook
# that makes the module's state_dict() say where each shard sits (when it is imported, as `import dynshard`
# does).
FRAME_MODULE_HOOKS: list[Callable[[torch.nn.Module], None]] = []
# Called when a program has cut a model's tensors (its first call on that model, a second model of the class
# included), from inside the caller's step: dynshard.checkpoint.pretrained finds transformers' Trainer there.
PREPARE_HOOKS: list[Callable[[], None]] = []


@dataclasses.dataclass(eq=False)
class CompiledPlan:
    """A plan and its compiled program; shared by every Dynamo graph with the same key."""

    key: str
    inputs: list                       # backend.capture.GraphInput
    placements: dict[int, tuple[Placement, ...]]
    zero: dict[int, ZeroSpec]          # inputs stored as ZeRO rows over the data-parallel ranks
    layout: Layout
    program: Any                       # backend.compile.CompiledProgram
    propagation: Any
    pass_timings: list[tuple[str, float]]
    inference_only: bool
    hits: int = 0
    build_no_sync: Callable[[], Any] | None = None   # the accumulation variant, compiled lazily
    input_check: InputCheck | None = None       # the unit's ranks were fed the same batch
    buffer_sync: BufferSync | None = None       # written buffers stay equal over the data-parallel units
    plan: Any = None                            # planning.Plan: the decisions this program executes
    calls: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=16))
    # a symbolic graph under a unit of several ranks: its program at a call's sizes, (args, sync) -> program,
    # compiled from this plan without planning or communication (``program`` is the one at the traced sizes)
    build_sized: Callable[[Any, bool], Any] | None = None
    _no_sync: Any = None
    _sized: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self._traced_sizes = sizes_of(self.inputs)     # what ``program`` was compiled for

    def seconds_between_calls(self) -> float | None:
        """The median time between this program's latest training calls: its step, when a step calls it once
        (measured for explain's predicted-against-measured; None before three calls)."""
        times = list(self.calls)
        if len(times) < 3:
            return None
        return statistics.median(b - a for a, b in zip(times, times[1:]))

    def no_sync_program(self, args=None) -> Any:
        if self.build_sized is not None:
            return self.program_at(args, sync=False)
        if self._no_sync is None:
            self._no_sync = self.build_no_sync()
        return self._no_sync

    @property
    def compiled_sizes(self) -> tuple[tuple, ...]:
        """The sizes of the symbolic dimensions each compiled program of ``build_sized`` is for (the traced
        sizes first), the accumulation variants' included; () for a plan of one program."""
        if self.build_sized is None:
            return ()
        return (self._traced_sizes,) + tuple(sizes for _, sizes in self._sized)

    @property
    def compile_seconds(self) -> float:
        return self.program.seconds + sum(program.seconds for program in self._sized.values())

    def program_at(self, args, sync: bool = True) -> Any:
        """The program for a call's arguments: ``program``, or (``build_sized``) the one at their sizes."""
        if self.build_sized is None:
            return self.program
        key = (sync, sizes_of(self.inputs, args))
        if key == (True, self._traced_sizes):
            return self.program
        if key not in self._sized:
            self._sized[key] = self.build_sized(args, sync)
        return self._sized[key]


class ShardedProgram:
    """The callable handed back to Dynamo for one captured graph.

    On its first call it turns the parameters and buffers it uses into this rank's shards, in place
    (the same tensor objects), and tags them; from then on arguments arrive already local. A model built on
    the meta device is initialised first, one module at a time (:mod:`.materialize`).
    """

    def __init__(self, plan: CompiledPlan):
        self.plan = plan
        self._prepared = False
        self._params = [inp for inp in plan.inputs if inp.kind == "parameter"]
        self._state = [inp.index for inp in plan.inputs if inp.is_state]
        self._split_inputs = split_input_indices(plan.inputs)   # DTensors (split values of another program)
        self._tags = []            # of its parameters and buffers, and of the programs its DTensors come from
        # built while Dynamo compiles a frame: the meta-built models of that frame, initialised on the first run
        self._meta_models = materialize.frame_models()
        materialize.install()      # the trace hook, again after a torch._dynamo.reset()
        self._roots = materialize.frame_roots()     # their modules refuse eager calls once they hold shards
        hook_frame_modules(self._roots)

    def __call__(self, *args: Any):
        check_active_ddp()      # a DDP built around the model after its parameters were cut is refused
        if not self._prepared or (self._state and get_tag(args[self._state[0]]) is None):
            self.prepare(args)     # (or another model of the class: Dynamo serves it this compiled frame)
        plan = self.plan
        if torch.is_grad_enabled() and not plan.inference_only:
            plan.calls.append(time.perf_counter())
        if plan.input_check is not None:
            plan.input_check(args)
        if self._split_inputs:     # the program runs on their local tensors
            args = local_arguments(args, self._split_inputs)
        if plan.buffer_sync is None:
            return self._run(plan, args)
        before = plan.buffer_sync.versions(args)
        outputs = self._run(plan, args)
        plan.buffer_sync.after_call(args, before)
        return outputs

    def _run(self, plan: CompiledPlan, args):
        if plan.inference_only:
            with torch.no_grad():
                program = plan.program_at(args)
                return self._outputs(program, program.run(*args))
        accumulation = job_accumulation()
        if plan.build_no_sync is not None and torch.is_grad_enabled() and accumulation.wants_no_sync(
                args[i.index] for i in self._params):
            program = plan.no_sync_program(args)
            return self._outputs(program, program.run(*self._accumulating(args, accumulation)))
        if accumulation.pending and torch.is_grad_enabled():
            accumulation.flush()       # the first synchronising call reduces what was accumulated
        program = plan.program_at(args)
        return self._outputs(program, program.run(*args))

    def _outputs(self, program, outputs):
        """``Config(gather_outputs=False)``: this rank's shards of split outputs become DTensors."""
        if not program.split_outputs:
            return outputs
        outputs = list(outputs)
        for position, (placements, shape, stride) in program.split_outputs.items():
            outputs[position] = DTensor.from_local(outputs[position], self.plan.layout.tp_mesh, placements,
                                                   run_check=False, shape=shape, stride=stride)
        mark_split_outputs(outputs, program.split_outputs, self._tags)
        return outputs

    def _accumulating(self, args, accumulation: Accumulation) -> list:
        """The no-sync variant's arguments: whole replicas for ZeRO parameters; local gradients."""
        args = list(args)
        for inp in self._params:
            param = args[inp.index]
            if inp.index in self.plan.zero:
                args[inp.index] = accumulation.replica(param)
            elif param.requires_grad:
                accumulation.accumulates(param)
        return args

    def prepare(self, args) -> None:
        """Cut the program's parameters and buffers into this rank's pieces, in place, and tag them."""
        if self._prepared and self._state:      # another model of the class: its modules, found on the stack
            self._roots = materialize.roots_holding(args[self._state[0]])
            hook_frame_modules(self._roots)
        materialize.materialize(self._meta_models, self.plan, args)   # cuts this program's tensors as it goes
        self._meta_models = []
        for inp in self.plan.inputs:
            if inp.is_state:
                tag = shard_in_place(args[inp.index], inp.name, self.plan.layout, self.plan.placements[inp.index],
                                     self.plan.zero.get(inp.index))
                tag.add_plan(self.plan)
                self._tags.append(tag)
        guard_modules(self._roots)
        self._roots = []
        # a program fed split values (a loss after a graph break) is explained with the programs they come from
        self._tags += adopt_split_inputs(self.plan, args, self._split_inputs)
        self._prepared = True
        for hook in PREPARE_HOOKS:
            hook()


def hook_frame_modules(roots: list[torch.nn.Module]) -> None:
    """Run ``FRAME_MODULE_HOOKS`` on each outermost module of a program's frame."""
    for module in roots:
        for hook in FRAME_MODULE_HOOKS:
            hook(module)
