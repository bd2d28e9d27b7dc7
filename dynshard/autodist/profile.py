"""``dynshard.profile(model, *args, **kwargs)``: what each module of a model costs, without running it.

One forward and one backward run on FakeTensors (nothing is allocated; a model built on the meta device
works as it is), under torch's ``FlopCounterMode`` and a saved-tensors hook. Per module (by its path,
inclusive of its children): forward and backward FLOPs, parameter bytes, and the bytes of activations its
forward saves for the backward (parameters and their views excluded; a tensor saved twice counted once).
The cost model of an automatic policy reads these; users read the table (``print(dynshard.profile(...))``).

The backward's FLOPs are attributed to modules by torch's module tracker, which is exact per block and
approximate inside one (an attention's matmul gradients may land on a sibling projection).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from .. import compat

ROOT = ""


@dataclasses.dataclass(frozen=True)
class ModuleCost:
    path: str                 # "" for the model itself
    forward_flops: int
    backward_flops: int
    parameter_bytes: int
    saved_bytes: int          # activations its forward keeps for the backward


@dataclasses.dataclass(frozen=True)
class Profile:
    modules: tuple[ModuleCost, ...]     # in the order the forward first entered them

    def __getitem__(self, path: str) -> ModuleCost:
        for module in self.modules:
            if module.path == path:
                return module
        raise KeyError(path)

    def __str__(self) -> str:
        rows = [("module", "forward FLOPs", "backward FLOPs", "parameter bytes", "saved bytes")] + [
            (m.path or "(model)", f"{m.forward_flops:,}", f"{m.backward_flops:,}", f"{m.parameter_bytes:,}",
             f"{m.saved_bytes:,}") for m in self.modules]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                         for r in rows)


def profile(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Profile:
    """Costs per module of ``model(*args, **kwargs)`` and a backward from its first output (a scalar loss,
    or the sum of the output)."""
    fake_mode = compat.new_fake_mode()
    device = _device(args, kwargs)
    with fake_mode:
        tensors = _fake(dict(list(model.named_parameters()) + list(model.named_buffers())), device)
        args, kwargs = _fake(args, device), _fake(kwargs, device)
    names = {id(m): path for path, m in model.named_modules()}
    params = {id(t) for t in tensors.values()}
    stack: list[str] = []
    entered: set[str] = {ROOT}
    saved: dict[str, dict[int, int]] = {}

    def enter(module, _inputs):
        stack.append(names.get(id(module), "?"))
        entered.add(stack[-1])

    def leave(module, _inputs, _output):
        stack.pop()

    def pack(tensor):
        if id(tensor) not in params and id(getattr(tensor, "_base", None)) not in params:
            for path in {ROOT, *_ancestors(stack[-1] if stack else ROOT)}:
                saved.setdefault(path, {})[id(tensor)] = tensor.numel() * tensor.element_size()
        return tensor

    counter = FlopCounterMode(display=False)
    with contextlib.ExitStack() as hooks:
        hooks.enter_context(fake_mode)
        hooks.enter_context(counter)
        hooks.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
        pre = torch.nn.modules.module.register_module_forward_pre_hook(enter)
        post = torch.nn.modules.module.register_module_forward_hook(leave, always_call=True)
        hooks.callback(pre.remove)
        hooks.callback(post.remove)
        output = torch.func.functional_call(model, tensors, args, kwargs)
        forward = _by_path(counter, model)
        loss = _first_tensor(output)
        if loss is not None and loss.requires_grad:
            (loss if loss.dim() == 0 else loss.sum()).backward()
        both = _by_path(counter, model)
    parameter_bytes = {path: sum(p.numel() * p.element_size() for p in module.parameters())
                       for path, module in model.named_modules()}
    order = [path for path, _ in model.named_modules()]
    return Profile(tuple(ModuleCost(path, forward.get(path, 0), both.get(path, 0) - forward.get(path, 0),
                                    parameter_bytes[path], sum(saved.get(path, {}).values()))
                         for path in order if path in entered))


def _ancestors(path: str) -> list[str]:
    parts = path.split(".") if path else []
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _by_path(counter: FlopCounterMode, model: torch.nn.Module) -> dict[str, int]:
    """FlopCounterMode's counts ("GPT.blocks.0", "Global") by module path ("blocks.0", "" for the model)."""
    root = type(model).__name__
    counts = {}
    for name, ops in counter.get_flop_counts().items():
        if name == "Global":
            counts[ROOT] = sum(ops.values())
        elif name.startswith(root + "."):
            counts[name[len(root) + 1:]] = sum(ops.values())
    return counts


def _device(args, kwargs) -> torch.device:
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor) and value.device.type != "meta":
            return value.device
    return torch.device("cpu")


def _fake(value, device):
    """Under a FakeTensorMode: a FakeTensor of each tensor's shape on ``device`` (a meta tensor too)."""
    return compat.pytree.tree_map_only(torch.Tensor, lambda t: torch.empty_strided(
        t.shape, t.stride(), dtype=t.dtype, device=device).requires_grad_(t.requires_grad), value)


def _first_tensor(value):
    return next((leaf for leaf in compat.pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)), None)
