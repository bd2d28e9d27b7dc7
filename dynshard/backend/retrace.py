"""The backend's re-trace of a pipelined graph at the micro-batch shape: the compiled frame called again, once per
micro-batch, so that Dynamo traces it there.

A plain call ``model(batch)`` under a pipeline policy hands dynshard a graph traced with the whole batch.
When that graph holds sizes taken from the batch (``x.view(B, T, ...)`` with B a number), its stages
cannot run on micro-batches. The frame Dynamo compiled is then called again with each micro-batch in
place of the batch (the batch's tensors found by their Dynamo sources, ``L['batch']['x']``), under the
same backend and options: Dynamo traces the user's code at the micro-batch shape, exactly as
``dynshard.train_step`` does, and the pipeline plan of that graph runs the micro-batches. The runtime calls
a :class:`MicroBatchRetrace` the backend put in the pipeline's plan (it never compiles anything itself).
"""

from __future__ import annotations

import dataclasses
import re
import types
from typing import Any, Callable

import torch

_ROOT = re.compile(r"^L\['([^']+)'\]")
_ITEM = re.compile(r"\[('([^']*)'|(\d+))\]")


def parse_source(source: str | None) -> tuple[str, tuple[Any, ...]] | None:
    """``L['batch']['x'][0]`` -> ("batch", ("x", 0)); None for any other kind of source."""
    match = _ROOT.match(source or "")
    if match is None:
        return None
    rest, path = source[match.end():], []
    while rest:
        item = _ITEM.match(rest)
        if item is None:
            return None
        path.append(item.group(2) if item.group(2) is not None else int(item.group(3)))
        rest = rest[item.end():]
    return match.group(1), tuple(path)


class _Tuple(list):
    """A tuple of the frame's arguments while its tensors are filled in."""


@dataclasses.dataclass(frozen=True)
class _Input:
    """Where the skeleton takes the graph's user input ``index``: every place the frame held that tensor (Dynamo
    passes a tensor given twice, ``model(input_ids=x, labels=x)``, as one graph input)."""

    index: int


def _skeleton(value: Any, inputs: dict[int, int]) -> Any:
    """Containers copied, the graph's input tensors marked (``inputs``: id -> graph input index; filled per
    micro-batch), other tensors dropped, anything else kept by reference."""
    if isinstance(value, torch.Tensor):
        return _Input(inputs[id(value)]) if id(value) in inputs else None
    if isinstance(value, dict):
        return {k: _skeleton(v, inputs) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_skeleton(v, inputs) for v in value]
        return _Tuple(items) if isinstance(value, tuple) else items
    return value


def _build(skeleton: Any, tensors: dict[int, torch.Tensor]) -> Any:
    """The frame's arguments from ``skeleton``, each marked input replaced by its tensor in ``tensors``."""
    if isinstance(skeleton, _Input):
        return tensors[skeleton.index]
    if isinstance(skeleton, dict):
        return {k: _build(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        items = [_build(v, tensors) for v in skeleton]
        return tuple(items) if isinstance(skeleton, _Tuple) else items
    return skeleton


def _resolve(root: dict, name: str, path: tuple[Any, ...]) -> Any:
    value = root[name]
    for key in path:
        value = value[key]
    return value


@dataclasses.dataclass
class FrameCall:
    """How to call the frame Dynamo compiled, with other tensors for the graph's user inputs."""

    function: Callable
    argnames: tuple[str, ...]
    varargs: str | None
    varkw: str | None
    skeleton: dict[str, Any]
    inputs: dict[int, tuple[str, tuple[Any, ...]]]    # graph input index -> (local, path)
    _compiled: Callable | None = None

    @classmethod
    def capture(cls, frame: dict | None, sources: dict[int, str | None]) -> "FrameCall | None":
        """From Dynamo's compile (``compat.compiling_frame()``) and the sources of the user inputs; None when
        a user input does not come from the frame's arguments by indexing."""
        if frame is None or not all(k in frame for k in ("code", "globals", "locals")):
            return None
        code: types.CodeType = frame["code"]
        inputs = {}
        for index, source in sources.items():
            parsed = parse_source(source)
            if parsed is None:
                return None
            inputs[index] = parsed
        positional = code.co_argcount + code.co_kwonlyargcount
        names = code.co_varnames
        varargs = names[positional] if code.co_flags & 0x04 else None
        varkw = names[positional + (1 if varargs else 0)] if code.co_flags & 0x08 else None
        wanted = names[:positional] + tuple(n for n in (varargs, varkw) if n)
        if not all(name in frame["locals"] for name in wanted):
            return None
        try:
            held = {id(_resolve(frame["locals"], name, path)): index for index, (name, path) in inputs.items()}
        except (KeyError, IndexError, TypeError):
            return None
        if len(held) != len(inputs):        # (two graph inputs from one tensor: not Dynamo's way)
            return None
        function = types.FunctionType(code, frame["globals"], code.co_name, None, frame.get("closure"))
        skeleton = {name: _skeleton(frame["locals"][name], held) for name in wanted}
        return cls(function, names[:code.co_argcount], varargs, varkw, skeleton, inputs)

    def call(self, options: Any, tensors: dict[int, torch.Tensor]) -> Any:
        """The frame's function compiled by dynshard with ``options``, called with ``tensors`` as the graph's
        user inputs."""
        if self._compiled is None:
            self._compiled = torch.compile(self.function, backend="dynshard", options=options)
        local = {name: _build(value, tensors) for name, value in self.skeleton.items()}
        args = [local[n] for n in self.argnames] + (list(local[self.varargs]) if self.varargs else [])
        kwargs = dict(local[self.varkw]) if self.varkw else {}
        return self._compiled(*args, **kwargs)


@dataclasses.dataclass
class MicroBatchRetrace:
    """What a pipeline plan calls with each micro-batch's graph inputs (a list by graph input index) when its
    graph holds the whole batch's sizes: the frame, compiled with ``options`` (the traced plan replayed)."""

    frame: FrameCall
    options: Any

    def __call__(self, graph_inputs: list[Any]) -> Any:
        return self.frame.call(self.options, {i: graph_inputs[i] for i in self.frame.inputs})

