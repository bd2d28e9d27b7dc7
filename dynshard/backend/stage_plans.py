"""Hybrid pipelines: the tp placements of every stage, planned with the pipeline's cut on the planning rank
(at the captured shapes) and installed when a stage compiles on its ranks (at micro-batch shapes).

A stage's placements are the tp policy's on the stage graph, as a whole graph of a tp plan would get them,
without data-parallel communication (the pipeline reduces gradients once per step, and its ZeRO rows are
gathered once per step). In the pipeline's Plan a tensor's ``tp`` is its stages' placement, and the
activations a stage's policy placed are keyed ``<stage>/<node key>``. Parameters are placed the same at any
batch size (the policy reads the graph's structure), so the micro-batch programs install what was planned
at the captured shape.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import compat
from ..passes import LOWER, PLACE, PROPAGATE, PassContext, copy_graph, run_passes
from ..planning import STAGE_SEPARATOR, ActivationChoice, Plan, TensorChoice
from ..planning.costs import with_forward_collectives
from ..planning.outline import stage_outline
from ..policies import place_stage
from ..runtime.graph_inputs import GraphInput


def stage_context(ctx: PassContext, inputs: list[GraphInput], fake_mode=None, layout=None, **fields) -> PassContext:
    """A hybrid stage's passes: the stage's outline (:func:`planning.outline.stage_outline`), placed by the tp
    policy with the pipeline's tp options, without data-parallel communication."""
    return PassContext(config=ctx.config, outline=stage_outline(ctx.outline), layout=layout or ctx.layout,
                       inputs=inputs, fake_mode=fake_mode or compat.new_fake_mode(), sync_grads=False, stage_program=True,
                       policy=place_stage(ctx.outline.pipeline.sequence_parallel), **fields)


def plan_stages(ctx: PassContext, stages, planned: set[int]) -> dict[int, Plan]:
    """The tp plan of each stage in ``planned`` (by index), on this rank's layout."""
    plans = {}
    fake_mode, memo = compat.new_fake_mode(), None     # (one mode: the stages' layers ask DTensor once)
    for stage in stages:
        if stage.index not in planned:
            continue
        stage_ctx = stage_context(ctx, stage_inputs(stage, ctx.inputs), fake_mode, op_memo=memo)
        graph = copy_graph(stage.module)          # (the lowering edits the graph)
        for phase in (LOWER, PLACE, PROPAGATE):
            graph = run_passes(graph, stage_ctx, phase)
        memo = stage_ctx.op_memo
        ctx.timings.extend((f"stage{stage.index}.{name}", t) for name, t in stage_ctx.timings)
        plans[stage.index] = with_forward_collectives(stage_ctx.plan, stage_ctx.propagation, stage_ctx.node_keys)
    return plans


def stage_inputs(stage, inputs: list[GraphInput]) -> list[GraphInput]:
    """A stage graph's inputs as its compile describes them: the captured graph's inputs it reads, then the
    values it receives (whole, at the captured shape: a symbolic graph's at its hints)."""
    described = [dataclasses.replace(inputs[i], index=j) for j, i in enumerate(stage.graph_inputs)]
    placeholders = [n for n in stage.module.graph.nodes if n.op == "placeholder"][len(described):]
    for node in placeholders:
        value = node.meta["example_value"]
        described.append(GraphInput(index=len(described), name=str(node.target), kind="input",
                                    shape=torch.Size(compat.size_hint(d) for d in value.shape),
                                    stride=tuple(compat.size_hint(d) for d in value.stride()), dtype=value.dtype,
                                    device=value.device, requires_grad=value.requires_grad, tag=None,
                                    symbols=compat.symbolic_dims(node)))
    return described


def merge_stage_plans(plan: Plan, stage_plans: dict[int, Plan]) -> Plan:
    """The pipeline's plan with its stages' placements: a tensor's ``tp`` (the same in every stage that reads
    it, else the policy's choices disagree and are refused), the stages' activations and predicted forward
    collectives by stage."""
    tensors = dict(plan.tensors)
    chosen: dict[str, tuple[int, str]] = {}
    activations, collectives = {}, []
    for index, stage_plan in sorted(stage_plans.items()):
        for name, choice in stage_plan.tensors.items():
            if name not in tensors:       # a received value
                continue
            if name in chosen and chosen[name][1] != choice.tp:
                raise ValueError(f"dynshard: the stages of a hybrid plan place {name} differently (stage "
                                 f"{chosen[name][0]}: {chosen[name][1]}, stage {index}: {choice.tp}); a tensor "
                                 "read by two stages keeps one placement")
            chosen[name] = (index, choice.tp)
            tensors[name] = dataclasses.replace(tensors[name], tp=choice.tp)
        for key, choice in stage_plan.activations.items():
            readers = None if choice.readers is None else tuple(f"{index}{STAGE_SEPARATOR}{r}" for r in choice.readers)
            activations[f"{index}{STAGE_SEPARATOR}{key}"] = ActivationChoice(choice.tp, readers)
        for collective in stage_plan.predicted.collectives:
            collectives.append(dataclasses.replace(collective, at=f"{index}{STAGE_SEPARATOR}{collective.at}"))
    predicted = dataclasses.replace(plan.predicted, forward_collectives=tuple(collectives))
    return dataclasses.replace(plan, tensors=tensors, activations=activations, predicted=predicted)


def stage_plan(plan: Plan, stage_index: int, inputs: list[GraphInput]) -> Plan | None:
    """What a stage's compile installs, from the pipeline's plan; None when the plan does not place the
    stage (a plan without stage placements, or one edited to ``"tp": null``): its tp policy runs then."""
    tensors = {}
    for inp in inputs:
        choice = plan.tensors.get(inp.name)
        if choice is None and inp.kind == "input":
            tp = "R"                  # a value the stage receives: whole on the stage's ranks
        elif choice is None or choice.tp is None:
            return None
        else:
            tp = choice.tp
        tensors[inp.name] = TensorChoice.of(inp, tp)
    prefix = f"{stage_index}{STAGE_SEPARATOR}"
    activations = {key[len(prefix):]: ActivationChoice(
        a.tp, None if a.readers is None else tuple(r[len(prefix):] for r in a.readers))
        for key, a in plan.activations.items() if key.startswith(prefix)}
    return Plan(made_for=None, policy="tp", mesh=plan.mesh, tensors=tensors, activations=activations,
                zero=dataclasses.replace(plan.zero, level=0, ngroups=1, reduce_scatter=False),
                recompute=plan.recompute, mixed_precision=plan.mixed_precision)
