"""``F.scaled_dot_product_attention`` priced as a GPU runs it: one fused kernel.

Traced on a CPU (autodist plans GPUs' jobs offline), SDPA is either the CPU's flash kernel (no mask) or,
given an ``attn_mask``, its math path: the scores materialized (batch x heads x S x S), the mask added, a
softmax and two batched matmuls, each priced as it runs there, the softmax's output saved for the backward.
On a GPU torch runs one kernel instead (flash attention; memory-efficient attention where a mask is given),
which
- keeps no S x S tensor: it saves its inputs, its output and the log-sum-exp of each query's row (fp32);
- moves no scores through memory: its time is its FLOPs at the rate fused attention achieves
  (``DeviceProfile.rates["attention.<dtype>"]``, well below a plain matmul's);
- does half the work of a causal product (``is_causal``: the tiles above the diagonal are skipped; with a
  mask tensor every tile is computed);
- recomputes the scores in its backward: 2.5x the forward's FLOPs (five matmuls against two), where the cost
  model prices every other op's backward at twice its forward.

The ATen ops one call decomposed into are found by Dynamo's ``source_fn_stack`` (each names the call), and
priced as one op: the call's last matmul (its output is the attention's, placed as it is) carries the
kernel; the call's other ops cost nothing.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import torch
import torch.fx as fx

from .device_profile import DeviceProfile
from .graph_costs import OpCost, op_costs

_CAUSAL_OPS = ("tril", "triu")


def op_costs_on(profile: DeviceProfile, gm: fx.GraphModule, inputs, fake_mode) -> list[OpCost]:
    """Each op of the ATen graph ``gm`` with its global costs (``graph_costs.op_costs``) as ``profile``'s device
    runs it: SDPA as one kernel where the device fuses it."""
    ops = op_costs(gm, inputs, fake_mode)
    return as_fused_kernels(gm, ops) if profile.fused_attention else ops


def as_fused_kernels(gm: fx.GraphModule, ops: list[OpCost]) -> list[OpCost]:
    """``ops`` (of ``gm``) with each SDPA call's ops priced as one fused GPU kernel."""
    calls = _sdpa_calls(gm)
    if not calls:
        return ops
    nodes = {n.name: n for n in gm.graph.nodes}
    by_name = {op.name: op for op in ops}
    priced: dict[str, OpCost] = {}
    for names in calls.values():
        inside = [by_name[n] for n in names if n in by_name]
        computing = [op for op in inside if op.flops]
        if not computing:
            continue
        kernel = computing[-1]
        forward = sum(op.flops for op in computing) * (0.5 if _causal(names, nodes) else 1.0)
        value = nodes[kernel.name].meta.get("val")
        outside = _inputs_from_outside(names, nodes, _shape(nodes[computing[0].name])[-2:], _shape(nodes[kernel.name])[-1:])
        dtype = next((nodes[n].meta["val"].dtype for n in outside), torch.float32)   # (the query's: the math path
        #                                                                          upcasts half precision on a CPU)
        saved = sum(_nbytes(nodes[n]) for n in outside) + kernel.out_bytes + _logsumexp_bytes(value)
        for op in inside:
            priced[op.name] = dataclasses.replace(op, flops=0, bytes=0, out_bytes=0, saved_bytes=0, saves=(),
                                                  kernels=0)
        priced[kernel.name] = dataclasses.replace(
            kernel, flops=int(forward), bytes=0, saved_bytes=int(saved), kernels=1,
            saves=tuple(sorted(n for n in outside if nodes[n].op != "placeholder")),
            rate=f"attention.{str(dtype).removeprefix('torch.')}", backward_extra_flops=int(forward / 2))
    return [priced.get(op.name, op) for op in ops]


def _sdpa_calls(gm: fx.GraphModule) -> dict[str, list[str]]:
    """Each SDPA call Dynamo traced -> the names of the ATen ops it became, in the graph's order."""
    calls: dict[str, list[str]] = defaultdict(list)
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        stack = node.meta.get("source_fn_stack") or ()
        if stack and "scaled_dot_product_attention" in getattr(stack[-1][1], "__name__", str(stack[-1][1])):
            calls[stack[-1][0]].append(node.name)
    return calls


def _causal(names: list[str], nodes: dict[str, fx.Node]) -> bool:
    """A causal product: the kernel kept whole was asked ``is_causal``, or the math path built the triangle."""
    for name in names:
        node = nodes[name]
        schema = getattr(node.target, "_schema", None)
        if any(op in str(node.target) for op in _CAUSAL_OPS):
            return True
        if schema is not None and any(a.name == "is_causal" for a in schema.arguments):
            index = next(i for i, a in enumerate(schema.arguments) if a.name == "is_causal")
            causal = node.kwargs.get("is_causal", node.args[index] if index < len(node.args) else False)
            if causal is True:
                return True
    return False


def _inputs_from_outside(names: list[str], nodes: dict[str, fx.Node], scores: tuple, head: tuple) -> list[str]:
    """The tensors the call reads from outside it but a mask (what the fused kernel saves: query, key and
    value), ``scores`` the scores' last two sizes and ``head`` the output's last: a mask is boolean, or
    shaped as the scores and not as a head."""
    inside = set(names)
    found: list[str] = []
    for name in names:
        for arg in nodes[name].all_input_nodes:
            value = arg.meta.get("val")
            if arg.name in inside or arg.name in found or not isinstance(value, torch.Tensor):
                continue
            if value.dtype == torch.bool or (tuple(value.shape[-2:]) == scores and tuple(value.shape[-1:]) != head):
                continue
            found.append(arg.name)
    return found


def _shape(node: fx.Node) -> tuple:
    value = node.meta.get("val")
    return tuple(value.shape) if isinstance(value, torch.Tensor) else ()


def _nbytes(node: fx.Node) -> int:
    value = node.meta.get("val")
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def _logsumexp_bytes(output) -> int:
    """The kernel's log-sum-exp: one fp32 per query row and head (its output without the head dimension)."""
    if not isinstance(output, torch.Tensor) or output.dim() < 2:
        return 0
    return output.numel() // output.shape[-1] * 4


__all__ = ["as_fused_kernels", "op_costs_on"]
