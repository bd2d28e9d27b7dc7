"""The drawing vocabulary of the plan page: escaped text, SVG shapes with a hover title, the palette, sizes.

Every number a chart draws is also written on its element as ``data-*`` attributes, so that a test (or a
reader with the browser's inspector) reads the exact value behind a bar rather than its pixels.
"""

from __future__ import annotations

import html
import re

# One colour per meaning, the same in every chart.
PLACEMENT_COLOURS = {"R": "#c7ccd6", "S0": "#4e79a7", "S1": "#f28e2b", "S2": "#59a14f", "S3": "#76b7b2",
                     "blocks": "#b07aa1", "P": "#e15759", "stage": "#edc948", "input": "#ffffff"}
MEMORY_COLOURS = {"parameters": "#4e79a7", "buffers": "#76b7b2", "gradients": "#f28e2b", "optimizer": "#e15759",
                  "gathered": "#b07aa1", "activations": "#59a14f", "transient": "#edc948"}
TIME_COLOURS = {"compute": "#4e79a7", "communication": "#f28e2b", "bubble": "#e15759"}
ACTION_COLOURS = {"F": "#4e79a7", "B": "#59a14f", "I": "#8cd17d", "W": "#edc948", "idle": "#f3d6d6",
                  "recv": "#d4a6c8", "send": "#bab0ac"}
COMM_COLOURS = {"tp": "#f28e2b", "dp": "#4e79a7", "pp": "#59a14f", "minimum": "#222222"}


def esc(value: object) -> str:
    return html.escape(str(value), quote=True)


def attrs(**values: object) -> str:
    """`` key="value"`` pairs; ``data_x`` becomes ``data-x``; None values are left out."""
    return "".join(f' {k.rstrip("_").replace("_", "-")}="{esc(v)}"' for k, v in values.items() if v is not None)


def rect(x: float, y: float, w: float, h: float, fill: str, title: str | None = None, cls: str | None = None,
         **data: object) -> str:
    inner = f"<title>{esc(title)}</title>" if title else ""
    return (f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 0):.1f}" height="{h:.1f}" fill="{fill}"'
            f'{attrs(class_=cls, **data)}>{inner}</rect>')


def text(x: float, y: float, value: object, anchor: str = "start", size: int = 11, cls: str | None = None) -> str:
    return f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" font-size="{size}"{attrs(class_=cls)}>' \
           f'{esc(value)}</text>'


def line(x1: float, y1: float, x2: float, y2: float, stroke: str = "#222", dash: str | None = None,
         title: str | None = None, width: float = 1.0) -> str:
    inner = f"<title>{esc(title)}</title>" if title else ""
    return (f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" stroke="{stroke}" '
            f'stroke-width="{width}"{attrs(stroke_dasharray=dash)}>{inner}</line>')


def svg(width: float, height: float, body: list[str], label: str) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
            f'viewBox="0 0 {width:.0f} {height:.0f}" role="img" aria-label="{esc(label)}">' + "".join(body) + "</svg>")


def legend(colours: dict[str, str], names: list[str] | None = None) -> str:
    names = list(colours) if names is None else names
    return '<div class="legend">' + "".join(
        f'<span><i style="background:{colours[n]}"></i>{esc(n)}</span>' for n in names) + "</div>"


def human_bytes(n: float) -> str:
    for unit, size in (("GiB", 1024 ** 3), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def human_seconds(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def placement_colour(tp: str | None) -> str:
    """The colour of a tp placement code (``planning.plan``: "R", "S<d>", "S<d>x<b>", "P<op>"; None: the stage's)."""
    if tp is None:
        return PLACEMENT_COLOURS["stage"]
    if re.fullmatch(r"S\d+x\d+", tp):
        return PLACEMENT_COLOURS["blocks"]
    if tp.startswith("P"):
        return PLACEMENT_COLOURS["P"]
    return PLACEMENT_COLOURS.get(tp, PLACEMENT_COLOURS["S3"])


def describe_tp(tp: str | None, ranks: int) -> str:
    if tp is None:
        return "placed by its stage's tp policy when the stage compiles"
    if tp == "R":
        return "whole on every tp rank" if ranks > 1 else "whole (no tp)"
    blocks = re.fullmatch(r"S(\d+)x(\d+)", tp)
    if blocks:
        return f"a fused tensor of {blocks[2]} blocks, each split along dim {blocks[1]} over {ranks} tp ranks"
    if tp.startswith("S"):
        return f"split along dim {tp[1:]} over {ranks} tp ranks"
    return f"a partial value ({tp[1:]}) to be reduced over {ranks} tp ranks"
