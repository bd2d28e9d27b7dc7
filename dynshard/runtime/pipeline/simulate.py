"""Check a pipeline schedule before it runs, and time it with unit costs.

A wrong schedule does not fail in a multi-process run: it hangs in ``irecv`` until the process group's
timeout, on some ranks, with no hint which action is to blame. So every schedule is run here first, as
the executor will run it, and rejected with a message naming the stuck action on each rank.

Execution model (what the executor does, and what is checked):
- each rank runs its actions in order, one at a time;
- SEND is non-blocking (``isend``; the executor waits on all sends at the end of the step);
- RECV posts a non-blocking ``irecv`` and returns;
- a compute action that consumes a RECV blocks until the peer has executed the matching SEND;
- messages are matched by (kind, stage, micro-batch), so their order between a pair of ranks does not
  matter for this check (see :func:`fifo_mismatches` for executors that match in order);
- a neighbour stage on the same rank is handed its input locally, so it must have run earlier in the list;
- an all-device stage (``actions.ALL``) runs on every rank, and its F and B, and the BCAST_B before its
  B, are collectives: a rank that reaches one waits until every rank is at the same one (ranks at
  different collectives deadlock), then all start together.

Completeness is checked too: every stage's F, and B (or I and W), for every micro-batch exactly once, on
the stage's rank; backward after forward, W after I; each RECV before the compute that consumes it;
each SEND after the compute that produces it; every SEND matched by exactly one RECV and vice versa,
with consistent peers. A forward-only schedule (no B, I or W at all) is accepted.

Cost model of :func:`simulate`: a forward costs ``f``, a full backward ``b``, a split backward costs
``b - w`` for I and ``w`` for W (so B = I + W); messages arrive ``comm`` after they are sent (0 by
default) and SEND/RECV take no rank time. ``bubble_fraction`` is idle time over total time,
``1 - sum(busy) / (nranks * makespan)``, the quantity the analytic formulas give (memo section 5).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from .actions import ALL, Action, Schedule

__all__ = ["ScheduleError", "DeadlockError", "SimResult", "check_deadlock_free", "simulate", "fifo_mismatches"]

_KINDS = ("F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "BCAST_B")
_MAX_LISTED = 12   # problems listed in one error message


class ScheduleError(ValueError):
    """A schedule that is malformed or incomplete: missing, duplicated or misplaced actions."""


class DeadlockError(ScheduleError):
    """A schedule whose ranks cannot all finish under the execution model."""


@dataclasses.dataclass(frozen=True)
class SimResult:
    makespan: float
    busy: tuple[float, ...]              # compute time per rank
    bubble_fraction: float               # 1 - sum(busy) / (nranks * makespan)
    timeline: tuple[tuple[tuple[float, float, Action], ...], ...]   # per rank: (start, end, compute)

    @property
    def idle(self) -> tuple[float, ...]:
        return tuple(self.makespan - b for b in self.busy)


def check_deadlock_free(schedule: Schedule) -> None:
    """Raise ScheduleError if ``schedule`` is incomplete or out of order, DeadlockError if it hangs."""
    _run(schedule, {"F": 1.0, "B": 1.0, "I": 1.0, "W": 1.0}, 0.0)


def simulate(schedule: Schedule, f: float = 1.0, b: float = 2.0, w: float | None = None,
             comm: float = 0.0) -> SimResult:
    """Time ``schedule`` with the unit costs of the module docstring (``w`` defaults to ``b / 2``)."""
    w = b / 2 if w is None else w
    if not 0 <= w <= b or f < 0 or comm < 0:
        raise ValueError(f"costs must satisfy f >= 0, 0 <= w <= b, comm >= 0; got f={f}, b={b}, w={w}, comm={comm}")
    timeline = _run(schedule, {"F": f, "B": b, "I": b - w, "W": w}, comm)
    makespan = max((t[-1][1] for t in timeline if t), default=0.0)
    busy = tuple(sum(end - start for start, end, _ in t) for t in timeline)
    bubble = 1.0 - sum(busy) / (schedule.nranks * makespan) if makespan > 0 else 0.0
    return SimResult(makespan, busy, bubble, timeline)


def fifo_mismatches(schedule: Schedule) -> list[str]:
    """Pairs of ranks whose receives are posted in another order than the peer sends.

    Empty means that matching messages in order per (sender, receiver) pair, as NCCL and tag-less gloo
    p2p do, pairs the same messages as matching by (kind, stage, micro-batch).
    """
    sends: dict[tuple[int, int], list[tuple]] = {}
    recvs: dict[tuple[int, int], list[tuple]] = {}
    for rank, actions in enumerate(schedule.actions):
        for a in actions:
            if a.kind.startswith("SEND_"):
                sends.setdefault((rank, a.peer), []).append(_message(a))
            elif a.kind.startswith("RECV_"):
                recvs.setdefault((a.peer, rank), []).append(_message(a))
    problems = []
    for pair in sorted(set(sends) | set(recvs), key=str):
        sent, received = sends.get(pair, []), recvs.get(pair, [])
        if sent != received:
            i = next((i for i, (x, y) in enumerate(zip(sent, received)) if x != y), min(len(sent), len(received)))
            problems.append(f"rank {pair[0]} -> rank {pair[1]}: message {i} is {_describe(sent, i)} on the sender "
                            f"but {_describe(received, i)} on the receiver")
    return problems


# -- machinery -----------------------------------------------------------------------------------------------
def _message(a: Action) -> tuple[str, int, int]:
    """The message a comm action handles, named by its direction, sending stage and micro-batch."""
    if a.kind == "SEND_F":
        return ("F", a.stage, a.mb)
    if a.kind == "RECV_F":
        return ("F", a.stage - 1, a.mb)
    if a.kind == "SEND_B":
        return ("B", a.stage, a.mb)
    return ("B", a.stage + 1, a.mb)


def _describe(messages: list[tuple], i: int) -> str:
    if i >= len(messages):
        return "missing"
    kind, stage, mb = messages[i]
    return f"{stage}SEND_{kind}{mb}"


def _fail(cls: type, title: str, problems: list[str]) -> None:
    listed = problems[:_MAX_LISTED]
    more = f"\n  ... and {len(problems) - len(listed)} more" if len(problems) > len(listed) else ""
    raise cls(f"{title}:\n  " + "\n  ".join(listed) + more)


def _check_actions(schedule: Schedule) -> None:
    """Shape, placement and peers of every action, and exactly-once compute coverage."""
    n, m, p = schedule.nstages, schedule.nmicros, schedule.nranks
    name = schedule.name
    if not schedule.lanes or any(len(lane) != n or any(not (0 <= r < p or r == ALL) for r in lane)
                                 for lane in schedule.lanes):
        raise ScheduleError(f"{name}: lanes {schedule.lanes} must give a rank in [0, {p}) for each of {n} stages")
    if len(schedule.actions) != p:
        raise ScheduleError(f"{name}: {len(schedule.actions)} action lists for {p} ranks")
    problems: list[str] = []
    for rank, actions in enumerate(schedule.actions):
        for pos, a in enumerate(actions):
            where = f"rank {rank} step {pos} ({a})"
            if a.kind not in _KINDS or not 0 <= a.stage < n or not 0 <= a.mb < m:
                problems.append(f"{where}: needs a kind in {_KINDS}, a stage in [0, {n}), a micro-batch in [0, {m})")
                continue
            owner = schedule.rank_of(a.stage, a.mb)
            if owner not in (rank, ALL):
                problems.append(f"{where}: stage {a.stage} runs micro-batch {a.mb} on rank {owner}")
            if a.kind in ("F", "B", "I", "W"):
                if a.peer is not None:
                    problems.append(f"{where}: a compute action has no peer")
                continue
            if a.kind == "BCAST_B":
                if owner != ALL or a.stage + 1 >= n or a.peer != schedule.rank_of(a.stage + 1, a.mb):
                    problems.append(f"{where}: BCAST_B carries the gradients of an all-device stage's outputs "
                                    f"from the rank of the next stage")
                continue
            other = a.stage + (1 if a.kind in ("SEND_F", "RECV_B") else -1)
            if not 0 <= other < n:
                problems.append(f"{where}: stage {a.stage} has no neighbour stage {other} to talk to")
            elif schedule.rank_of(other, a.mb) == owner:
                problems.append(f"{where}: stage {other} is on the same rank; hand the data over locally")
            elif a.peer != schedule.rank_of(other, a.mb):
                problems.append(f"{where}: the peer must be rank {schedule.rank_of(other, a.mb)} (stage {other}), "
                                f"not {a.peer}")
    if problems:
        _fail(ScheduleError, f"schedule {name!r} has misplaced actions", problems)
    count = Counter((a.kind, a.stage, a.mb) for actions in schedule.actions for a in actions)
    training = any(k in ("B", "I", "W") for k, _, _ in count)
    for stage in range(n):
        copies = p if schedule.on_every_rank(stage) else 1
        for mb in range(m):
            f, b, i, w = (count[k, stage, mb] for k in "FBIW")
            if f != copies:
                problems.append(f"{stage}F{mb} appears {f} times, not {copies}")
            if training and copies > 1 and (b, i, w) != (copies, 0, 0):
                problems.append(f"stage {stage} runs on every rank, so micro-batch {mb} needs one B per rank")
            elif training and copies == 1 and not ((b, i, w) == (1, 0, 0) or (b, i, w) == (0, 1, 1)):
                problems.append(f"stage {stage} micro-batch {mb} has {b} B, {i} I, {w} W; "
                                f"it needs one B, or one I and one W")
    for key, c in count.items():
        if key[0] == "BCAST_B" and c != p:
            problems.append(f"{key[1]}{key[0]}{key[2]} appears {c} times, not on every rank")
        elif key[0] in ("SEND_F", "RECV_F", "SEND_B", "RECV_B") and c > 1:
            problems.append(f"{key[1]}{key[0]}{key[2]} appears {c} times")
    if problems:
        _fail(ScheduleError, f"schedule {name!r} is incomplete", problems)


def _dependencies(schedule: Schedule, a: Action) -> tuple[list[tuple[str, int, int]], tuple | None]:
    """(compute actions that must run earlier on the same rank, message consumed or None)."""
    last, s, mb = schedule.nstages - 1, a.stage, a.mb
    rank = schedule.rank_of(s, mb)
    local: list[tuple[str, int, int]] = []
    message = None
    if a.kind == "F" and s > 0:
        if schedule.rank_of(s - 1, mb) in (rank, ALL):
            local.append(("F", s - 1, mb))
        else:
            message = ("F", s - 1, mb)
    elif a.kind in ("B", "I"):
        local.append(("F", s, mb))
        if s < last:
            if rank == ALL:
                local.append(("C", s, mb))        # the BCAST_B of the gradients it needs
            elif schedule.rank_of(s + 1, mb) == rank:
                local.append(("BI", s + 1, mb))
            else:
                message = ("B", s + 1, mb)
    elif a.kind == "W":
        local.append(("I", s, mb))
    elif a.kind == "SEND_F":
        local.append(("F", s, mb))
    elif a.kind == "SEND_B":
        local.append(("BI", s, mb))
    return local, message


def _source_dependency(schedule: Schedule, a: Action, rank: int) -> list[tuple[str, int, int]]:
    """BCAST_B on the rank that holds the gradients: the backward that produced them."""
    return [("BI", a.stage + 1, a.mb)] if a.kind == "BCAST_B" and a.peer == rank else []


def _check_order(schedule: Schedule) -> list[dict[int, tuple]]:
    """Per rank, {position of a compute action: the message it consumes}; raises on ordering problems."""
    problems: list[str] = []
    consumers: list[dict[int, tuple]] = []
    for rank, actions in enumerate(schedule.actions):
        done: set[tuple[str, int, int]] = set()
        posted: dict[tuple, int] = {}   # message -> position of its RECV, until consumed
        consumed: dict[int, tuple] = {}
        for pos, a in enumerate(actions):
            local, message = _dependencies(schedule, a)
            for kind, stage, mb in local + _source_dependency(schedule, a, rank):
                if not any((k, stage, mb) in done for k in kind):
                    need = "/".join(f"{stage}{k}{mb}" for k in kind)
                    problems.append(f"rank {rank} step {pos}: {a} needs {need} earlier on the same rank")
            if message is not None:
                if message in posted:
                    del posted[message]
                    consumed[pos] = message
                else:
                    recv = "RECV_F" if a.kind == "F" else "RECV_B"
                    problems.append(f"rank {rank} step {pos}: {a} consumes {a.stage}{recv}{a.mb}, which is not "
                                    f"posted before it on rank {rank}")
            if a.kind.startswith("RECV_"):
                posted[_message(a)] = pos
            elif a.kind == "BCAST_B":
                done.add(("C", a.stage, a.mb))
            elif not a.is_comm:
                done.add((a.kind, a.stage, a.mb))
        for message, pos in posted.items():
            problems.append(f"rank {rank} step {pos}: {actions[pos]} is never consumed")
        consumers.append(consumed)
    sent = Counter(_message(a) for actions in schedule.actions for a in actions if a.kind.startswith("SEND_"))
    received = Counter(_message(a) for actions in schedule.actions for a in actions if a.kind.startswith("RECV_"))
    for message in sorted(set(sent) | set(received)):
        if sent[message] != received[message]:
            kind, stage, mb = message
            problems.append(f"message {stage}SEND_{kind}{mb} has {sent[message]} send(s) and "
                            f"{received[message]} receive(s)")
    if problems:
        _fail(ScheduleError, f"schedule {schedule.name!r} has unmatched or out-of-order actions", problems)
    return consumers


_Timeline = tuple[tuple[tuple[float, float, Action], ...], ...]


def _is_collective(schedule: Schedule, a: Action) -> bool:
    return a.kind == "BCAST_B" or (not a.is_comm and schedule.rank_of(a.stage, a.mb) == ALL)


def _run(schedule: Schedule, cost: dict[str, float], comm: float) -> _Timeline:
    """Execute every rank's list under the execution model; the compute timeline per rank, or an error."""
    _check_actions(schedule)
    consumers = _check_order(schedule)
    actions = schedule.actions
    pcs = [0] * schedule.nranks
    clocks = [0.0] * schedule.nranks
    sent_at: dict[tuple, float] = {}
    timeline: list[list[tuple[float, float, Action]]] = [[] for _ in actions]
    progress = True
    while progress:
        progress = False
        for rank, todo in enumerate(actions):
            while pcs[rank] < len(todo):
                pos, a = pcs[rank], todo[pcs[rank]]
                if _is_collective(schedule, a):
                    if not all(pcs[q] < len(actions[q]) and actions[q][pcs[q]] == a for q in range(len(actions))):
                        break    # waits for every rank to reach it
                    start = max(clocks)
                    for q in range(len(actions)):
                        if not a.is_comm:
                            clocks[q] = start + cost[a.kind]
                            timeline[q].append((start, clocks[q], a))
                        pcs[q] += 1
                    progress = True
                    continue
                start = clocks[rank]
                message = consumers[rank].get(pos)
                if message is not None:
                    if message not in sent_at:
                        break    # blocked on the peer
                    start = max(start, sent_at[message] + comm)
                if a.kind.startswith("SEND_"):
                    sent_at[_message(a)] = start
                elif not a.is_comm:
                    clocks[rank] = start + cost[a.kind]
                    timeline[rank].append((start, clocks[rank], a))
                pcs[rank] += 1
                progress = True
    stuck = [rank for rank, todo in enumerate(actions) if pcs[rank] < len(todo)]
    if stuck:
        send_pos = {_message(a): (rank, pos) for rank, todo in enumerate(actions)
                    for pos, a in enumerate(todo) if a.kind.startswith("SEND_")}
        lines = []
        for rank in stuck:
            pos = pcs[rank]
            a = actions[rank][pos]
            if _is_collective(schedule, a):
                others = [f"rank {q} at {actions[q][pcs[q]] if pcs[q] < len(actions[q]) else 'its end'}"
                          for q in range(len(actions)) if q != rank]
                lines.append(f"rank {rank} is stuck at step {pos} ({a}), a collective of every rank: "
                             + ", ".join(others))
                continue
            kind, stage, mb = consumers[rank][pos]
            peer, peer_pos = send_pos[kind, stage, mb]
            lines.append(f"rank {rank} is stuck at step {pos} ({a}): it waits for {stage}SEND_{kind}{mb}, step "
                         f"{peer_pos} of rank {peer}, which is stuck at step {pcs[peer]} "
                         f"({actions[peer][pcs[peer]]})")
        _fail(DeadlockError, f"schedule {schedule.name!r} deadlocks ({len(stuck)} of {schedule.nranks} ranks "
              f"cannot finish)", lines)
    return tuple(tuple(t) for t in timeline)
