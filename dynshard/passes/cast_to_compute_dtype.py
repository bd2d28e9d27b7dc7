"""Mixed precision (``Config.mixed_precision``, torch's ``MixedPrecisionPolicy``): compute in param_dtype.

The Dynamo graph gets explicit casts at its boundary, before it is lowered, so that every later pass
(and the ATen graph DTensor propagates) sees the dtypes the program will compute in:

- each floating parameter is cast to ``param_dtype`` where it enters (it stays fp32 at rest: the
  optimizer steps fp32 master weights, and its gradient comes back fp32);
- floating user inputs too, with ``cast_forward_inputs`` (FSDP2's default);
- floating outputs are cast to ``output_dtype`` when it is set.

:mod:`.insert_collectives` moves each parameter's cast before its ZeRO all-gather (half the bytes in
bf16) and reduces its gradient in ``reduce_dtype`` (``param_dtype`` when unset, as FSDP2).
Buffers keep their dtype, as in FSDP2.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .context import PassContext


def cast_to_compute_dtype(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    policy = ctx.mixed_precision
    if policy is None or (policy.param_dtype is None and policy.output_dtype is None):
        return gm
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if policy.param_dtype is not None:
        for inp, node in zip(ctx.inputs, placeholders):
            cast = inp.kind == "parameter" or (inp.kind == "input" and policy.cast_forward_inputs)
            if not cast or not inp.dtype.is_floating_point or inp.dtype == policy.param_dtype:
                continue
            with graph.inserting_after(placeholders[-1]):     # placeholders stay first
                new = graph.call_method("to", (node, policy.param_dtype))
            node.replace_all_uses_with(new, delete_user_cb=lambda user, new=new: user is not new)
    if policy.output_dtype is not None:
        output = next(n for n in graph.nodes if n.op == "output")
        with graph.inserting_before(output):
            output.args = fx.node.map_arg(output.args, lambda value: _cast_output(graph, value, policy.output_dtype))
    graph.lint()
    gm.recompile()
    return gm


def _cast_output(graph: fx.Graph, value: fx.Node, dtype: torch.dtype) -> fx.Node:
    example = value.meta.get("example_value")
    if not isinstance(example, torch.Tensor) or not example.dtype.is_floating_point:
        return value
    return graph.call_method("to", (value, dtype))
