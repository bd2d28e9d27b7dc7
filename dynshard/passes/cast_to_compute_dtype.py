"""Mixed precision (``Config.mixed_precision``, torch's ``MixedPrecisionPolicy``): compute in param_dtype.

The Dynamo graph gets explicit casts at its boundary, before it is lowered, so that every later pass
(and the ATen graph DTensor propagates) sees the dtypes the program will compute in:

- each floating parameter is cast to ``param_dtype`` where it enters (it stays fp32 at rest: the
  optimizer steps fp32 master weights, and its gradient comes back fp32);
- floating user inputs too, with ``cast_forward_inputs`` (FSDP2's default);
- floating outputs are cast to ``output_dtype`` when it is set;
- an op that needs its operands in one dtype (a matmul, attention and its mask) and meets fp32 beside
  ``param_dtype`` gets the fp32 ones cast (:func:`_match_operand_dtypes`). Dynamo traced the model at fp32,
  so the dtypes its Python read (transformers' RMSNorm returns ``weight * x.to(input_dtype)``, its mask is
  made in the embeddings' dtype) are fp32 in the graph where the same code run on ``param_dtype`` weights,
  as under FSDP2, reads ``param_dtype``. Ops that meet only fp32 (a rotary table computed in fp32 on
  purpose) are left alone.

:mod:`.insert_collectives` moves each parameter's cast before its ZeRO all-gather (half the bytes in
bf16) and reduces its gradient in ``reduce_dtype`` (``param_dtype`` when unset, as FSDP2).
Buffers keep their dtype, as in FSDP2.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from .. import compat
from .context import PassContext

# ops whose floating operands must share one dtype (torch-level: the Dynamo graph)
_ONE_DTYPE = {F.linear, torch._C._nn.linear, torch.matmul, operator.matmul, torch.mm, torch.bmm, torch.addmm,
              torch.baddbmm, torch.einsum, F.scaled_dot_product_attention, "matmul", "mm", "bmm"}


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
        _match_operand_dtypes(gm, ctx, policy.param_dtype)
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


def _match_operand_dtypes(gm: fx.GraphModule, ctx: PassContext, dtype: torch.dtype) -> None:
    """Run the graph on FakeTensors of its inputs (parameters now entering in ``dtype``) and, before each op of
    :data:`_ONE_DTYPE` whose floating tensor operands mix ``dtype`` with another, cast the others to ``dtype``
    (a float attention mask to its queries')."""
    graph = gm.graph

    class Matching(fx.Interpreter):
        def run_node(self, node):
            if node.op in ("call_function", "call_method") and node.target in _ONE_DTYPE:
                values = [self.env[a] for a in node.all_input_nodes]
                dtypes = {v.dtype for v in values if isinstance(v, torch.Tensor) and v.dtype.is_floating_point}
                if dtype in dtypes and len(dtypes) > 1:
                    for arg in node.all_input_nodes:
                        value = self.env[arg]
                        if isinstance(value, torch.Tensor) and value.dtype.is_floating_point and value.dtype != dtype:
                            with graph.inserting_before(node):
                                cast = graph.call_method("to", (arg, dtype))
                            node.replace_input_with(arg, cast)
                            self.env[cast] = value.to(dtype)
            return super().run_node(node)

    fakes = ctx.fake_inputs()
    symbolic = any(inp.kind == "size" for inp in ctx.inputs)
    with compat.isolated_tracing(ctx.fake_mode), ctx.fake_mode, compat.on_symbols(symbolic):
        Matching(gm).run(*fakes)
