"""Pipeline schedules as data: per-rank action lists, with the point-to-point messages written in.

A schedule says, for each pipeline rank, which stage computes what for which micro-batch, and when
activations and gradients cross ranks. It is built here once, in pure Python, and checked by
:mod:`.simulate` before anyone runs it, so a bad plan fails at plan time with a message instead of hanging
in ``irecv``. The executor only walks the lists. The vocabulary is torch's ``_Action`` IR
(``torch.distributed.pipelining.schedules``) so that printouts read like torch's: ``1F3`` is stage 1's
forward of micro-batch 3, ``0SEND_F2`` stage 0 sending its output for micro-batch 2. The data types
(:class:`Action`, :class:`Schedule`) live in :mod:`.actions`, which :mod:`.simulate` shares, and are
re-exported here.

The compute orders are generated here rather than imported from torch. torch 2.13's
``Schedule1F1B._get_pipeline_order`` is wrong for the last rank (it skips F0 and invents F<m>; memo 1.7),
and the other generators are private and move between releases. The interleaved order follows the rule
that Megatron, torch's ``ScheduleInterleaved1F1B`` and nnScaler's ``sched_1f1b_interleaved`` share, and a
test compares it with torch's.

Stage placement is torch's "loop" style: stage ``s`` lives on rank ``s % nranks``, so with ``k`` stages
per rank, rank ``r`` holds stages ``r, r + nranks, ..., r + (k-1) nranks``. ``chimera_direct`` runs two
pipelines in opposite directions (Chimera, Li and Hoefler, SC'21): a *lane* is one stage -> rank map, and
micro-batch ``mb`` travels lane ``mb % nlanes``; its lanes are stage ``s`` on rank ``s`` (down) and on rank
``3 - s`` (up), so every rank holds two stages and every stage lives on two ranks. Every other schedule
has one lane. ``1f1b_plus`` (and the gpipe / infer_pipe orders of a model planned for it) adds a stage 0
that runs on every rank (``ALL`` in the lanes): nnScaler's segment spanning all devices, tensor parallel
over the unit. Its forward for micro-batch ``mb`` runs on every rank just before stage 1's forward of
``mb``, its backward just after stage 1's backward, at the same place in every rank's list (they hold
collectives); stage 1 reads its outputs locally, and the gradients of those outputs go from stage 1's
rank to every rank by a broadcast (``BCAST_B``, placed right before the backward that needs it).

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

from collections import defaultdict

from .actions import ALL, COMM_KINDS, COMPUTE_KINDS, Action, Schedule
from .simulate import check_deadlock_free, simulate

__all__ = ["ALL", "Action", "Schedule", "SCHEDULES", "COMPUTE_KINDS", "COMM_KINDS", "build_schedule"]

SCHEDULES = ("gpipe", "1f1b", "1f1b_interleaved", "1f1b_plus", "chimera_direct", "infer_pipe",
             "zb1p")   # infer_pipe: forward only
# schedules that need exactly one stage per rank
_ONE_STAGE_PER_RANK = ("gpipe", "1f1b", "zb1p")


def build_schedule(name: str, nstages: int, nmicros: int, nranks: int, all_device_first: bool = False) -> Schedule:
    """The schedule ``name`` for ``nstages`` stages on ``nranks`` pipeline ranks and ``nmicros`` micro-batches.

    With ``all_device_first`` (implied by ``1f1b_plus``), stage 0 runs on every rank and ``name``'s order
    is laid out over the other ``nstages - 1``. Raises ValueError for an unknown name or an impossible
    configuration, saying what to change. The result has passed :func:`.simulate.check_deadlock_free`.
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    for label, value in (("nstages", nstages), ("nmicros", nmicros), ("nranks", nranks)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: {label} must be a positive integer, got {value!r}")
    all_device_first = all_device_first or name == "1f1b_plus"
    base = "1f1b" if name == "1f1b_plus" else name
    if all_device_first and base not in ("1f1b", "gpipe", "infer_pipe"):
        raise ValueError(f"{name}: an all-device first stage goes with 1f1b_plus, gpipe or infer_pipe only")
    lanes, orders = _orders(base, nstages - int(all_device_first), nmicros, nranks)
    if all_device_first:
        lanes, orders = _all_device_first(base, lanes, orders, nmicros, nranks)
    actions = _in_send_order([_lower(order, lanes) for order in orders])
    schedule = Schedule(name, nstages, nmicros, nranks, lanes, actions)
    check_deadlock_free(schedule)
    return schedule


def _orders(name: str, nstages: int, nmicros: int, nranks: int):
    """(lanes, compute order per rank) of ``name`` over ``nstages`` stages, or ValueError."""
    if nstages % nranks:
        raise ValueError(f"{name}: {nstages} stages cannot be spread evenly over {nranks} pipeline ranks; "
                         f"use a multiple of {nranks} stages (each rank holds nstages // nranks of them)")
    nchunks = nstages // nranks
    if name in _ONE_STAGE_PER_RANK and nchunks != 1:
        raise ValueError(f"{name} runs one stage per rank, but got {nstages} stages on {nranks} ranks; "
                         f"use nstages == nranks, or '1f1b_interleaved' for {nchunks} stages per rank")
    if name == "1f1b_interleaved":
        _interleaved_rounds(nranks, nchunks, nmicros)  # validates
    if name == "chimera_direct":
        lanes = _chimera_lanes(nstages, nmicros, nranks)
        return lanes, _list_scheduled(lanes, nmicros, nranks)
    lanes = (tuple(s % nranks for s in range(nstages)),)
    return lanes, [_GENERATORS[name](rank, nranks, nchunks, nmicros) for rank in range(nranks)]


def _all_device_first(name: str, lanes, orders, m: int, p: int):
    """``orders`` (over stages 1..) with stage 0 on every rank, where nnScaler's 1f1b_plus puts it: its
    forward of ``mb`` just before stage 1's, its backward just after stage 1's. "Before" and "after" are
    times of the order run with F = 1, B = 2 (:func:`.simulate.simulate`), the same on every rank, so every
    rank runs stage 0's actions (collectives) in one order and between the same neighbours."""
    base = Schedule(name, len(lanes[0]), m, p, lanes, tuple(_lower(order, lanes) for order in orders))
    timeline = simulate(base).timeline
    first_f = {a.mb: start for actions in timeline for start, _, a in actions if a.kind == "F" and a.stage == 0}
    first_b = {a.mb: end for actions in timeline for _, end, a in actions if a.kind == "B" and a.stage == 0}
    placed = []
    for rank in range(p):
        keyed = [((start, 1, 0, a.mb), (a.kind, a.stage + 1, a.mb)) for start, _, a in timeline[rank]]
        keyed += [((first_f[mb], 0, 0, mb), ("F", 0, mb)) for mb in range(m)]
        keyed += [((first_b[mb], 0, 1, mb), ("B", 0, mb)) for mb in first_b]
        placed.append([action for _, action in sorted(keyed)])
    return tuple((ALL,) + tuple(lane) for lane in lanes), placed


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


def _chimera_lanes(nstages: int, m: int, p: int) -> tuple[tuple[int, ...], ...]:
    """chimera_direct's two lanes, or ValueError: nnScaler defines it for 4 stages and pairs of micro-batches."""
    if nstages != 4 or p != 4:
        raise ValueError(f"chimera_direct runs exactly 4 stages on 4 pipeline ranks (each rank holds stage r and "
                         f"stage 3 - r), got {nstages} stages on {p} ranks; use pipeline_nstages=4 with 4 pipeline "
                         "ranks, or another schedule")
    if m % 2:
        raise ValueError(f"chimera_direct sends micro-batches down and up the pipeline in pairs, so the number of "
                         f"micro-batches must be even; got nmicros={m}; use {m - 1 or 2} or {m + 1}")
    return tuple(range(nstages)), tuple(p - 1 - s for s in range(nstages))


def _list_scheduled(lanes: tuple[tuple[int, ...], ...], m: int, p: int, f: float = 1.0,
                    b: float = 2.0) -> list[list[tuple[str, int, int]]]:
    """Compute orders found by running the pipeline in time (F costs ``f``, B ``b``): whenever a rank is free
    it starts its ready action of highest priority, backwards first (they free activations and unblock the
    ranks behind), then the earliest micro-batch. A forward waits while the rank already holds ``cap``
    micro-batches' activations, as 1F1B's warm-up bounds them; the smallest cap that finishes is used.
    Chimera's "direct" concatenation of its basic units comes out of this by itself, and no unit waits for
    the previous one to drain."""
    nstages = len(lanes[0])
    for cap in range(nstages, 2 * m * nstages + 1):
        orders = _greedy(lanes, m, p, f, b, cap)
        if orders is not None:
            return orders
    raise AssertionError("unreachable: an unbounded cap runs every forward first")


def _greedy(lanes, m: int, p: int, f: float, b: float, cap: int) -> list[list[tuple[str, int, int]]] | None:
    last = len(lanes[0]) - 1
    rank_of = {(s, mb): lanes[mb % len(lanes)][s] for s in range(last + 1) for mb in range(m)}
    todo = [sorted([(k, s, mb) for (s, mb), r in rank_of.items() if r == rank for k in "FB"],
                   key=lambda a: (a[0] != "B", a[2], -a[1] if a[0] == "B" else a[1])) for rank in range(p)]
    done: dict[tuple[str, int, int], float] = {}
    free, held = [0.0] * p, [0] * p
    orders: list[list[tuple[str, int, int]]] = [[] for _ in range(p)]
    now = 0.0

    def ready(action: tuple[str, int, int]) -> bool:
        kind, s, mb = action
        needs = [("F", s - 1, mb)] if kind == "F" and s > 0 else []
        if kind == "B":
            needs = [("F", s, mb)] + ([("B", s + 1, mb)] if s < last else [])
        return all(n in done and done[n] <= now for n in needs)

    while any(todo):
        for rank in range(p):
            if free[rank] > now:
                continue
            choice = next((a for a in todo[rank] if ready(a) and (a[0] == "B" or held[rank] < cap)), None)
            if choice is None:
                continue
            todo[rank].remove(choice)
            held[rank] += 1 if choice[0] == "F" else -1
            free[rank] = done[choice] = now + (f if choice[0] == "F" else b)
            orders[rank].append(choice)
        later = [t for t in free + list(done.values()) if t > now]
        if not later:
            return None if any(todo) else orders     # stuck: every remaining action waits on a capped rank
        now = min(later)
    return orders


_GENERATORS = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "1f1b_interleaved": _one_f_one_b_interleaved,
               "infer_pipe": _infer_pipe, "zb1p": _zb1p}


# -- lowering: write the messages in -------------------------------------------------------------------------
def _comms(kind: str, stage: int, mb: int, lanes: tuple[tuple[int, ...], ...]) -> tuple[list[Action], list[Action]]:
    """(receives before, sends after) the compute action ``kind`` of ``stage`` for ``mb``."""
    stage_to_rank = lanes[mb % len(lanes)]
    rank, last = stage_to_rank[stage], len(stage_to_rank) - 1
    recvs: list[Action] = []
    sends: list[Action] = []
    # an all-device stage's outputs are on every rank already; the gradients of its outputs are broadcast
    if kind == "F":
        if stage > 0 and stage_to_rank[stage - 1] not in (rank, ALL):
            recvs.append(Action("RECV_F", stage, mb, stage_to_rank[stage - 1]))
        if stage < last and rank != ALL and stage_to_rank[stage + 1] != rank:
            sends.append(Action("SEND_F", stage, mb, stage_to_rank[stage + 1]))
    elif kind in ("B", "I"):
        if stage < last and stage_to_rank[stage + 1] != rank:
            kind = "BCAST_B" if rank == ALL else "RECV_B"
            recvs.append(Action(kind, stage, mb, stage_to_rank[stage + 1]))
        if stage > 0 and stage_to_rank[stage - 1] not in (rank, ALL):
            sends.append(Action("SEND_B", stage, mb, stage_to_rank[stage - 1]))
    return recvs, sends


def _message(a: Action) -> tuple[str, int, int]:
    """(direction, sending stage, micro-batch): what a SEND and its matching RECV both name (BCAST_B is
    a collective, not a message)."""
    if a.kind in ("SEND_F", "SEND_B"):
        return a.kind[-1], a.stage, a.mb
    return a.kind[-1], a.stage + (-1 if a.kind == "RECV_F" else 1), a.mb


def _in_send_order(lists: list[tuple[Action, ...]]) -> tuple[tuple[Action, ...], ...]:
    """Post each rank's receives from a peer in the order that peer sends (moving a receive earlier when
    needed), so that p2p matched in order per pair of ranks (NCCL ignores tags) pairs the right messages.
    Posting earlier never blocks: an irecv returns at once. Only chimera_direct's two lanes need it."""
    sent: dict[tuple[int, int], list[tuple]] = {}
    for rank, actions in enumerate(lists):
        for a in actions:
            if a.kind.startswith("SEND_"):
                sent.setdefault((rank, a.peer), []).append(_message(a))
    out = []
    for rank, actions in enumerate(lists):
        recvs = {(a.peer, _message(a)): a for a in actions if a.kind.startswith("RECV_")}
        posted: set[tuple] = set()
        fixed: list[Action] = []
        for a in actions:
            if not a.kind.startswith("RECV_"):
                fixed.append(a)
                continue
            if (a.peer, _message(a)) in posted:
                continue
            order = sent[(a.peer, rank)]
            for message in order[:order.index(_message(a)) + 1]:     # everything the peer sends before it
                if (a.peer, message) not in posted:
                    posted.add((a.peer, message))
                    fixed.append(recvs[(a.peer, message)])
        out.append(tuple(fixed))
    return tuple(out)


def _lower(order: list[tuple[str, int, int]], lanes: tuple[tuple[int, ...], ...]) -> tuple[Action, ...]:
    """One rank's compute order with its SENDs right after the producer and its RECVs one compute early,
    except those of the first backward (see the module docstring)."""
    comms = [_comms(kind, stage, mb, lanes) for kind, stage, mb in order]
    first_backward = next((i for i, (kind, _, _) in enumerate(order) if kind in ("B", "I")), len(order))
    posted = [[a for a in recvs if a.kind != "BCAST_B"] for recvs, _ in comms]   # irecvs, posted early
    blocking = [[a for a in recvs if a.kind == "BCAST_B"] for recvs, _ in comms]  # a collective: in place
    out: list[Action] = list(posted[0]) if comms else []
    for i, (kind, stage, mb) in enumerate(order):
        early = i + 1 < len(order) and i + 1 != first_backward
        if early:
            out += posted[i + 1]
        out += blocking[i]
        out.append(Action(kind, stage, mb))
        out += comms[i][1]
        if i + 1 == first_backward < len(order):
            out += posted[i + 1]
    return tuple(out)
