"""The pipeline schedule as a Gantt chart, a row per pipeline rank: forward, backward, input- and
weight-gradient actions, and idle time between them.

The simulated chart runs the plan's schedule through the executor's own simulator
(``runtime.pipeline.simulate``) with unit costs: a forward 1, a backward 2 (a split one 1 + 1). The
measured chart reads the Chrome traces a job writes with ``Config.trace_dir`` (one file per rank) and
draws each rank's latest step in milliseconds.
"""

from __future__ import annotations

import glob
import json
import os

from ..planning import Plan
from ..runtime.pipeline.schedules import build_schedule
from ..runtime.pipeline.simulate import simulate
from .svg import ACTION_COLOURS, esc, legend, rect, svg, text

LABEL, WIDTH, ROW, GAP = 130, 860, 20, 6


def simulated(plan: Plan):
    p = plan.pipeline
    first = p.schedule == "1f1b_plus"
    schedule = build_schedule(p.schedule, p.nstages + int(first), p.nmicros, plan.mesh.pp, first)
    return schedule, simulate(schedule, f=1.0, b=2.0, w=1.0)


def _chart(rows: list[tuple[str, list[tuple[float, float, str, str]]]], span: float, unit: str, label: str) -> str:
    """``rows``: (rank label, [(start, end, colour key, name)]) drawn on one time axis of length ``span``."""
    scale = WIDTH / (span or 1)
    body, y = [], 18
    for tick in range(11):
        x = LABEL + tick * WIDTH / 10
        body.append(f'<line x1="{x:.1f}" y1="12" x2="{x:.1f}" y2="{14 + len(rows) * (ROW + GAP):.1f}" stroke="#eee"/>')
        body.append(text(x, 10, f"{span * tick / 10:.3g}{unit}", anchor="middle", size=9))
    for name, spans in rows:
        body.append(text(LABEL - 8, y + ROW - 6, name, anchor="end"))
        body.append(rect(LABEL, y, span * scale, ROW, ACTION_COLOURS["idle"], f"{name}: idle", cls="idle-lane"))
        for start, end, key, action in spans:
            body.append(rect(LABEL + start * scale, y, (end - start) * scale, ROW, ACTION_COLOURS.get(key, "#888"),
                             f"{name}: {action}, {start:.4g}-{end:.4g}{unit}", cls="action", data_kind=key,
                             data_action=action, data_start=f"{start:.6g}", data_end=f"{end:.6g}"))
            if (end - start) * scale > 22:
                body.append(text(LABEL + (start + end) / 2 * scale, y + ROW - 6, action, anchor="middle", size=9,
                                 cls="on-bar"))
        y += ROW + GAP
    return svg(LABEL + WIDTH + 20, y + 4, body, label)


def render_simulated(plan: Plan) -> str:
    schedule, result = simulated(plan)
    rows = [(f"pipeline rank {rank}", [(s, e, a.kind, str(a)) for s, e, a in timeline])
            for rank, timeline in enumerate(result.timeline)]
    idle = ", ".join(f"rank {r} {i / result.makespan:.0%}" for r, i in enumerate(result.idle)) if result.makespan else ""
    head = (f'<p>{esc(schedule.name)}: {schedule.nstages} stages on {schedule.nranks} pipeline ranks, '
            f'{schedule.nmicros} micro-batches; simulated with unit costs (forward 1, backward 2, split backward 1 + 1): '
            f'makespan <b data-makespan="{result.makespan:.6g}">{result.makespan:.4g}</b>, bubble '
            f'<b data-bubble="{result.bubble_fraction:.6g}">{result.bubble_fraction:.1%}</b>; idle {esc(idle)}. '
            'An action reads <i>stage</i>, kind, <i>micro-batch</i>: 1F3 is stage 1\'s forward of micro-batch 3.</p>')
    keys = legend(ACTION_COLOURS, ["F", "B", "I", "W", "idle"])
    return head + keys + _chart(rows, result.makespan, "", "pipeline schedule, simulated")


def read_traces(directory: str) -> list[tuple[int, float, list[tuple[float, float, str, str]]]]:
    """Each rank's latest complete step in ``directory``'s traces: (rank, step ms, [(start, end, kind, name)])."""
    found = []
    for path in sorted(glob.glob(os.path.join(directory, "dynshard_trace_rank*.json"))):
        try:
            with open(path) as f:
                events = json.load(f)["traceEvents"]
        except (OSError, ValueError, KeyError):
            continue
        steps = [e for e in events if e.get("cat") == "step"]
        if not steps:
            continue
        step = steps[-1]
        begin, end = step["ts"], step["ts"] + step["dur"]
        spans = [((e["ts"] - begin) / 1e3, (e["ts"] + e["dur"] - begin) / 1e3, _kind(e), e["name"]) for e in events
                 if e.get("cat") != "step" and begin <= e["ts"] <= end]
        found.append((step["pid"], step["dur"] / 1e3, spans))
    return sorted(found)


def _kind(event: dict) -> str:
    if event["cat"] == "forward":
        return "F"
    if event["cat"] == "backward":
        name = event["name"].lstrip("0123456789")
        return name[:1] if name[:1] in ("B", "I", "W") else "B"
    return event["cat"]


def render_measured(directory: str) -> str:
    traces = read_traces(directory)
    if not traces:
        return f'<p class="note">No trace in {esc(directory)} yet (a pipeline job writes one per rank with trace_dir).</p>'
    span = max(ms for _, ms, _ in traces)
    rows = [(f"rank {rank}", spans) for rank, _, spans in traces]
    head = (f"<p>Measured: each rank's latest step from the traces in {esc(directory)}, in milliseconds "
            "(waits for receives and sends drawn in their own colours).</p>")
    return head + legend(ACTION_COLOURS, ["F", "B", "I", "W", "recv", "send", "idle"]) + _chart(
        rows, span, "ms", "pipeline schedule, measured")
