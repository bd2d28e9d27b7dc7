"""autodist's choice against the hand plans: predicted step seconds (compute, communication, bubble) and
peak bytes per rank, under the same cost model, with the budget and the solver's gap.

The numbers are the plan's own record (``Plan.predicted.autodist``, what ``explain`` prints).
"""

from __future__ import annotations

import dataclasses

from ..planning import Plan
from .svg import MEMORY_COLOURS, TIME_COLOURS, esc, human_bytes, human_seconds, legend, line, rect, svg, text

LABEL, WIDTH, BAR, GAP = 330, 300, 16, 6


@dataclasses.dataclass(frozen=True)
class Bar:
    """One plan's row: its step, by part where the record splits it, and its peak per rank."""

    plan: str
    step_seconds: float
    compute_seconds: float | None = None        # (None: a plan recorded before the split was kept)
    communication_seconds: float | None = None
    bubble_seconds: float | None = None
    peak_bytes: int | None = None               # None: a measured step (no peak on this page's CPU)
    fits: bool = True
    measured_seconds: float | None = None       # a running job's step, drawn under its prediction

    def parts(self) -> tuple[tuple[str, float | None], ...]:
        return (("compute", self.compute_seconds), ("communication", self.communication_seconds),
                ("bubble", self.bubble_seconds))


def rows_of(plan: Plan) -> list[Bar]:
    """The chosen plan first, then every hand plan by predicted step."""
    p, record = plan.predicted.cost, plan.predicted.autodist
    chosen = Bar(f"chosen: {record.chosen}", p.step_seconds, p.compute_seconds, p.communication_seconds,
                 p.bubble_seconds, p.bytes_per_rank.peak)
    return [chosen] + [Bar(c.plan, c.step_seconds, c.compute_seconds, c.communication_seconds, c.bubble_seconds,
                           c.peak_bytes, c.fits) for c in record.candidates]


def render(plan: Plan, measured_step: float | None = None) -> str:
    """``measured_step``: the chosen plan's step as a running job measured it, drawn under its prediction."""
    record = plan.predicted.autodist
    rows = rows_of(plan)
    if measured_step is not None:
        rows.insert(1, Bar(f"measured: {record.chosen}", measured_step, measured_seconds=measured_step))
    budget = record.mem_constraint_gb
    limit = None if budget is None else budget * 1024 ** 3
    slowest = max(r.step_seconds for r in rows) * 1.1 or 1
    largest = max([r.peak_bytes or 0 for r in rows] + [limit or 0]) * 1.1 or 1
    body, y = [text(LABEL, 10, "predicted step", size=10), text(LABEL + WIDTH + 90, 10, "predicted peak per rank", size=10)], 16
    right = LABEL + WIDTH + 90
    for row in rows:
        name = row.plan + ("" if row.fits else " (over the budget)")
        body.append(text(LABEL - 8, y + BAR - 4, name if len(name) < 52 else name[:50] + "..", anchor="end", size=10,
                         cls="chosen" if row is rows[0] else None))
        x = LABEL
        if row.measured_seconds is not None:
            body.append(rect(x, y, row.measured_seconds / slowest * WIDTH, BAR, "#333",
                             f"{name}\nmeasured: {row.measured_seconds:.6g} s a step (median of the latest calls)",
                             cls="measured", data_seconds=f"{row.measured_seconds:.6g}"))
        for part, seconds in row.parts():
            if seconds is None:
                continue
            body.append(rect(x, y, seconds / slowest * WIDTH, BAR, TIME_COLOURS[part], f"{name}\n{part}: {seconds:.6g} s",
                             cls="time", data_plan=row.plan, data_part=part, data_seconds=f"{seconds:.6g}"))
            x += seconds / slowest * WIDTH
        body.append(text(LABEL + row.step_seconds / slowest * WIDTH + 4, y + BAR - 4,
                         human_seconds(row.step_seconds), size=10))
        if row.peak_bytes is None:      # measured: no peak on this page's CPU
            y += BAR + GAP
            continue
        colour = MEMORY_COLOURS["parameters"] if row.fits else "#bbb"
        body.append(rect(right, y, row.peak_bytes / largest * 200, BAR, colour,
                         f"{name}\npeak {row.peak_bytes} bytes per rank", cls="peak", data_plan=row.plan,
                         data_bytes=row.peak_bytes))
        body.append(text(right + row.peak_bytes / largest * 200 + 4, y + BAR - 4, human_bytes(row.peak_bytes), size=10))
        y += BAR + GAP
    if limit:
        x = right + limit / largest * 200
        body.append(line(x, 12, x, y, "#d00", dash="5,3", title=f"mem_constraint {budget} GB"))
    gap = record.gap
    head = (f'<p>autodist chose <b>{esc(record.chosen)}</b>: {esc(record.solver)}, {record.ilps} ILPs, '
            f'{esc(record.status)} (objective {record.objective:.6g} s, bound {record.bound:.6g} s, '
            f'gap <b data-gap="{gap}">{gap:.2%}</b>); device profile {esc(record.device_profile.name)}'
            + (f"; mem_constraint {budget} GB" if budget is not None else "") + ". The hand plans are priced by the "
            "same cost model; hover a bar for its figure.</p>")
    return head + legend({**TIME_COLOURS, "measured": "#333"}) + svg(right + 300, y + 6, body, "autodist: the chosen plan against the hand plans")
