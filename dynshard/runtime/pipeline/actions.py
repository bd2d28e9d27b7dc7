"""A pipeline schedule as data: :class:`Action` (one step of one pipeline rank) and :class:`Schedule` (every
rank's actions in order, comms included).

The vocabulary :mod:`.schedules` (which builds schedules) and :mod:`.simulate` (which checks and times
them) share. :mod:`.schedules` imports :mod:`.simulate` to check what it builds, and :mod:`.simulate` needs
only these types, so the imports run one way. :mod:`.schedules` re-exports these names.
"""

from __future__ import annotations

import dataclasses

__all__ = ["ALL", "Action", "Schedule", "COMPUTE_KINDS", "COMM_KINDS"]

COMPUTE_KINDS = ("F", "B", "I", "W")
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B", "BCAST_B")
ALL = -1          # in a lane: the stage runs on every rank (1f1b_plus's all-device segment)


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
    lanes: tuple[tuple[int, ...], ...]        # per lane, the rank of each stage; micro-batch mb takes lane mb % n
    actions: tuple[tuple[Action, ...], ...]

    def rank_of(self, stage: int, mb: int) -> int:
        """The rank that runs ``stage`` for micro-batch ``mb`` (``ALL``: every rank)."""
        return self.lanes[mb % len(self.lanes)][stage]

    def ranks_of(self, stage: int) -> tuple[int, ...]:
        """The ranks that hold ``stage`` (two under chimera_direct, all for an all-device stage), in order."""
        ranks = {lane[stage] for lane in self.lanes}
        return tuple(range(self.nranks)) if ALL in ranks else tuple(sorted(ranks))

    def on_every_rank(self, stage: int) -> bool:
        return ALL in (lane[stage] for lane in self.lanes)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages that ``rank`` holds, in increasing order."""
        return tuple(s for s in range(self.nstages) if rank in self.ranks_of(s))

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
