"""Communication per step: bytes by collective kind and mesh dimension, per layer, against the minimum.

The collectives are ``planning.costs.step_collectives`` (what ``explain`` prints: payload bytes, what each
rank puts in). Charts draw bytes on the wire per rank as a ring moves them, so that kinds compare:
an all-reduce of S moves 2(n-1)/n S, a reduce-scatter of S (n-1)/n S, an all-gather of a shard s (n-1) s.

The analytic minimum, per mesh dimension:
- dp: one all-reduce of every trainable parameter's gradient, 2(n-1)/n P (ZeRO-1/2's reduce-scatter plus
  all-gather move the same; ZeRO-3 gathers once more, 3(n-1)/n P), P the bytes of a rank's parameters
  before ZeRO;
- tp: Megatron's 2 all-reduces of a layer's hidden state in the forward and 2 in the backward, per
  numbered layer that communicates (the hidden state's bytes: the smallest all-reduce or reduce-scatter
  the plan issues in that layer); collectives outside numbered layers (embeddings, the loss) have none;
- pp: the boundary activations sent forward and their gradients sent back, each once per micro-batch,
  which is what the executor sends (known from a running job).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

from ..planning import Plan
from ..planning.costs import group_of, step_collectives, tensor_collectives, whole_bytes
from .placements import block_of, module_block, rows_of
from .svg import COMM_COLOURS, esc, human_bytes, legend, line, rect, svg, text

LABEL, WIDTH, BAR, GAP = 300, 520, 16, 6


@dataclasses.dataclass(frozen=True)
class Traced:
    """Collectives as a running job traced them on this rank (payload bytes per step), and its pipeline p2p."""
    payload: tuple[tuple[str, str, int, int], ...] = ()      # (kind, group, count, bytes)
    p2p_minimum: int | None = None
    p2p_sent: int | None = None


def wire_bytes(kind: str, payload: float, n: int) -> float:
    if n <= 1:
        return 0.0
    return {"all_reduce": 2 * (n - 1) / n * payload, "reduce_scatter": (n - 1) / n * payload,
            "all_gather": (n - 1) * payload, "all_to_all": (n - 1) / n * payload}.get(kind, payload)


def dp_minimum(plan: Plan) -> float:
    n = plan.mesh.dp
    whole = sum(whole_bytes(plan, t) for t in plan.tensors.values() if t.kind == "parameter")
    return (3 if plan.zero.level == 3 else 2) * (n - 1) / n * whole if n > 1 else 0.0


def tp_by_block(plan: Plan) -> dict[str, tuple[float, float]]:
    """Per block, per step: (wire bytes of its forward tp collectives and their backward mirrors; Megatron's
    minimum)."""
    found: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for c in plan.predicted.collectives:
        if c.dim == "tp":
            path = re.sub(r"^\d+/", "", c.at.rsplit(":", 2)[0])     # a pipeline's keys start with their stage
            found[module_block(path)[0]].append((c.kind, c.bytes, 2 if c.mirrored else 1))
    result = {}
    n, micro_batches = plan.mesh.tp, plan.pipeline.nmicros if plan.pipeline is not None else 1
    for block, collectives in found.items():
        wire = micro_batches * sum(times * wire_bytes(kind, size, n) for kind, size, times in collectives)
        hidden = [size for kind, size, _ in collectives if kind in ("all_reduce", "reduce_scatter")]
        numbered = block.rsplit(".", 1)[-1].isdigit()
        minimum = 4 * micro_batches * wire_bytes("all_reduce", min(hidden), n) if hidden and numbered else math.nan
        result[block] = (wire, minimum)
    return result


def render(plan: Plan, traced: Traced | None = None) -> str:
    collectives = step_collectives(plan)
    if not collectives and not (traced and traced.p2p_minimum):
        return '<p class="note">No collectives: one rank, or nothing to share.</p>'
    body, y = [], 8
    rows = [(f"{c.kind} over {c.dim}: {c.what}", c.dim, wire_bytes(c.kind, c.bytes, group_of(plan, c.dim, c.what)), c)
            for c in collectives]
    per_dim: dict[str, float] = defaultdict(float)
    for _, dim, wire, c in rows:      # tp: the forward's collectives and their mirror in the backward
        per_dim[dim] += 2 * wire if c.what == "forward activations (tp)" else wire
    blocks = tp_by_block(plan)
    minimum = {"dp": dp_minimum(plan), "tp": sum(m for _, m in blocks.values() if not math.isnan(m))}
    totals = [(f"{dim} in all" + (", forward and backward" if dim == "tp" else ""), dim, wire, minimum.get(dim))
              for dim, wire in sorted(per_dim.items())]
    if traced is not None and traced.p2p_minimum:     # the executor sends each boundary tensor once: the minimum
        totals.append(("pp p2p, a unit's ranks together", "pp", float(traced.p2p_minimum), None))
    top = max([w for *_, w, _ in rows] + [w for *_, w, _m in totals] + [m or 0 for *_, m in totals] + [1]) * 1.1
    scale = WIDTH / top
    for label, dim, wire, c in rows:
        body.append(text(LABEL - 8, y + BAR - 4, label if len(label) < 50 else label[:48] + "..", anchor="end", size=10))
        body.append(rect(LABEL, y, wire * scale, BAR, COMM_COLOURS.get(dim, "#888"),
                         f"{label}\n{c.count} per step, payload {c.bytes} bytes, on the wire {wire:.0f} bytes",
                         cls="collective", data_kind=c.kind, data_dim=dim, data_count=c.count, data_bytes=c.bytes,
                         data_wire=round(wire)))
        body.append(text(LABEL + wire * scale + 4, y + BAR - 4, human_bytes(wire), size=10))
        y += BAR + GAP
    y += 8
    for label, dim, wire, least in totals:
        body.append(text(LABEL - 8, y + BAR - 4, label, anchor="end", size=10))
        body.append(rect(LABEL, y, wire * scale, BAR, COMM_COLOURS.get(dim, "#888"), f"{label}: {wire:.0f} bytes",
                         cls="total", data_dim=dim, data_wire=round(wire),
                         data_minimum=None if least is None else round(least)))
        minimum_of = {"tp": "Megatron's per-layer minimum", "dp": "the data-parallel minimum"}.get(dim, "the minimum")
        ratio = f" ({wire / least:.2f}x {minimum_of})" if least else ""
        body.append(text(LABEL + wire * scale + 4, y + BAR - 4, human_bytes(wire) + ratio, size=10))
        if least:
            x = LABEL + least * scale
            body.append(line(x, y - 3, x, y + BAR + 3, COMM_COLOURS["minimum"], width=3,
                             title=f"analytic minimum: {least:.0f} bytes"))
        y += BAR + GAP
    chart = svg(LABEL + WIDTH + 160, y + 6, body, "communication per step")
    key = legend({"tp": COMM_COLOURS["tp"], "dp": COMM_COLOURS["dp"], "pp": COMM_COLOURS["pp"],
                  "analytic minimum": COMM_COLOURS["minimum"]})
    sent = "" if traced is None or traced.p2p_sent is None else (
        f'<p class="note">pp: activations forward and their gradients back, each boundary tensor sent once per '
        f'micro-batch; this rank sent <b data-sent="{traced.p2p_sent}">{traced.p2p_sent}</b> bytes in its latest step.</p>')
    return key + chart + sent + _per_layer(plan, blocks) + _traced_table(traced)


def _per_layer(plan: Plan, blocks: dict[str, tuple[float, float]]) -> str:
    """Per folded row of the placement grid: one layer's tp and dp wire bytes per step."""
    dp: dict[str, float] = defaultdict(float)
    for name, tensor in plan.tensors.items():
        for kind, dim, size, what in tensor_collectives(plan, tensor):
            dp[block_of(name)[0]] += wire_bytes(kind, size, group_of(plan, dim, what))
    rows = [(row.label, len(row.blocks), blocks.get(row.blocks[0], (0.0, math.nan)), dp.get(row.blocks[0], 0.0))
            for row in rows_of(plan) if row.blocks[0] in blocks or row.blocks[0] in dp]
    if not rows:
        return ""
    top = max(tp + d for _, _, (tp, _), d in rows) * 1.1 or 1
    scale, body, y = WIDTH / top, [], 8
    for label, count, (tp, least), d in rows:
        name = f"{label} (each of {count})" if count > 1 else label
        body.append(text(LABEL - 8, y + BAR - 4, name, anchor="end", size=10))
        body.append(rect(LABEL, y, tp * scale, BAR, COMM_COLOURS["tp"], f"{name}: tp {tp:.0f} bytes on the wire "
                         "(forward collectives, mirrored in the backward)", cls="layer", data_block=label,
                         data_dim="tp", data_wire=round(tp)))
        body.append(rect(LABEL + tp * scale, y, d * scale, BAR, COMM_COLOURS["dp"], f"{name}: dp {d:.0f} bytes on the wire",
                         cls="layer", data_block=label, data_dim="dp", data_wire=round(d)))
        if not math.isnan(least):
            x = LABEL + least * scale
            body.append(line(x, y - 3, x, y + BAR + 3, COMM_COLOURS["minimum"], width=3,
                             title=f"Megatron's minimum for a layer: 2 + 2 all-reduces of its hidden state, {least:.0f} bytes"))
        body.append(text(LABEL + (tp + d) * scale + 4, y + BAR - 4, human_bytes(tp + d), size=10))
        y += BAR + GAP
    return "<h4>per layer, per step (one layer of a folded row)</h4>" + svg(LABEL + WIDTH + 100, y + 4, body,
                                                                              "communication per layer")


def _traced_table(traced: Traced | None) -> str:
    if traced is None or not traced.payload:
        return ""
    rows = "".join(f"<tr><td>{esc(kind)}</td><td>{esc(group)}</td><td>{count}</td><td>{size}</td></tr>"
                   for kind, group, count, size in traced.payload)
    return ('<h4>as traced on this rank (payload bytes per call of each program, before Inductor buckets '
            'independent all-reduces)</h4><table class="numbers"><tr><th>collective</th><th>group</th><th>count</th>'
            f"<th>bytes</th></tr>{rows}</table>")
