"""The placement grid: a row per module block, a chip per parameter, buffer, input and placed activation.

A block is a module path up to its first numeric part (``layers.3``), so that a transformer's layers are
rows; equal consecutive rows (same chips, same placements, same stage) fold into one with a count
(``layers.0-31 x32``). Outside numbered containers a row is the module that holds the tensor. A chip's
colour is its tp placement, a thick dark edge marks ZeRO rows over the data-parallel ranks, and its hover
title says the exact placement. With a pipeline, each row names its stage and a rule marks where a stage
starts.
"""

from __future__ import annotations

import dataclasses
import re

from ..planning import Plan
from .svg import PLACEMENT_COLOURS, describe_tp, esc, legend, placement_colour

_NUMBERED = re.compile(r"^(.*?\.?\d+)(?:\.|$)")


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str                       # the tensor's or activation's name inside its block
    kind: str                       # "parameter", "buffer", "input" or "activation"
    tp: str | None
    dp: str
    detail: str                     # shape and dtype, or the activation's readers


@dataclasses.dataclass(frozen=True)
class Row:
    blocks: tuple[str, ...]         # the folded blocks, in order ("layers.0", "layers.1", ...)
    stage: int | None
    chips: tuple[Chip, ...]

    @property
    def label(self) -> str:
        if len(self.blocks) == 1:
            return self.blocks[0]
        first, last = self.blocks[0], self.blocks[-1]
        head = first.rsplit(".", 1)[0] + "." if "." in first else ""
        return f"{first}-{last[len(head):]}" if last.startswith(head) else f"{first} .. {last}"


def block_of(path: str) -> tuple[str, str]:
    """(block, name inside it) of a dotted path: split after the first numeric part, else at the last dot."""
    match = _NUMBERED.match(path)
    if match and re.search(r"(^|\.)\d+$", match[1]):
        return match[1], path[len(match[1]):].lstrip(".")
    return (path.rsplit(".", 1)[0], path.rsplit(".", 1)[1]) if "." in path else ("(model)", path)


def module_block(path: str) -> tuple[str, str]:
    """(block, path inside it) of a module: an unnumbered module is its own row, beside its parameters."""
    return block_of(path) if re.search(r"(^|\.)\d+(\.|$)", path) else (path or "(model)", "")


def rows_of(plan: Plan) -> list[Row]:
    """The plan's blocks in model order (first tensor or activation seen), equal neighbours folded."""
    chips: dict[str, list[Chip]] = {}
    stages: dict[str, set[int]] = {}
    for name, t in plan.tensors.items():
        block, inner = ("inputs", name) if t.kind == "input" else block_of(name)
        detail = f"{list(t.shape)} {t.dtype}" + (f", read by stages {list(t.stages)}" if t.stages else "")
        chips.setdefault(block, []).append(Chip(inner, t.kind, t.tp, t.dp, detail))
        if t.stages and t.kind != "input":
            stages.setdefault(block, set()).update(t.stages)
    for key, a in plan.activations.items():
        path, op, occurrence = key.rsplit(":", 2)
        block, inner = module_block(re.sub(r"^\d+/", "", path))     # (a pipeline's keys start with their stage)
        readers = "every reader" if a.readers is None else "readers " + ", ".join(a.readers)
        chips.setdefault(block, []).append(Chip(f"{inner + ':' if inner else ''}{op}:{occurrence}", "activation",
                                                a.tp, "-", readers))
    rows = [Row((block,), min(stages[block]) if block in stages else None, tuple(c)) for block, c in chips.items()]
    folded: list[Row] = []
    for row in rows:
        last = folded[-1] if folded else None
        if last is not None and _same_kind(last.blocks[-1], row.blocks[0]) and last.chips == row.chips \
                and last.stage == row.stage:
            folded[-1] = dataclasses.replace(last, blocks=last.blocks + row.blocks)
        else:
            folded.append(row)
    return folded


def _same_kind(a: str, b: str) -> bool:
    return re.sub(r"\d+$", "#", a) == re.sub(r"\d+$", "#", b) and a != b


def chip_title(row: Row, chip: Chip, plan: Plan) -> str:
    where = f"{row.label} (x{len(row.blocks)})" if len(row.blocks) > 1 else row.label
    dp = {"zero": f"ZeRO-{plan.zero.level} rows over {plan.mesh.dp // plan.zero.ngroups} data-parallel ranks",
          "replicate": f"replicated over {plan.mesh.dp} data-parallel ranks" if plan.mesh.dp > 1 else "",
          "batch": "its batch split over the data-parallel ranks" if plan.mesh.dp > 1 else "", "-": ""}[chip.dp]
    parts = [f"{where} / {chip.name}", f"{chip.kind}: {chip.detail}", f"tp {chip.tp}: {describe_tp(chip.tp, plan.mesh.tp)}"]
    return "\n".join(parts + ([f"dp: {dp}"] if dp else []))


def render(plan: Plan) -> str:
    rows = rows_of(plan)
    starts = plan.pipeline.starts if plan.pipeline is not None else ()
    out = ['<table class="grid"><thead><tr><th>module block</th><th>stage</th><th>parameters, buffers, '
           'inputs and placed activations</th></tr></thead><tbody>']
    previous = None
    for row in rows:
        if plan.pipeline is not None and row.stage is not None and previous is not None and row.stage != previous:
            start = starts[row.stage - 1] if 0 < row.stage <= len(starts) else "?"
            out.append(f'<tr class="boundary"><td colspan="3">stage {row.stage} starts at {esc(start)}</td></tr>')
        previous = row.stage if row.stage is not None else previous
        count = f' <span class="count">x{len(row.blocks)}</span>' if len(row.blocks) > 1 else ""
        cells = "".join(
            f'<span class="chip {c.kind}{" zero" if c.dp == "zero" else ""}" style="background:{placement_colour(c.tp)}" '
            f'title="{esc(chip_title(row, c, plan))}" data-tensor="{esc(c.name)}" data-tp="{esc(c.tp)}" '
            f'data-dp="{esc(c.dp)}">{esc(c.name)}</span>' for c in row.chips)
        stage = "-" if row.stage is None else str(row.stage)
        out.append(f'<tr data-block="{esc(row.label)}" data-count="{len(row.blocks)}"><td class="name">'
                   f'{esc(row.label)}{count}</td><td>{stage}</td><td>{cells}</td></tr>')
    out.append("</tbody></table>")
    names = {"R": "replicated", "S0": "split dim 0", "S1": "split dim 1", "S2": "split dim 2",
             "blocks": "fused, split per block", "P": "partial", "stage": "placed per stage"}
    key = legend({names[k]: v for k, v in PLACEMENT_COLOURS.items() if k in names})
    zero = '<span class="legend"><span class="chip zero" style="background:#fff">name</span> ZeRO rows over dp</span>'
    return key + zero + "".join(out)
