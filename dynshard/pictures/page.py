"""One self-contained HTML page of a job's plans: inline SVG and CSS, no script, no font, no request.

A Content-Security-Policy that allows nothing from anywhere makes the last promise hold in the browser
too. Each plan gets a section: its placements, memory per rank, communication per step, its pipeline
schedule when it has one, and autodist's comparison when autodist chose it; then the text ``explain``
prints, so that every figure on the page can be checked against it.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from ..planning import Plan
from . import choice, communication, memory, placements, schedule
from .communication import Traced
from .memory import Measured
from .svg import esc

CSS = """
body{font:13px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:24px;color:#1d1d1f;max-width:1300px}
h1{font-size:20px;margin:0 0 4px}h2{font-size:17px;margin:32px 0 6px;border-bottom:2px solid #ddd;padding-bottom:3px}
h3{font-size:14px;margin:20px 0 6px}h4{font-size:12px;margin:12px 0 4px;color:#555}
.summary{color:#444}.note{color:#666;font-size:12px}nav a{margin-right:12px}
table.grid{border-collapse:collapse;width:100%}table.grid td,table.grid th{border-bottom:1px solid #eee;padding:3px 6px;
text-align:left;vertical-align:top}table.grid td.name{white-space:nowrap;font-family:ui-monospace,monospace}
tr.boundary td{border-top:3px solid #edc948;background:#fffbea;font-weight:600}
.chip{display:inline-block;margin:1px 3px 1px 0;padding:0 5px;border-radius:3px;font:11px ui-monospace,monospace;
border:2px solid transparent;color:#111}.chip.zero{border-color:#222}.chip.activation{border-radius:9px;border-style:dotted;
border-color:#555}.chip.input{border-color:#aaa}.count{color:#b05;font-weight:600}
.legend{display:inline-block;margin:4px 14px 6px 0;font-size:11px}.legend span{margin-right:10px;white-space:nowrap}
.legend i{display:inline-block;width:11px;height:11px;margin-right:4px;vertical-align:-1px;border:1px solid #999}
table.numbers{border-collapse:collapse;font:11px ui-monospace,monospace}table.numbers td,table.numbers th{
border:1px solid #ddd;padding:2px 6px;text-align:right}table.numbers td:first-child{text-align:left}
svg text{font-family:system-ui,sans-serif;fill:#222}svg text.on-bar{fill:#fff}svg text.chosen{font-weight:700}
pre{background:#f6f6f6;padding:10px;overflow:auto;font-size:11px}
"""
POLICY = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"


@dataclasses.dataclass(frozen=True)
class Section:
    """One plan and what a running job measured of it (all optional)."""
    plan: Plan
    measured: Measured | None = None
    traced: Traced | None = None
    trace_dir: str | None = None


def headline(plan: Plan) -> str:
    mesh, zero = plan.mesh, plan.zero
    level = (f"ZeRO-{zero.level}" + (f" in {zero.ngroups} groups" if zero.ngroups > 1 else "")
             + (" with reduce-scatter" if zero.reduce_scatter else "")) if zero.level else "no ZeRO"
    parts = [f"policy {plan.policy}", f"{mesh.world} ranks = dp {mesh.dp} x pp {mesh.pp} x tp {mesh.tp}", level]
    if plan.recompute:
        parts.append("recompute " + ", ".join(plan.recompute))
    if plan.mixed_precision:
        parts.append("mixed precision " + ", ".join(f"{k} {v}" for k, v in plan.mixed_precision.items()))
    if plan.pipeline is not None:
        p = plan.pipeline
        parts.append(f"pipeline {p.schedule}, {p.nstages} stages, {p.nmicros} micro-batches")
    if plan.made_for is not None:
        parts.append(f"made for graph {plan.made_for.graph}")
    return "; ".join(parts)


def render(sections: Sequence[Section], title: str, limit: int | None = None, text: str = "") -> str:
    """The page. ``limit``: bytes per rank drawn on the memory bars (autodist's ``mem_constraint`` where it
    has one); ``text``: what ``explain`` prints, kept at the end."""
    nav = "".join(f'<a href="#plan{i}">plan {i}: {esc(s.plan.policy)}</a>' for i, s in enumerate(sections))
    body = [f"<h1>{esc(title)}</h1>", f'<p class="summary">{len(sections)} plan(s), one per program Dynamo '
            f"captured; hover any bar or chip for its exact value.</p><nav>{nav}</nav>"]
    for index, section in enumerate(sections):
        body.append(_section(index, section, limit))
    if text:
        body.append(f'<h2 id="text">as dynshard.explain prints it</h2><pre>{esc(text)}</pre>')
    return ('<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            f'<meta http-equiv="Content-Security-Policy" content="{POLICY}">'
            f'<meta name="viewport" content="width=device-width"><title>{esc(title)}</title>'
            f"<style>{CSS}</style></head><body>" + "".join(body) + "</body></html>\n")


def _section(index: int, section: Section, limit: int | None) -> str:
    plan = section.plan
    record = plan.predicted.autodist
    if limit is None and record is not None and record.mem_constraint_gb is not None:
        limit = int(record.mem_constraint_gb * 1024 ** 3)
    parts = [f'<section id="plan{index}" data-plan="{index}"><h2>plan {index}</h2><p class="summary">'
             f"{esc(headline(plan))}</p>",
             "<h3>placements</h3>", placements.render(plan),
             "<h3>memory per rank</h3>", memory.render(plan, limit, section.measured),
             "<h3>communication per step</h3>", communication.render(plan, section.traced)]
    if plan.pipeline is not None:
        parts += ["<h3>pipeline schedule</h3>", schedule.render_simulated(plan)]
        if section.trace_dir:
            parts.append(schedule.render_measured(section.trace_dir))
    if record:
        step = section.measured.step_seconds if section.measured is not None else None
        parts += ["<h3>autodist: why this plan</h3>", choice.render(plan, step)]
    return "".join(parts) + "</section>"
