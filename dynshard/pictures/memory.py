"""Memory per rank: a stacked bar per group of identical ranks, against the device limit or ``mem_constraint``.

At rest the bars are ``planning.costs.memory_at_rest`` (what ``explain`` prints); during the step they
add what a policy predicted (``Plan.predicted.cost.bytes_per_rank``: gathered ZeRO-3 replicas, activations
kept for the backward, transient buffers). From a running job a second bar shows this rank as measured.
"""

from __future__ import annotations

import dataclasses

from ..planning import Plan
from ..planning.costs import memory_at_rest
from .svg import MEMORY_COLOURS, esc, human_bytes, legend, line, rect, svg, text

PARTS = ("parameters", "buffers", "gradients", "optimizer", "gathered", "activations", "transient")
LABEL, WIDTH, BAR, GAP = 300, 560, 18, 8


@dataclasses.dataclass(frozen=True)
class Measured:
    """This rank, as a running job measured it (each None when not measured)."""
    parameters: int | None = None
    buffers: int | None = None
    activations: int | None = None      # saved for the backward by the compiled programs, as traced
    peak: int | None = None             # the device allocator's peak (CUDA only)
    activations_per: str = "step"       # what the activations figure is of: "step", or "micro-batch" (pipelines)
    step_seconds: float | None = None   # a training step's wall time (the median of the latest calls)


def bars_of(plan: Plan) -> list[tuple[str, dict[str, int]]]:
    """(label, bytes by part) per bar: the plan's ranks at rest, extended by its predictions."""
    bars = []
    cost = plan.predicted.cost
    predicted = None if cost is None else cost.bytes_per_rank
    for row in memory_at_rest(plan):
        parts = {"parameters": row.parameters, "buffers": row.buffers, "gradients": row.gradients,
                 "optimizer": row.optimizer}
        label = row.ranks + ("" if row.exact else " (stage tensors counted whole)")
        if predicted is not None and plan.pipeline is None:
            parts.update({k: getattr(predicted, k) for k in ("gathered", "activations", "transient")})
            label += ", during the step (predicted)"
        else:
            label += ", at rest"
        bars.append((label, parts))
    if predicted is not None and plan.pipeline is not None:
        bars.append(("busiest pipeline rank, during the step (predicted)", {k: getattr(predicted, k) for k in PARTS}))
    return bars


def render(plan: Plan, limit: int | None, measured: Measured | None = None) -> str:
    bars = bars_of(plan)
    if measured is not None:
        parts = {"parameters": measured.parameters, "buffers": measured.buffers, "activations": measured.activations}
        bars.append((f"this rank, measured (parameters and buffers held; activations saved per "
                     f"{measured.activations_per}, as traced)",
                     {k: v for k, v in parts.items() if v is not None}))
    totals = [sum(parts.values()) for _, parts in bars]
    top = max(totals + [limit or 0, (measured.peak or 0) if measured else 0, 1]) * 1.08
    scale = WIDTH / top
    body, y = [], 10
    for (label, parts), total in zip(bars, totals):
        body.append(text(LABEL - 8, y + BAR - 5, label if len(label) < 48 else label[:46] + "..", anchor="end"))
        x = LABEL
        for name in PARTS:
            value = parts.get(name)
            if not value:
                continue
            body.append(rect(x, y, value * scale, BAR, MEMORY_COLOURS[name],
                             f"{label}\n{name}: {value} bytes ({human_bytes(value)})", cls="part",
                             data_part=name, data_bytes=value, data_bar=label))
            x += value * scale
        body.append(text(x + 4, y + BAR - 5, human_bytes(total), size=10))
        y += BAR + GAP
    if measured is not None and measured.peak:
        x = LABEL + measured.peak * scale
        body.append(line(x, y - BAR - GAP - 2, x, y - GAP + 2, "#000", width=3,
                         title=f"this rank's peak allocated: {measured.peak} bytes"))
    if limit:
        x = LABEL + limit * scale
        body.append(line(x, 4, x, y, "#d00", dash="5,3", title=f"limit: {limit} bytes ({human_bytes(limit)})"))
        body.append(text(x, y + 12, f"limit {human_bytes(limit)}", anchor="middle", size=10))
    chart = svg(LABEL + WIDTH + 80, y + 18, body, "memory per rank")
    note = "" if plan.predicted.cost is not None else (
        '<p class="note">This plan carries no prediction, so its bars are what it holds at rest (Adam\'s two fp32 '
        "moments per element as optimizer state). Activations and transient buffers are predicted by autodist, "
        "and for any policy by dynshard.plan(..., device_profile=\"cpu\" or \"cuda\").</p>")
    return legend(MEMORY_COLOURS) + chart + note + _table(bars, totals)


def _table(bars, totals) -> str:
    head = "".join(f"<th>{p}</th>" for p in PARTS)
    rows = "".join(f"<tr><td>{esc(label)}</td>" + "".join(f"<td>{parts.get(p, '')}</td>" for p in PARTS)
                   + f"<td>{total}</td></tr>" for (label, parts), total in zip(bars, totals))
    return f'<details><summary>bytes</summary><table class="numbers"><tr><th>ranks</th>{head}<th>total</th></tr>' \
           f"{rows}</table></details>"
