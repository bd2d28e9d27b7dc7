"""``dynshard.explain(model)``: the compiled plan, as a user reads it and as tests count it."""

from __future__ import annotations

import dataclasses
import math

import torch

from typing import Sequence

from .backend.compile import CollectiveRecord
from .planning import Plan
from .planning.costs import RankBytes, StepCollective, itemsize, memory_at_rest, step_collectives
from .planning.prediction import OpPlacementSolve
from .runtime.sharding import describe_placements, get_tag
from .runtime.state_dict import unwrap_compiled


@dataclasses.dataclass(frozen=True)
class ParameterPlacement:
    name: str
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    placement: str


@dataclasses.dataclass(frozen=True)
class ProgramReport:
    key: str
    inputs: int
    collectives: tuple[CollectiveRecord, ...]
    fallbacks: tuple[str, ...]
    compile_seconds: float
    cache_hits: int
    saved_bytes: int = 0     # activations kept from the forward for the backward, on this rank
    saved_count: int = 0
    compiled_once: tuple[tuple[str, int], ...] = ()   # repeated blocks compiled once: (class, calls)
    seconds_between_calls: float | None = None        # median, latest training calls (a step, when once a step)
    plan: Plan | None = None                          # the dynshard.Plan it executes
    # a symbolic graph under a unit of several ranks: the sizes of its symbolic dimensions that each of its
    # programs was compiled for (the traced sizes first); () for one program serving every size
    compiled_sizes: tuple[tuple, ...] = ()
    symbolic: bool = False    # one program compiled on symbolic sizes, for every size of its shape family


@dataclasses.dataclass(frozen=True)
class StageReport:
    index: int
    ranks: tuple[int, ...]    # pipeline ranks (in the plan unit) that run it: two under chimera_direct
    modules: tuple[str, ...]
    flops: int                # forward FLOPs of one whole batch, as measured for the cut
    receives: int             # tensors it receives per micro-batch
    saved_bytes: int = 0      # activations its forward keeps for its backward, per micro-batch (this rank's stages)


@dataclasses.dataclass(frozen=True)
class PipelineReport:
    key: str
    schedule: str             # the configured schedule's name
    nmicros: int
    stages: tuple[StageReport, ...]
    grid: str                 # the schedule, a row per step and a column per rank
    p2p_bytes: int            # bytes all ranks of a unit send per step (forward + backward), the minimum
    sent_bytes: int           # bytes this rank sent in its latest step
    idle_fraction: float      # of this rank's latest step
    compile_seconds: float
    cache_hits: int
    plan: Plan | None = None              # the dynshard.Plan it executes
    trace_dir: str | None = None          # where its ranks write their traces (Config.trace_dir)
    # the micro-batch shapes (of the graph's user inputs) this rank's stages were compiled at, per mode
    compiled_shapes: tuple[tuple, ...] = ()

    def __str__(self) -> str:
        lines = [f"pipeline {self.key}: {len(self.stages)} stages, schedule {self.schedule}, "
                 f"{self.nmicros} micro-batches, compiled in {self.compile_seconds:.1f}s, cache hits {self.cache_hits}"]
        rows = [("stage", "rank", "forward FLOPs", "receives", "saved for backward", "modules")] + [
            (str(s.index), ",".join(map(str, s.ranks)), str(s.flops), str(s.receives), str(s.saved_bytes) if s.saved_bytes else "-",
             ", ".join(s.modules)) for s in self.stages]
        lines += _table(rows)
        lines.append(f"  p2p per step (all ranks of a unit, forward + backward): {self.p2p_bytes} bytes; "
                     f"this rank sent {self.sent_bytes} bytes, idle {self.idle_fraction:.1%} of its latest step")
        if len(self.compiled_shapes) > 1:
            lines.append(f"  this rank's stages compiled at {len(self.compiled_shapes)} micro-batch shapes (grad mode, "
                         f"the inputs' shapes): " + ", ".join(str(shape) for shape in self.compiled_shapes))
        lines += ["  " + line for line in self.grid.splitlines()]
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Explanation:
    parameters: tuple[ParameterPlacement, ...]
    programs: tuple[ProgramReport, ...]
    pipelines: tuple[PipelineReport, ...] = ()
    plans: tuple[Plan, ...] = ()       # each program's (and pipeline's) dynshard.Plan, in compile order

    def why_not(self, plan: str) -> str:
        """Why autodist did not choose ``plan`` (a hand plan's name in its table, e.g. "tp + sequence
        parallel" or "pp 1f1b"): its predicted step and peak against the chosen plan's."""
        return why_not(self.plans, plan)

    def collectives(self, kind: str | None = None, phase: str | None = None,
                    group: str | None = None) -> list[CollectiveRecord]:
        return [c for p in self.programs for c in p.collectives
                if (kind is None or c.kind == kind) and (phase is None or c.phase == phase)
                and (group is None or c.group == group)]

    def bytes(self, phase: str | None = None, group: str | None = None) -> int:
        return sum(c.bytes for c in self.collectives(phase=phase, group=group))

    def saved_bytes(self) -> int:
        """Bytes of activations all programs keep for their backward, on this rank."""
        return sum(p.saved_bytes for p in self.programs)

    def save_html(self, path: str, limit_bytes: int | None = None, trace_dir: str | None = None) -> str:
        """Write the page of these plans (``dynshard.pictures``), with what this rank measured beside the
        predictions; ``limit_bytes``: the memory limit drawn (default: autodist's ``mem_constraint``, else the
        CUDA device's memory); ``trace_dir``: pipeline traces to draw (default: the job's ``Config.trace_dir``).
        Returns ``path``."""
        return _write(path, self.to_html(limit_bytes, trace_dir))

    def to_html(self, limit_bytes: int | None = None, trace_dir: str | None = None) -> str:
        from .pictures import Measured, Section, Traced, render

        sizes = {p.name: p.local_shape for p in self.parameters}
        on_cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        peak = torch.cuda.max_memory_allocated() if on_cuda else None
        if limit_bytes is None and on_cuda:
            limit_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory

        def held(plan: Plan, kind: str) -> int:
            return sum(math.prod(sizes[name]) * itemsize(t.dtype) for name, t in plan.tensors.items()
                       if t.kind == kind and name in sizes)

        sections = []
        for program in self.programs:
            if program.plan is None:
                continue
            found: dict[tuple[str, str], list[int]] = {}
            for c in program.collectives:
                found.setdefault((c.kind, c.group), []).append(c.bytes)
            record = program.plan.predicted.autodist
            calls = 1 if record is None else record.update_freq
            step = None if program.seconds_between_calls is None else program.seconds_between_calls * calls
            measured = Measured(held(program.plan, "parameter"), held(program.plan, "buffer"), program.saved_bytes,
                                peak, step_seconds=step)
            sections.append(Section(program.plan, measured,
                                    Traced(tuple((k, g, len(b), sum(b)) for (k, g), b in found.items()))))
        for pipeline in self.pipelines:
            if pipeline.plan is not None:
                measured = Measured(held(pipeline.plan, "parameter"), held(pipeline.plan, "buffer"),
                                    sum(s.saved_bytes for s in pipeline.stages), peak, "micro-batch")
                sections.append(Section(pipeline.plan, measured, Traced(p2p_minimum=pipeline.p2p_bytes,
                                                                        p2p_sent=pipeline.sent_bytes),
                                        trace_dir=trace_dir or pipeline.trace_dir))
        return render(sections, "dynshard: the plans of a compiled model", limit_bytes, str(self))

    def __str__(self) -> str:
        lines = ["parameters"]
        rows = [("name", "global shape", "local shape", "placement")] + [
            (p.name, str(list(p.global_shape)), str(list(p.local_shape)), p.placement) for p in self.parameters]
        lines += _table(rows)
        for index, program in enumerate(self.programs):
            lines.append("")
            lines.append(f"program {index} ({program.inputs} inputs, compiled in {program.compile_seconds:.1f}s, "
                         f"cache hits {program.cache_hits})")
            lines.append(f"  saved for backward: {program.saved_bytes} bytes in {program.saved_count} tensors "
                         "(activations, per rank)")
            if program.symbolic:
                lines.append("  one program for every size of its symbolic dimensions (compiled on symbols)")
            if program.compiled_sizes:
                lines.append(f"  compiled at {len(program.compiled_sizes)} sizes of its symbolic dimensions (a "
                             "program per size under a unit of several ranks): " + ", ".join(
                                 str(list(sizes)) for sizes in program.compiled_sizes))
            if program.compiled_once:
                lines.append("  compiled once, called per repetition: " + ", ".join(
                    f"{cls} x{calls}" for cls, calls in program.compiled_once))
            lines.append("  collectives as traced (Inductor may still bucket independent all-reduces)")
            rows = [("phase", "collective", "group", "bytes", "shape")] + [
                (c.phase, c.kind, c.group, str(c.bytes), str(list(c.shape))) for c in program.collectives]
            if any(c.region for c in program.collectives):     # which repeated block issues it, per call
                rows = [row + (c.region or "-" if c is not None else "in",)
                        for row, c in zip(rows, (None, *program.collectives))]
            lines += _table(rows) if program.collectives else ["  no collectives"]
            for fallback in program.fallbacks:
                lines.append(f"  replicated fallback: {fallback}")
        for pipeline in self.pipelines:
            lines += ["", str(pipeline)]
        for program in self.programs:
            if program.plan is not None and program.plan.predicted.autodist is not None:
                lines += [""] + _autodist_lines(program.plan) + _measured_lines(program.plan, program)
        return "\n".join(lines)


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


def format_plan(plan) -> str:
    """A compiled plan as a reviewer reads it: where each input sits and what the forward will send."""
    rows = [("input", "kind", "shape", "placement")]
    for inp in plan.inputs:
        placement = describe_placements(plan.layout, plan.placements[inp.index])
        if inp.index in plan.zero:
            placement += ", " + plan.zero[inp.index].describe()
        rows.append((inp.name, inp.kind, str(list(inp.shape)), placement))
    lines = ["placements"] + _table(rows)
    propagation = plan.propagation
    if propagation is not None and propagation.constraints:
        lines.append("activations placed by the policy")
        lines += _table([("node", "placement", "for")] + [
            (name, describe_placements(plan.layout, c.placements),
             "every reader" if c.readers is None else ", ".join(c.readers))
            for name, c in propagation.constraints.items()])
    if propagation is not None:
        lines.append("forward communication (predicted)")
        rows = [("node", "collective", "group", "bytes")] + [
            (c.node, c.kind, c.mesh_dim, str(c.bytes)) for c in propagation.collectives]
        lines += _table(rows) if propagation.collectives else ["  none"]
        for node, reason in propagation.fallbacks.items():
            lines.append(f"replicated fallback at {node}: {reason}")
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class PlanExplanation:
    """Plans as values (``dynshard.plan``'s, or loaded): what each holds per rank and sends per step."""

    plans: tuple[Plan, ...]

    def memory(self, index: int = 0) -> list[RankBytes]:
        return memory_at_rest(self.plans[index])

    def collectives(self, index: int = 0) -> list[StepCollective]:
        return step_collectives(self.plans[index])

    def why_not(self, plan: str) -> str:
        return why_not(self.plans, plan)

    def save_html(self, path: str, limit_bytes: int | None = None, trace_dir: str | None = None) -> str:
        """Write the page of these plans (``dynshard.pictures``): placements, memory per rank against
        ``limit_bytes`` (default: autodist's ``mem_constraint``), communication, the pipeline schedule (and
        the traces in ``trace_dir``), autodist's choice. Returns ``path``."""
        return _write(path, self.to_html(limit_bytes, trace_dir))

    def to_html(self, limit_bytes: int | None = None, trace_dir: str | None = None) -> str:
        from .pictures import Section, render

        return render([Section(plan, trace_dir=trace_dir) for plan in self.plans], "dynshard: plans",
                      limit_bytes, str(self))

    def __str__(self) -> str:
        lines: list[str] = []
        for index, plan in enumerate(self.plans):
            mesh, zero = plan.mesh, plan.zero
            made = "" if plan.made_for is None else f", graph {plan.made_for.graph}"
            level = f"ZeRO-{zero.level}" + (f" in {zero.ngroups} groups" if zero.ngroups > 1 else "") \
                + (" reduce-scatter" if zero.reduce_scatter else "") if zero.level else "no ZeRO"
            lines += [f"plan {index}: policy {plan.policy}{made}; {mesh.world} ranks = dp {mesh.dp} x pp {mesh.pp} "
                      f"x tp {mesh.tp}; {level}" + (f"; recompute {', '.join(plan.recompute)}" if plan.recompute else "")]
            tensors = [t for t in plan.tensors.values() if t.kind != "input"]
            split = sum(1 for t in tensors if t.tp not in (None, "R"))
            rows = sum(1 for t in tensors if t.dp == "zero")
            lines.append(f"  {len(tensors)} parameters and buffers: {split} split over tp, {rows} in ZeRO rows over "
                         f"dp; {len(plan.activations)} activations placed by the policy")
            lines.append("  at rest, per rank (bytes; optimizer: Adam's two fp32 moments per element)")
            memory = memory_at_rest(plan)
            lines += _table([("ranks", "parameters", "buffers", "gradients", "optimizer", "total")] + [
                (m.ranks + ("" if m.exact else " (hybrid: stage tensors counted whole)"), str(m.parameters),
                 str(m.buffers), str(m.gradients), str(m.optimizer), str(m.total)) for m in memory])
            collectives = step_collectives(plan)
            unit = " (summed over a unit's pipeline ranks)" if plan.pipeline is not None else ""
            lines.append(f"  collectives per step, per rank{unit} (payload bytes)")
            lines += _table([("collective", "group", "count", "bytes", "of")] + [
                (c.kind, c.dim, str(c.count), str(c.bytes), c.what) for c in collectives]) if collectives \
                else ["    none"]
            if plan.pipeline is not None:
                lines += _pipeline_lines(plan)
            lines += _autodist_lines(plan) or _predicted_lines(plan)
            lines.append("")
        return "\n".join(lines).rstrip()


def _write(path: str, page: str) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)
    return path


def _autodist_lines(plan: Plan) -> list[str]:
    """An automatic policy's choice: its predicted step and peak beside every candidate it priced."""
    record = plan.predicted.autodist
    if record is None:
        return []
    p = plan.predicted.cost
    budget = record.mem_constraint_gb
    lines = [f"  autodist chose {record.chosen}: predicted {p.step_seconds:.4g} s a step (compute "
             f"{p.compute_seconds:.4g}, communication {p.communication_seconds:.4g}), peak "
             f"{p.bytes_per_rank.peak} bytes per rank" + (f" of {budget} GB" if budget is not None else "")
             + f"; {record.solver}, {record.ilps} ILPs, {record.status} (bound {record.bound}, gap "
             f"{record.gap}); device profile {record.device_profile.name}",
             *_op_placement_lines(plan.predicted.op_placement),
             "  every plan it priced, under the same cost model:"]
    lines += _table([("plan", "step seconds", "peak bytes", "fits")] + [
        (c.plan + (" *" if c.estimated else ""), f"{c.step_seconds:.4g}", str(c.peak_bytes),
         "yes" if c.fits else "no") for c in record.candidates])
    if any(c.estimated for c in record.candidates):
        lines.append("  * priced from other plans (a hybrid's stages from the tp plan, a variant of several kinds "
                     "from its parts); planned for real only if chosen")
    return lines


def _op_placement_lines(solve: OpPlacementSolve | None) -> list[str]:
    """The per-op placement ILP's solve, when the chosen plan is its."""
    if solve is None:
        return []
    budget = "" if solve.budget_bytes is None else f", a memory row of {solve.budget_bytes} bytes"
    return [f"  its placements: a per-op ILP over DTensor's strategies ({solve.nodes} nodes, {solve.reads} "
            f"reads{budget}), {solve.status}, objective {solve.objective} s, bound {solve.bound}, gap "
            f"{solve.gap}; it holds {solve.held_bytes} bytes as the ILP counts them"]


def _predicted_lines(plan: Plan) -> list[str]:
    """A hand plan's prediction (``dynshard.plan(..., device_profile=...)``), as autodist's are printed."""
    p = plan.predicted.cost
    if p is None:
        return []
    b = p.bytes_per_rank
    return [f"  predicted with device profile {plan.predicted.device_profile.name}: {p.step_seconds:.4g} s a step "
            f"(compute {p.compute_seconds:.4g}, communication {p.communication_seconds:.4g}, bubble "
            f"{p.bubble_seconds:.4g}); peak {b.peak} bytes per rank (activations {b.activations}, "
            f"transient {b.transient}, gathered {b.gathered})"]


def why_not(plans: Sequence[Plan], name: str) -> str:
    chosen = [p for p in plans if p.predicted.autodist is not None]
    if not chosen:
        raise ValueError("dynshard.explain(...).why_not: no plan here was chosen by autodist")
    lines = []
    for plan in chosen:
        record, p = plan.predicted.autodist, plan.predicted.cost
        rows = {c.plan: c for c in record.candidates}
        if name not in rows:
            raise ValueError(f"dynshard.explain(...).why_not: autodist priced no plan {name!r}; it priced "
                             f"{', '.join(sorted(rows))}")
        other, step, peak = rows[name], p.step_seconds, p.bytes_per_rank.peak
        budget = record.mem_constraint_gb
        if not other.fits:
            reason = (f"its peak, {other.peak_bytes} bytes per rank, is over mem_constraint={budget} GB "
                      f"({budget * 1024 ** 3:.0f} bytes)")
        elif other.step_seconds > step:
            reason = (f"it is predicted slower: {other.step_seconds:.4g} s a step against {step:.4g} s "
                      f"(+{other.step_seconds / step - 1:.0%})")
        elif other.step_seconds == step and other.peak_bytes >= peak:
            reason = f"it is as fast, and its peak ({other.peak_bytes} bytes) is not smaller than {peak}"
        elif other.estimated:
            reason = (f"its {other.step_seconds:.4g} s a step is an estimate from other plans (marked * in explain's "
                      "table), not its price planned for real")
        else:       # (the search chooses the fastest fitting row it priced: a record that says otherwise is not its)
            raise ValueError(f"dynshard.explain(...).why_not: {name} fits and is predicted faster than the chosen "
                             f"{record.chosen} ({other.step_seconds:.4g} s against {step:.4g} s a step): this record's "
                             "choice is not the fastest fitting plan it priced")
        lines.append(f"not {name}: {reason}. Chosen: {record.chosen}, {step:.4g} s a step, peak {peak} bytes.")
    return "\n".join(lines)


def _measured_lines(plan: Plan, program: ProgramReport) -> list[str]:
    """A plan's predictions beside what its program traced and measured on this rank."""
    p, m = plan.predicted.cost, plan.predicted.autodist.update_freq
    between = program.seconds_between_calls
    tp_predicted = p.tp_collectives_per_micro_batch
    tp_traced = [c for c in program.collectives if c.group == "tp"]
    dp_traced = [c for c in program.collectives if c.group not in ("tp",)]
    dp_predicted = [c for c in step_collectives(plan) if c.dim != "tp"]
    rows = [("per step, per rank", "predicted", "measured"),
            ("step seconds", f"{p.step_seconds:.4g}",
             f"{between * m:.4g} ({m} call(s) a step)" if between is not None else "(after 3 calls)"),
            ("tp collectives (forward + backward)", f"{tp_predicted.count * m}, {tp_predicted.bytes * m} bytes",
             f"{len(tp_traced) * m}, {sum(c.bytes for c in tp_traced) * m} bytes (as traced)"),
            ("dp collectives", f"{sum(c.count for c in dp_predicted)}, {sum(c.bytes for c in dp_predicted)} bytes",
             f"{len(dp_traced)}, {sum(c.bytes for c in dp_traced)} bytes (as traced, before bucketing)"),
            ("activations saved for the backward", f"{p.bytes_per_rank.activations} bytes",
             f"{program.saved_bytes} bytes")]
    return ["  predicted against measured (this rank):"] + _table(rows)


def _pipeline_lines(plan: Plan) -> list[str]:
    from .runtime.pipeline.schedules import build_schedule

    p = plan.pipeline
    first = p.schedule == "1f1b_plus"
    schedule = build_schedule(p.schedule, p.nstages + int(first), p.nmicros, plan.mesh.pp, first)
    lines = [f"  pipeline: {p.schedule}, {p.nstages} stages, {p.nmicros} micro-batches, {p.nchunks} chunk(s) per "
             f"rank; cut {p.how}"]
    lines += _table([("stage", "starts at", "pipeline ranks", "forward FLOPs")] + [
        (str(s), "(the graph's start)" if s == 0 else p.starts[s - 1], ",".join(map(str, p.stage_ranks[s])),
         str(p.flops[s]) if s < len(p.flops) else "-") for s in range(len(p.stage_ranks))])
    return lines + ["  " + line for line in schedule.format(comms=False).splitlines()]


def explain(model: torch.nn.Module | Plan | Sequence[Plan]) -> Explanation | PlanExplanation:
    """The plan of every compiled program that uses ``model``'s parameters (after its first run); or, given
    plans (``dynshard.plan``'s result, or ``Plan.from_json``'s), what they hold and send per rank."""
    if isinstance(model, Plan):
        return PlanExplanation((model,))
    if isinstance(model, (list, tuple)):
        if not all(isinstance(p, Plan) for p in model):
            raise TypeError("dynshard.explain takes a compiled model, a Plan or a list of Plans")
        return PlanExplanation(tuple(model))
    module = unwrap_compiled(model)
    parameters, plans = [], []
    for name, tensor in list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers()):
        tag = get_tag(tensor)
        if tag is None:
            parameters.append(ParameterPlacement(name, tuple(tensor.shape), tuple(tensor.shape), "not compiled"))
            continue
        placement = describe_placements(tag.layout, tag.placements) if tag.owner is None else tag.owner.describe()
        if tag.zero is not None:
            placement += ", " + tag.zero.describe()
        parameters.append(ParameterPlacement(name, tuple(tag.global_shape), tuple(tensor.shape), placement))
        for ref in tag.plans:
            plan = ref()
            if plan is not None and all(plan is not p for p in plans):
                plans.append(plan)
    values = tuple(plan.plan for plan in plans if getattr(plan, "plan", None) is not None)
    pipelines = tuple(_pipeline_report(plan) for plan in plans if hasattr(plan, "staged"))
    plans = [plan for plan in plans if not hasattr(plan, "staged")]
    programs = tuple(ProgramReport(
        key=plan.key, inputs=len(plan.inputs), collectives=tuple(plan.program.collectives),
        fallbacks=tuple(plan.propagation.fallbacks.values()) if plan.propagation else (),
        compile_seconds=plan.compile_seconds, cache_hits=plan.hits, saved_bytes=plan.program.saved_bytes,
        saved_count=plan.program.saved_count, compiled_once=tuple(plan.program.outlined),
        seconds_between_calls=plan.seconds_between_calls(), plan=plan.plan, compiled_sizes=plan.compiled_sizes,
        symbolic=plan.program.symbolic)
        for plan in plans)
    return Explanation(tuple(parameters), programs, pipelines, values)


def _pipeline_report(plan) -> PipelineReport:
    staged = plan.staged
    stages = tuple(StageReport(s.index, plan.schedule.ranks_of(s.index), s.modules, staged.flops[s.index],
                               len(staged.boundaries[s.index - 1]) if s.index else 0,
                               plan.compiled[s.index].saved_bytes if s.index in plan.compiled else 0)
                   for s in staged.stages)
    return PipelineReport(
        key=plan.key, schedule=plan.schedule.name, nmicros=plan.nmicros, stages=stages,
        grid=plan.schedule.format(comms=False), p2p_bytes=plan.p2p_bytes(), sent_bytes=plan.last_step.get("sent_bytes", 0),
        idle_fraction=plan.last_step.get("idle_fraction", 0.0), compile_seconds=plan.seconds, cache_hits=plan.hits,
        plan=getattr(plan, "plan", None), trace_dir=plan.config.trace_dir, compiled_shapes=plan.compiled_shapes)
