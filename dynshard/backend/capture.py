"""What Dynamo hands the backend: which graph inputs are parameters, buffers or user inputs, by name."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Sequence

import torch
import torch.fx as fx

from .. import compat
from ..runtime.sharding import ShardTag, get_tag

_MODULE_PATH = re.compile(r"\._modules\['([^']+)'\]|\._(parameters|buffers)\['([^']+)'\]|\.([A-Za-z_][A-Za-z0-9_]*)")


@dataclasses.dataclass(frozen=True)
class GraphInput:
    """One placeholder of the captured graph, described by its global (unsharded) metadata."""

    index: int
    name: str            # fully qualified name for parameters and buffers, placeholder name otherwise
    kind: str            # "parameter", "buffer" or "input"
    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    tag: ShardTag | None  # set when the tensor already holds its shard (placement is then fixed)

    @property
    def is_state(self) -> bool:
        return self.kind in ("parameter", "buffer")

    def token(self) -> str:
        return f"{self.kind}:{self.name}:{tuple(self.shape)}:{self.stride}:{self.dtype}:{self.requires_grad}"


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


def describe_inputs(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> list[GraphInput]:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    described = []
    for index, (node, value) in enumerate(zip(placeholders, example_inputs)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"dynshard: graph input {node.target} is a {type(value).__name__}, not a tensor; dynshard "
                "plans static shapes, so compile without dynamic=True / mark_dynamic")
        if any(not isinstance(s, int) for s in value.shape):
            raise TypeError(
                f"dynshard: graph input {node.target} has symbolic shape {tuple(value.shape)}; dynshard "
                "plans static shapes, so compile without dynamic=True / mark_dynamic")
        source = compat.grapharg_source_name(node)
        fqn = fqn_from_source(source)
        if isinstance(value, torch.nn.Parameter):
            kind = "parameter"
        elif source is not None and "._buffers[" in source:
            kind = "buffer"
        else:
            kind = "input"
        tag = get_tag(value)
        shape = tag.global_shape if tag is not None else value.shape
        stride = tag.global_stride if tag is not None else tuple(value.stride())
        described.append(GraphInput(
            index=index, name=fqn if (fqn and kind != "input") else input_name(source, str(node.target)),
            kind=kind,
            shape=torch.Size(shape), stride=tuple(stride), dtype=value.dtype, device=value.device,
            requires_grad=value.requires_grad, tag=tag))
    return described
