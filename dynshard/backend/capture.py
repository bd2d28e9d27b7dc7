"""What Dynamo hands the backend: which graph inputs are parameters, buffers or user inputs, by name.

A graph input may be a DTensor: a split output of another dynshard program (``Config(gather_outputs=False)``)
that crossed a graph break into this one. Dynamo traces it as a DTensor (its ops in the graph are the user's
torch calls, its example input the DTensor itself); dynshard plans it as a whole value of its global shape
whose placements on the plan unit's mesh are fixed (:attr:`GraphInput.placements`), and the program takes
its local tensor (:mod:`dynshard.runtime.split_values`). While Dynamo traces a frame for dynshard, a plain
tensor next to a DTensor counts as replicated (:func:`install_capture_hooks`): user code written for one
process mixes them (``F.cross_entropy(logits, labels)``), and Dynamo's trace only needs the global shapes.
"""

from __future__ import annotations

import contextlib
import functools
import re
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor

from .. import compat
from ..compat.dtensor_inputs import tensors_as_replicated
from ..runtime.graph_inputs import GraphInput, mesh_identity  # noqa: F401  (re-exported)
from ..runtime.backend_identity import compiling_for_dynshard
from ..runtime.compile_hooks import around_dynamo_compiles
from ..runtime.sharding import get_tag

_SYMBOL = re.compile(r"\b[su]\d+\b")     # Dynamo's symbols: s33, u0
_MODULE_PATH = re.compile(r"\._modules\['([^']+)'\]|\._(parameters|buffers)\['([^']+)'\]|\.([A-Za-z_][A-Za-z0-9_]*)")


class BackendFailedError(RuntimeError):
    """dynshard failed on FakeTensors while planning or compiling a graph (an error Dynamo would have made a
    graph break of, running the frame eagerly outside the plan)."""


def raising_not_breaking(backend):
    """``backend`` with the errors Dynamo turns into a graph break raised instead. Dynamo takes FakeTensor's
    data-dependent, dynamic-shape and unsupported-operator errors from a backend as the graph's own and runs
    the frame eagerly, with a warning: the model would then train partly outside dynshard (its inner frames
    planned alone, its parameters placed per inner graph). Dynamo has already traced the graph, so such an
    error comes from dynshard's planning on fake values, never from the user's code."""
    @functools.wraps(backend)
    def raising(*args, **kwargs):
        try:
            return backend(*args, **kwargs)
        except compat.graph_break_exceptions() as error:
            raise BackendFailedError(
                f"dynshard: planning this graph failed on FakeTensors ({type(error).__name__}: {error}). Dynamo "
                "would have made a graph break of it and run the frame eagerly, outside the plan. Please report "
                "it with the model; a different policy or partition_constraints may avoid it") from error
    return raising


_LOCAL = re.compile(r"^L\['([^']+)'\]$")
_ROOT = re.compile(r"^L\['[^']+'\]")


def input_name(source: str | None, placeholder: str) -> str:
    """``L['x']`` -> ``x``; anything else keeps Dynamo's placeholder name."""
    match = _LOCAL.match(source or "")
    return match.group(1) if match else placeholder


def fqn_from_source(source: str | None) -> str | None:
    """``L['self']._modules['h']._modules['0']._parameters['weight']`` -> ``h.0.weight`` (whatever the
    root module's local name)."""
    root = _ROOT.match(source or "")
    if root is None or "._parameters[" not in source and "._buffers[" not in source:
        return None
    parts = []
    for match in _MODULE_PATH.finditer(source[root.end():]):
        module, _, state, attr = match.groups()
        parts.append(module or state or attr)
    return ".".join(parts) if parts else None


def rename_symbols(expressions: list[list[str | None] | None]) -> list[tuple[str | None, ...] | None]:
    """Dynamo's symbol names replaced by ``d0, d1, ...`` in order of first appearance, so that two traces
    of one shape family (on two ranks, or after a restart) name their dimensions alike."""
    names: dict[str, str] = {}

    def rename(expr: str | None) -> str | None:
        if expr is None:
            return None
        return _SYMBOL.sub(lambda m: names.setdefault(m.group(0), f"d{len(names)}"), expr)

    return [None if dims is None else tuple(rename(d) for d in dims) for dims in expressions]


def describe_inputs(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> list[GraphInput]:
    """Each placeholder of ``gm`` by name and global metadata. A graph Dynamo traced with symbolic sizes
    (``dynamic=True``, ``mark_dynamic``) has them as inputs of kind "size" (their symbols), and its tensors
    say which dimensions follow which symbol (:attr:`GraphInput.symbols`, the shape family)."""
    install_capture_hooks()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    symbols = rename_symbols([compat.symbolic_dims(node) for node in placeholders])
    described = []
    for index, (node, value, dims) in enumerate(zip(placeholders, example_inputs, symbols)):
        # (an int where Dynamo traced a SymInt: a pipeline stage of a symbolic graph, at a micro-batch's sizes)
        if isinstance(value, torch.SymInt) or (isinstance(value, int) and dims is not None):
            described.append(GraphInput(
                index=index, name=str(node.target), kind="size", shape=torch.Size(), stride=(), dtype=torch.int64,
                device=torch.device("cpu"), requires_grad=False, tag=None, symbols=dims,
                value=compat.size_hint(value)))
            continue
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"dynshard: graph input {node.target} is a {type(value).__name__}, not a tensor or a symbolic size; "
                "pass a changing Python number to the model as a tensor")
        source = compat.grapharg_source_name(node)
        fqn = fqn_from_source(source)
        if isinstance(value, torch.nn.Parameter):
            kind = "parameter"
        elif source is not None and "._buffers[" in source:
            kind = "buffer"
        else:
            kind = "input"
        tag = get_tag(value)
        shape = tag.global_shape if tag is not None else value.shape      # (a DTensor's shape is global)
        stride = tag.global_stride if tag is not None else tuple(value.stride())
        split = isinstance(value, DTensor)
        if split and kind != "input":
            raise TypeError(
                f"dynshard: {kind} {fqn or node.target} is a DTensor; dynshard places parameters and buffers "
                "itself: compile the plain module (DTensor inputs are taken as split outputs of dynshard's own "
                "programs)")
        described.append(GraphInput(
            index=index, name=fqn if (fqn and kind != "input") else input_name(source, str(node.target)),
            kind=kind,
            shape=torch.Size(shape), stride=tuple(stride), dtype=value.dtype, device=value.device,
            requires_grad=value.requires_grad, tag=tag,
            placements=tuple(value.placements) if split else None,
            mesh=mesh_identity(value.device_mesh) if split else None, symbols=dims))
    return described


_FLOATS_BEFORE: list[bool] = []


def keep_floats_constant() -> None:
    """A frame compiled for dynshard traces the model's Python floats as constants, under ``dynamic=True``
    too (which would make them symbolic inputs: LayerNorm's eps, attention's scaling and dropout p, read
    back with ``.item()`` inside each repeated block). dynshard makes sizes symbolic, not numbers; a float
    that changes from call to call recompiles, up to Dynamo's recompile limit, and is then refused
    (:class:`dynshard.RecompileLimitError`, which names it). Registered when dynshard is imported (the
    first frame is traced before the backend is called) and at every backend call (``torch._dynamo.reset()``
    drops Dynamo's callbacks)."""
    compat.register_compile_start(_floats_constant)
    compat.register_compile_end(_floats_as_before)


def _floats_constant(args) -> None:
    if compat.starts_frame_compile(args) and compiling_for_dynshard():
        _FLOATS_BEFORE.append(compat.specialize_floats(True))


def _floats_as_before(args) -> None:
    if compat.starts_frame_compile(args) and _FLOATS_BEFORE:
        compat.specialize_floats(_FLOATS_BEFORE.pop())


_MIXED = contextlib.ExitStack()


def _allow_mixed() -> None:
    _MIXED.enter_context(tensors_as_replicated())


def _end_mixed() -> None:
    _MIXED.close()


def install_capture_hooks() -> None:
    """While Dynamo traces a frame for dynshard, DTensor treats plain tensors as replicated, so that user
    code mixing a split value (a DTensor returned by another program) with tensors traces (Dynamo runs each
    op on fake values to learn its output's shape). The placements Dynamo sees there decide nothing: the
    program is planned again on global shapes, with the DTensor inputs' placements fixed. Called on every
    backend call (``torch._dynamo.reset()`` drops the hooks); outside a Dynamo compile it does nothing, since
    the hooks must know the backend whose frames they apply to."""
    backend = compat.compiling_backend()
    if backend is not None:
        around_dynamo_compiles(_allow_mixed, _end_mixed, backend)
