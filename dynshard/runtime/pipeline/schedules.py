"""Pipeline schedules as data: per-rank action lists, with the point-to-point messages written in.

A schedule says, for each pipeline rank, which stage computes what for which micro-batch, and when
activations and gradients cross ranks. It is built here once, in pure Python, and checked by
:mod:`.simulate` before anyone runs it, so a bad plan fails at plan time with a message instead of hanging
in ``irecv``. The executor only walks the lists. The vocabulary is torch's ``_Action`` IR
(``torch.distributed.pipelining.schedules``) so that printouts read like torch's: ``1F3`` is stage 1's
forward of micro-batch 3, ``0SEND_F2`` stage 0 sending its output for micro-batch 2.

The compute orders are generated here rather than imported from torch. torch 2.13's
``Schedule1F1B._get_pipeline_order`` is wrong for the last rank (it skips F0 and invents F<m>; memo 1.7),
and the other generators are private and move between releases. The interleaved order follows the rule
that Megatron, torch's ``ScheduleInterleaved1F1B`` and nnScaler's ``sched_1f1b_interleaved`` share, and a
test compares it with torch's.

Stage placement is torch's "loop" style: stage ``s`` lives on rank ``s % nranks``, so with ``k`` stages
per rank, rank ``r`` holds stages ``r, r + nranks, ..., r + (k-1) nranks``.

Lowering (:func:`_lower`) writes the messages in:
- after the F of stage ``s``, ``SEND_F(s)`` to the rank of ``s+1`` if that is another rank; the consuming
  forward is preceded by ``RECV_F(s+1)`` from the rank of ``s``;
- after the B (or I) of stage ``s > 0``, ``SEND_B(s)`` to the rank of ``s-1`` if that is another rank; the
  consuming backward is preceded by ``RECV_B(s-1)``;
- a neighbour on the same rank gets no message: the executor hands the tensors over locally.

RECVs are posted one compute action early: the receives that compute action ``i+1`` consumes come just
before compute action ``i``. An ``irecv`` posted early lets the transfer overlap compute ``i`` (a gloo send
is a rendezvous and cannot move data before the receive is posted), for one extra receive buffer per
rank. The sends of action ``i-1`` and the receives posted for ``i+1`` end up next to each other, which is
the pair torch's runtime fuses into one batch in steady 1F1B. One exception: the receives of a rank's
first backward are not moved above the forward before it, so every rank's list splits at its first
B/I/W/RECV_B into a forward part that needs nothing from a backward (transparent GPipe runs the two
parts in the autograd forward and in the backward). Within each ordered pair of ranks the generated
schedules also post receives in the order the peer sends (``simulate.fifo_mismatches`` is empty for all
of them), so an executor may use tag-less p2p (NCCL matches per pair in order).

Zero bubble convention (zb1p): every stage has an I (input-grad backward, consumes RECV_B and produces
SEND_B) and a W (weight-grad backward) for every micro-batch, with ``B = I + W`` in cost. Stage 0's I has
no previous stage to send to, so it produces nothing sendable; an executor may run stage 0's I as a no-op
and its W as the full backward, since nothing waits on stage 0's I.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

__all__ = ["Action", "Schedule", "SCHEDULES", "COMPUTE_KINDS", "COMM_KINDS", "build_schedule"]

SCHEDULES = ("gpipe", "1f1b", "1f1b_interleaved", "infer_pipe", "zb1p")   # infer_pipe: forward only
COMPUTE_KINDS = ("F", "B", "I", "W")
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
# schedules that need exactly one stage per rank
_ONE_STAGE_PER_RANK = ("gpipe", "1f1b", "zb1p")


@dataclasses.dataclass(frozen=True)
class Action:
    """One step of one pipeline rank.

    ``stage`` is the stage whose data this is: the sending stage for SEND_F and SEND_B, the receiving
    stage for RECV_F and RECV_B. A message is therefore SEND_F(s) -> RECV_F(s+1), or SEND_B(s) ->
    RECV_B(s-1), for the same micro-batch. ``peer`` is the other pipeline rank (comms only).
    """

    kind: str
    stage: int
    mb: int
    peer: int | None = None

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A lowered pipeline schedule: per pipeline rank, the actions in execution order, comms included."""

    name: str
    nstages: int
    nmicros: int
    nranks: int
    stage_to_rank: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages that ``rank`` holds, in increasing order."""
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

    @property
    def splits_backward(self) -> bool:
        """Whether backwards run as separate input-gradient (I) and weight-gradient (W) actions."""
        return any(a.kind in ("I", "W") for actions in self.actions for a in actions)

    def compute_actions(self, rank: int) -> tuple[Action, ...]:
        """``rank``'s compute actions (F, B, I, W) in order, without the comms."""
        return tuple(a for a in self.actions[rank] if not a.is_comm)

    def format(self, comms: bool = True) -> str:
        """A step per row and a column per rank, as torch's ``_format_pipeline_order``.

        Rows are positions in each rank's list, not time: rank 1's row 3 may run long after rank 0's
        (``simulate`` gives the times). ``comms=False`` leaves the SEND/RECV actions out.
        """
        lists = [self.actions[r] if comms else self.compute_actions(r) for r in range(self.nranks)]
        placement = "  ".join(f"rank {r}: {list(self.stages_of(r))}" for r in range(self.nranks))
        header = (f"{self.name}: {self.nstages} stages on {self.nranks} ranks, {self.nmicros} micro-batches"
                  f" ({placement})")
        cells = [["step"] + [f"rank {r}" for r in range(self.nranks)]]
        for step in range(max((len(a) for a in lists), default=0)):
            cells.append([str(step)] + [str(a[step]) if step < len(a) else "" for a in lists])
        widths = [max(len(row[c]) for row in cells) for c in range(len(cells[0]))]
        lines = [header]
        for row in cells:
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def build_schedule(name: str, nstages: int, nmicros: int, nranks: int) -> Schedule:
    """The schedule ``name`` for ``nstages`` stages on ``nranks`` pipeline ranks and ``nmicros`` micro-batches.

    Raises ValueError for an unknown name or an impossible configuration, saying what to change. The
    result has passed :func:`.simulate.check_deadlock_free`.
    """
    # simulate imports this module for Action and Schedule, so import it here, not at the top
    from .simulate import check_deadlock_free

    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    for label, value in (("nstages", nstages), ("nmicros", nmicros), ("nranks", nranks)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: {label} must be a positive integer, got {value!r}")
    if nstages % nranks:
        raise ValueError(f"{name}: {nstages} stages cannot be spread evenly over {nranks} pipeline ranks; "
                         f"use a multiple of {nranks} stages (each rank holds nstages // nranks of them)")
    nchunks = nstages // nranks
    if name in _ONE_STAGE_PER_RANK and nchunks != 1:
        raise ValueError(f"{name} runs one stage per rank, but got {nstages} stages on {nranks} ranks; "
                         f"use nstages == nranks, or '1f1b_interleaved' for {nchunks} stages per rank")
    if name == "1f1b_interleaved":
        _interleaved_rounds(nranks, nchunks, nmicros)  # validates
    orders = [_GENERATORS[name](rank, nranks, nchunks, nmicros) for rank in range(nranks)]
    stage_to_rank = tuple(s % nranks for s in range(nstages))
    actions = tuple(_lower(order, stage_to_rank) for order in orders)
    schedule = Schedule(name, nstages, nmicros, nranks, stage_to_rank, actions)
    check_deadlock_free(schedule)
    return schedule


# -- compute orders: one list of (kind, stage, mb) per rank --------------------------------------------------
def _gpipe(rank: int, p: int, k: int, m: int) -> list[tuple[str, int, int]]:
    """All forwards (micro-batch 0..m-1), then all backwards in the same order (GPipe, nnScaler, torch)."""
    return [("F", rank, mb) for mb in range(m)] + [("B", rank, mb) for mb in range(m)]


def _infer_pipe(rank: int, p: int, k: int, m: int) -> list[tuple[str, int, int]]:
    """Forwards only (nnScaler's infer_pipe, torch's _ScheduleForwardOnly).

    With k stages per rank (a model placed for 1f1b_interleaved, evaluated without grad), the rank runs
    its first stage for every micro-batch, then its second, and so on (breadth first, as torch's
    LoopedBFS): any m works, and with m >= p no rank waits after the fill.
    """
    return [("F", chunk * p + rank, mb) for chunk in range(k) for mb in range(m)]


def _one_f_one_b(rank: int, p: int, k: int, m: int) -> list[tuple[str, int, int]]:
    """Classic 1F1B (PipeDream-flush): p-1-rank warm-up forwards, then F/B pairs, then the last backwards.

    With m < p the warm-up is capped at m, and the order degenerates to all forwards then all backwards
    on the early ranks, which still runs (torch refuses m < p; nothing here needs that).
    """
    warmup = min(p - 1 - rank, m)
    order = [("F", rank, mb) for mb in range(warmup)]
    for i in range(m - warmup):
        order += [("F", rank, warmup + i), ("B", rank, i)]
    return order + [("B", rank, mb) for mb in range(m - warmup, m)]


def _zb1p(rank: int, p: int, k: int, m: int) -> list[tuple[str, int, int]]:
    """ZB-H1 (Qi et al., arXiv 2401.10241): 1F1B with each backward split into I and W.

    The I passes follow 1F1B exactly, so the critical path along the pipeline only carries F and I.
    Rank r holds back its first r W passes (it does F, I pairs), then does one W after every I, and
    runs the r W passes it owes at the end, where 1F1B's rank r sits idle waiting for the backward to
    drain. This is what torch's ``ScheduleInterleavedZeroBubble`` does with one stage per rank
    (``num_1f1b_microbatches = rank``). With T_F = T_I = T_W the bubble is a third of 1F1B's.
    """
    warmup = min(p - 1 - rank, m)
    order = [("F", rank, mb) for mb in range(warmup)]
    backwards = 0    # I passes emitted so far
    weights = 0      # W passes emitted so far
    for i in range(m):
        if warmup + i < m:
            order.append(("F", rank, warmup + i))
        order.append(("I", rank, i))
        backwards += 1
        if backwards > rank:
            order.append(("W", rank, weights))
            weights += 1
    return order + [("W", rank, mb) for mb in range(weights, m)]


def _interleaved_rounds(p: int, k: int, m: int) -> int:
    """Micro-batches per round of the interleaved schedule (torch's flexible rule), or ValueError.

    Megatron requires m % p == 0. torch relaxes it: rounds = max(1, m // p) and m must be a multiple of
    rounds, so a rank switches chunks every m // rounds micro-batches. Only chunk switches need this, so
    one stage per rank accepts any m.
    """
    rounds = max(1, m // p)
    if k > 1 and m % rounds:
        lower = (m // p) * p
        raise ValueError(
            f"1f1b_interleaved with {k} stages per rank on {p} ranks switches stage every m // rounds "
            f"micro-batches, with rounds = max(1, m // {p}) = {rounds}, so the number of micro-batches "
            f"must be a multiple of {rounds}; got nmicros={m}. Use a multiple of {p} (nmicros={lower} or "
            f"{lower + p}), or nmicros <= {p}")
    return m // rounds


def _one_f_one_b_interleaved(rank: int, p: int, k: int, m: int) -> list[tuple[str, int, int]]:
    """Interleaved 1F1B (Narayanan et al. 2021, arXiv 2104.04473), in Megatron's and torch's form.

    The rank's forwards go through its k chunks in groups of ``n = m // rounds`` micro-batches (chunk 0
    for micro-batches 0..n-1, chunk 1 for the same, ..., then chunk 0 for n..2n-1), the backwards
    through the chunks in reverse. Warm-up = min((k-1)·n + 2·(p-1-rank), k·m) forwards: the last rank
    must run k-1 groups before its last chunk sees micro-batch 0, and each hop back towards rank 0
    costs one forward and one backward of waiting. Then one forward and one backward alternate, then
    the remaining backwards. With k = 1 this is 1F1B with twice the warm-up (what torch's
    Interleaved1F1B does with one stage per rank): same bubble, more activations in flight.
    """
    n = _interleaved_rounds(p, k, m)
    total = k * m
    warmup = min((k - 1) * n + 2 * (p - 1 - rank), total)
    next_mb: dict[tuple[str, int], int] = defaultdict(int)

    def take(kind: str, stage: int) -> tuple[str, int, int]:
        mb = next_mb[kind, stage]
        next_mb[kind, stage] = mb + 1
        return kind, stage, mb

    def forward(step: int) -> tuple[str, int, int]:
        return take("F", ((step // n) % k) * p + rank)

    def backward(step: int) -> tuple[str, int, int]:
        return take("B", (k - 1 - ((step - warmup) // n) % k) * p + rank)

    order = [forward(step) for step in range(warmup)]
    for step in range(warmup, total):
        order += [forward(step), backward(step)]
    return order + [backward(step) for step in range(total, total + warmup)]


_GENERATORS = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "1f1b_interleaved": _one_f_one_b_interleaved,
               "infer_pipe": _infer_pipe, "zb1p": _zb1p}


# -- lowering: write the messages in -------------------------------------------------------------------------
def _comms(kind: str, stage: int, mb: int, stage_to_rank: tuple[int, ...]) -> tuple[list[Action], list[Action]]:
    """(receives before, sends after) the compute action ``kind`` of ``stage`` for ``mb``."""
    rank, last = stage_to_rank[stage], len(stage_to_rank) - 1
    recvs: list[Action] = []
    sends: list[Action] = []
    if kind == "F":
        if stage > 0 and stage_to_rank[stage - 1] != rank:
            recvs.append(Action("RECV_F", stage, mb, stage_to_rank[stage - 1]))
        if stage < last and stage_to_rank[stage + 1] != rank:
            sends.append(Action("SEND_F", stage, mb, stage_to_rank[stage + 1]))
    elif kind in ("B", "I"):
        if stage < last and stage_to_rank[stage + 1] != rank:
            recvs.append(Action("RECV_B", stage, mb, stage_to_rank[stage + 1]))
        if stage > 0 and stage_to_rank[stage - 1] != rank:
            sends.append(Action("SEND_B", stage, mb, stage_to_rank[stage - 1]))
    return recvs, sends


def _lower(order: list[tuple[str, int, int]], stage_to_rank: tuple[int, ...]) -> tuple[Action, ...]:
    """One rank's compute order with its SENDs right after the producer and its RECVs one compute early,
    except those of the first backward (see the module docstring)."""
    comms = [_comms(kind, stage, mb, stage_to_rank) for kind, stage, mb in order]
    first_backward = next((i for i, (kind, _, _) in enumerate(order) if kind in ("B", "I")), len(order))
    out: list[Action] = list(comms[0][0]) if comms else []
    for i, (kind, stage, mb) in enumerate(order):
        early = i + 1 < len(order) and i + 1 != first_backward
        if early:
            out += comms[i + 1][0]
        out.append(Action(kind, stage, mb))
        out += comms[i][1]
        if i + 1 == first_backward < len(order):
            out += comms[i + 1][0]
    return tuple(out)
