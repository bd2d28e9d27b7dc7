"""Tracing inside a Dynamo backend call: the planning passes' fake mode, a tracing context of dynshard's
own, the compile's cacheable fake mode, and the lowering of a Dynamo graph to ATen ops (``make_fx``).
Re-exported by :mod:`dynshard.compat`.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch
import torch.fx as fx

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode


def new_fake_mode() -> FakeTensorMode:
    from torch._subclasses.fake_tensor import FakeTensorMode

    # The planning passes' fake mode: no ShapeEnv (nothing symbolic to track). Inductor's compiles get one,
    # with the program's inputs fakeified statically (cacheable_fake_mode), for its FX graph cache. See
    # docs/design.md.
    return FakeTensorMode(allow_non_fake_inputs=True)


def cacheable_fake_mode(example_inputs: Sequence[Any]):
    """A fake mode with a ShapeEnv, which Inductor's FX graph cache needs (it bypasses graphs compiled
    without one: "No shape env", so a restart regenerated every kernel), and the program's tensor inputs
    fakeified in it with static shapes: aot_autograd takes its own mode's fake inputs as they are, where
    it would give real ones symbolic sizes (a dynamic-shape program) because the mode has a ShapeEnv.
    (None, inputs) where an input is a number, which aot_autograd would make symbolic all the same."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    if any(isinstance(x, (int, float, torch.SymInt)) for x in example_inputs):
        return None, example_inputs
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    return fake_mode, [fake_mode.from_tensor(x, static_shapes=True)
                       if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor) else x
                       for x in example_inputs]


@contextlib.contextmanager
def isolated_tracing(fake_mode=None) -> Iterator[None]:
    """Run nested tracing/compiling inside a Dynamo backend call without touching Dynamo's context, with
    DTensor's random ops drawn locally (:func:`local_random_ops`)."""
    from torch._guards import TracingContext, tracing

    with tracing(TracingContext(fake_mode or new_fake_mode())), local_random_ops():
        yield


@contextlib.contextmanager
def local_random_ops() -> Iterator[None]:
    """DTensor's random ops run on the local shard as plain ops. On a CUDA mesh DTensor otherwise starts its
    offset-based RNG tracker, which reads the generator's offset (``_local_scalar_dense``) and fails on
    FakeTensors: every tp plan with a dropout failed to plan on CUDA (an H200, 2 ranks over gloo). Planning
    needs only shapes; dynshard's programs draw as ``passes/random_draws`` says, not through the tracker."""
    import torch.distributed.tensor._random as dtensor_random

    tracker = dtensor_random._rng_tracker
    if tracker is None:
        dtensor_random._rng_tracker = _NoTracker()
    else:
        enabled, tracker.distribute_region_enabled = tracker.distribute_region_enabled, False
    try:
        yield
    finally:
        if tracker is None:
            dtensor_random._rng_tracker = None
        else:
            tracker.distribute_region_enabled = enabled


class _NoTracker:
    """A tracker that never distributes a region: DTensor's dispatch then runs a random op as it is (2.13
    reads the flag; 2.11 enters the region, which does nothing)."""
    distribute_region_enabled = False

    @contextlib.contextmanager
    def _distribute_region(self, spec, generator=None):
        yield


def trace_to_aten(gm: fx.GraphModule, fake_inputs: Sequence[Any], fake_mode,
                  decompositions: dict | None = None) -> fx.GraphModule:
    """Lower a Dynamo graph to ATen ops with FakeTensor metadata (``make_fx``), keeping each node's
    source line (``stack_trace``) from the Dynamo graph."""
    import torch.fx.traceback as fx_traceback
    from torch.fx.experimental.proxy_tensor import make_fx

    def run(*args):
        return fx.Interpreter(gm).run(*args)

    # functionalized: an in-place update of a buffer (BatchNorm's running stats) becomes a value and a
    # final copy_ into the buffer, which DTensor can place; an in-place op on a re-sharded copy of a
    # buffer would be lost. torch.func's (C++) functionalization reads a symbolic size as its hint (a
    # guard Eq(s, hint) that makes the program static); Python's keeps the symbols.
    symbolic = any(_has_symbols(value) for value in fake_inputs)
    functional = _python_functionalized(run) if symbolic else torch.func.functionalize(run, remove="mutations")
    with isolated_tracing(fake_mode), fake_mode, fx_traceback.preserve_node_meta(), on_symbols(symbolic):
        return make_fx(functional, decomposition_table=decompositions or {}, tracing_mode="real")(*fake_inputs)


def on_symbols(symbolic: bool):
    """Within, ops on tensors of symbolic sizes run as aot_autograd runs them: a composite op decomposes by its
    Python kernel, which keeps the symbols, where its C++ kernel reads a size as a number (a guard that makes
    the program static: ``F.pad`` on a symbolic length). Nothing changes where ``symbolic`` is False."""
    from torch._dispatch.python import enable_python_dispatcher

    return enable_python_dispatcher() if symbolic else contextlib.nullcontext()


def _has_symbols(value) -> bool:
    if isinstance(value, torch.SymInt):
        return True
    return isinstance(value, torch.Tensor) and any(isinstance(size, torch.SymInt) for size in value.shape)


def _python_functionalized(run):
    """``run`` functionalized by torch's Python functionalization (``FunctionalTensorMode``, as aot_autograd
    does), with ``torch.func.functionalize(remove="mutations")``'s ending: an input ``run`` mutated is
    written back by one ``copy_`` after the graph's work."""
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
    from torch.utils import _pytree as pytree

    def unwrap(value):
        torch._sync(value)
        return torch._from_functional_tensor(value.elem)

    def functional(*args):
        updates = []
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize)):
            with FunctionalTensorMode():
                wrapped = [FunctionalTensor.to_functional(a) if isinstance(a, torch.Tensor) else a for a in args]
                outputs = pytree.tree_map_only(FunctionalTensor, unwrap, run(*wrapped))
                for arg, value in zip(args, wrapped):
                    if isinstance(value, FunctionalTensor):
                        torch._sync(value)
                        if torch._functionalize_has_data_mutation(value.elem):
                            updates.append((arg, torch._from_functional_tensor(value.elem)))
            for arg, update in updates:
                arg.copy_(update)
        return outputs
    return functional


@contextlib.contextmanager
def fake_tensor_log_quiet() -> Iterator[None]:
    """Within: FakeTensor's logger (``torch._subclasses.fake_tensor``) reports nothing below CRITICAL, for a
    fake run whose failure is an answer, not an error to report."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)
