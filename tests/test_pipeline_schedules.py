"""dynshard.runtime.pipeline.schedules and .simulate: pipeline schedules as checked data (pure Python).

Every generated schedule must finish under the executor's model (non-blocking sends, receives consumed
by blocking computes), cover every stage and micro-batch exactly once, and have the bubble the analytic
formulas give. Cost model of the bubble checks: a forward costs 1, a backward 2 (I = W = 1 when split),
no communication time; bubble = idle / (ranks x makespan).
"""

from __future__ import annotations

import expecttest
import pytest

from dynshard import compat
from dynshard.runtime.pipeline.schedules import ALL, SCHEDULES, Action, Schedule, build_schedule
from dynshard.runtime.pipeline.simulate import (DeadlockError, ScheduleError, check_deadlock_free, fifo_mismatches,
                                                simulate)


def _micro_batch_counts(p: int) -> list[int]:
    return sorted({1, 2, 3, p - 1, p, p + 1, 2 * p, 3 * p + 1, 4 * p} - {0})


@pytest.mark.parametrize("p", [1, 2, 4, 8])
@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_is_deadlock_free_and_complete(name, p):
    built = 0
    for k in ((1, 2, 3) if name in ("1f1b_interleaved", "infer_pipe") else (1,)):
        for m in _micro_batch_counts(p):
            try:
                schedule = build_schedule(name, k * p + (name == "1f1b_plus"), m, p)
            except ValueError as error:
                # only the interleaved rounds rule and chimera's 4 stages / pairs may refuse one here
                assert (name == "1f1b_interleaved" and k > 1 and m % max(1, m // p)) or (
                    name == "chimera_direct" and (p != 4 or m % 2)), error
                continue
            built += 1
            check_deadlock_free(schedule)       # build_schedule ran it too; it must stay idempotent
            assert fifo_mismatches(schedule) == []
            loop = tuple(s % p for s in range(k * p))
            assert schedule.lanes == {"chimera_direct": (loop, loop[::-1]), "1f1b_plus": ((ALL,) + loop,)}.get(
                name, (loop,))
            per_stage = {"gpipe": "FB", "1f1b": "FB", "1f1b_interleaved": "FB", "infer_pipe": "F", "zb1p": "FIW",
                         "chimera_direct": "FB", "1f1b_plus": "FB"}
            for rank in range(p):
                computes = schedule.compute_actions(rank)
                assert sorted((a.kind, a.stage, a.mb) for a in computes) == sorted(
                    (kind, s, mb) for kind in per_stage[name] for s in schedule.stages_of(rank) for mb in range(m)
                    if schedule.rank_of(s, mb) in (rank, ALL))
                if p == 1:       # (a broadcast to the only rank does nothing)
                    assert all(not a.is_comm or a.kind == "BCAST_B" for a in schedule.actions[rank])
                # the part before the first backward action needs nothing from a backward, and for
                # gpipe it is the whole forward (transparent GPipe runs it in the autograd forward)
                actions = schedule.actions[rank]
                cut = next((i for i, a in enumerate(actions) if a.kind in ("B", "I", "W", "RECV_B", "BCAST_B")),
                           len(actions))
                assert all(a.kind in ("F", "SEND_F", "RECV_F") for a in actions[:cut])
                if name in ("gpipe", "infer_pipe"):
                    assert all(a.kind in ("B", "SEND_B", "RECV_B") for a in actions[cut:])
    assert built or (name == "chimera_direct" and p != 4)


class TestPrintouts(expecttest.TestCase):
    def test_gpipe(self):
        self.assertExpectedInline(build_schedule("gpipe", 2, 4, 2).format(), """\
gpipe: 2 stages on 2 ranks, 4 micro-batches (rank 0: [0]  rank 1: [1])
step  rank 0    rank 1
0     0F0       1RECV_F0
1     0SEND_F0  1RECV_F1
2     0F1       1F0
3     0SEND_F1  1RECV_F2
4     0F2       1F1
5     0SEND_F2  1RECV_F3
6     0F3       1F2
7     0SEND_F3  1F3
8     0RECV_B0  1B0
9     0RECV_B1  1SEND_B0
10    0B0       1B1
11    0RECV_B2  1SEND_B1
12    0B1       1B2
13    0RECV_B3  1SEND_B2
14    0B2       1B3
15    0B3       1SEND_B3""")

    def test_1f1b(self):
        self.assertExpectedInline(build_schedule("1f1b", 2, 4, 2).format(), """\
1f1b: 2 stages on 2 ranks, 4 micro-batches (rank 0: [0]  rank 1: [1])
step  rank 0    rank 1
0     0F0       1RECV_F0
1     0SEND_F0  1F0
2     0F1       1RECV_F1
3     0SEND_F1  1B0
4     0RECV_B0  1SEND_B0
5     0B0       1F1
6     0RECV_B1  1RECV_F2
7     0F2       1B1
8     0SEND_F2  1SEND_B1
9     0B1       1F2
10    0RECV_B2  1RECV_F3
11    0F3       1B2
12    0SEND_F3  1SEND_B2
13    0RECV_B3  1F3
14    0B2       1B3
15    0B3       1SEND_B3""")

    def test_interleaved_two_stages_per_rank(self):
        self.assertExpectedInline(build_schedule("1f1b_interleaved", 4, 4, 2).format(), """\
1f1b_interleaved: 4 stages on 2 ranks, 4 micro-batches (rank 0: [0, 2]  rank 1: [1, 3])
step  rank 0    rank 1
0     0F0       1RECV_F0
1     0SEND_F0  1RECV_F1
2     2RECV_F0  1F0
3     0F1       1SEND_F0
4     0SEND_F1  3RECV_F0
5     2RECV_F1  1F1
6     2F0       1SEND_F1
7     2SEND_F0  3F0
8     2F1       3RECV_F1
9     2SEND_F1  3B0
10    0F2       3SEND_B0
11    0SEND_F2  3F1
12    2RECV_B0  1RECV_F2
13    2B0       3B1
14    2SEND_B0  3SEND_B1
15    2RECV_B1  1RECV_B0
16    0F3       1F2
17    0SEND_F3  1SEND_F2
18    2RECV_F2  1RECV_F3
19    2B1       1B0
20    2SEND_B1  1SEND_B0
21    0RECV_B0  1RECV_B1
22    2F2       1F3
23    2SEND_F2  1SEND_F3
24    2RECV_F3  3RECV_F2
25    0B0       1B1
26    0RECV_B1  1SEND_B1
27    2F3       3F2
28    2SEND_F3  3RECV_F3
29    2RECV_B2  3B2
30    0B1       3SEND_B2
31    2RECV_B3  3F3
32    2B2       1RECV_B2
33    2SEND_B2  3B3
34    0RECV_B2  3SEND_B3
35    2B3       1RECV_B3
36    2SEND_B3  1B2
37    0RECV_B3  1SEND_B2
38    0B2       1B3
39    0B3       1SEND_B3""")

    def test_zb1p_compute_order(self):
        # rank r holds back its first r W passes and runs them at the end, where 1F1B's rank r idles
        self.assertExpectedInline(build_schedule("zb1p", 4, 6, 4).format(comms=False), """\
zb1p: 4 stages on 4 ranks, 6 micro-batches (rank 0: [0]  rank 1: [1]  rank 2: [2]  rank 3: [3])
step  rank 0  rank 1  rank 2  rank 3
0     0F0     1F0     2F0     3F0
1     0F1     1F1     2F1     3I0
2     0F2     1F2     2I0     3F1
3     0F3     1I0     2F2     3I1
4     0I0     1F3     2I1     3F2
5     0W0     1I1     2F3     3I2
6     0F4     1W0     2I2     3F3
7     0I1     1F4     2W0     3I3
8     0W1     1I2     2F4     3W0
9     0F5     1W1     2I3     3F4
10    0I2     1F5     2W1     3I4
11    0W2     1I3     2F5     3W1
12    0I3     1W2     2I4     3F5
13    0W3     1I4     2W2     3I5
14    0I4     1W3     2I5     3W2
15    0W4     1I5     2W3     3W3
16    0I5     1W4     2W4     3W4
17    0W5     1W5     2W5     3W5""")

    def test_chimera_direct_runs_two_pipelines_in_opposite_directions(self):
        # even micro-batches go down (stage s on rank s), odd ones up (stage s on rank 3 - s)
        self.assertExpectedInline(build_schedule("chimera_direct", 4, 4, 4).format(comms=False), """\
chimera_direct: 4 stages on 4 ranks, 4 micro-batches (rank 0: [0, 3]  rank 1: [1, 2]  rank 2: [1, 2]  rank 3: [0, 3])
step  rank 0  rank 1  rank 2  rank 3
0     0F0     1F0     1F1     0F1
1     0F2     2F1     2F0     0F3
2     3F1     1F2     1F3     3F0
3     3B1     2F3     2F2     3B0
4     3F3     2B1     2B0     3F2
5     3B3     1B0     1B1     3B2
6     0B0     2B3     2B2     0B1
7     0B2     1B2     1B3     0B3""")

    def test_1f1b_with_fewer_micro_batches_than_stages(self):
        # warm-up is capped at m: rank 0 runs both forwards first, torch's Schedule1F1B refuses m < p
        self.assertExpectedInline(build_schedule("1f1b", 3, 2, 3).format(comms=False), """\
1f1b: 3 stages on 3 ranks, 2 micro-batches (rank 0: [0]  rank 1: [1]  rank 2: [2])
step  rank 0  rank 1  rank 2
0     0F0     1F0     2F0
1     0F1     1F1     2B0
2     0B0     1B0     2F1
3     0B1     1B1     2B1""")


def test_actions_print_like_torch():
    assert [str(a) for a in (Action("F", 1, 3), Action("SEND_F", 0, 2, 1), Action("RECV_B", 2, 0, 3))] == [
        "1F3", "0SEND_F2", "2RECV_B0"]
    schedule = build_schedule("1f1b_interleaved", 8, 4, 4)
    assert schedule.stages_of(1) == (1, 5) and schedule.stages_of(3) == (3, 7)


def test_chimera_direct_halves_the_bubble_of_1f1b_and_holds_two_stages_per_rank():
    # F = 1, B = 2: with 4 micro-batches (Chimera's basic unit, N = D) 16 time units against 1F1B's 21
    bubbles = {}
    for m in (4, 8, 16):
        chimera, one_f_one_b = build_schedule("chimera_direct", 4, m, 4), build_schedule("1f1b", 4, m, 4)
        bubbles[m] = (simulate(chimera).bubble_fraction, simulate(one_f_one_b).bubble_fraction)
        assert simulate(chimera).makespan < simulate(one_f_one_b).makespan, m
    assert bubbles[4][0] <= 0.6 * bubbles[4][1], bubbles
    assert [chimera.stages_of(r) for r in range(4)] == [(0, 3), (1, 2), (1, 2), (0, 3)]
    assert chimera.ranks_of(0) == (0, 3) and chimera.rank_of(0, 1) == 3 and chimera.rank_of(2, 4) == 2


@pytest.mark.parametrize("p", [1, 2, 4])
@pytest.mark.parametrize("name", ["1f1b_plus", "gpipe", "infer_pipe"])
def test_an_all_device_first_stage_runs_its_collectives_in_one_order_on_every_rank(name, p):
    for m in _micro_batch_counts(p):
        schedule = build_schedule(name, p + 1, m, p, all_device_first=True)
        assert schedule.lanes == ((ALL,) + tuple(range(p)),) and schedule.ranks_of(0) == tuple(range(p))
        collectives = [[str(a) for a in actions if a.stage == 0 and a.kind in ("F", "B", "BCAST_B")]
                       for actions in schedule.actions]
        assert all(c == collectives[0] for c in collectives)
        assert collectives[0][:m] == [f"0F{mb}" for mb in range(m)] or name == "1f1b_plus"
        for actions in schedule.actions:    # no p2p to or from the all-device stage; BCAST_B right before 0B
            assert not any(a.kind in ("RECV_F", "SEND_B") and a.stage == 1 for a in actions)
            for i, a in enumerate(actions):
                if a.kind == "B" and a.stage == 0:
                    assert actions[i - 1].kind == "BCAST_B" and actions[i - 1].mb == a.mb


class TestAllDeviceFirstPrintout(expecttest.TestCase):
    def test_1f1b_plus_inserts_the_all_device_stage_around_stage_1(self):
        # nnScaler's picture: every rank runs the all-device segment's forward of a micro-batch just before
        # stage 1's forward of it, and its backward just after stage 1's backward
        self.assertExpectedInline(build_schedule("1f1b_plus", 3, 4, 2).format(comms=False), """\
1f1b_plus: 3 stages on 2 ranks, 4 micro-batches (rank 0: [0, 1]  rank 1: [0, 2])
step  rank 0  rank 1
0     0F0     0F0
1     1F0     0F1
2     0F1     2F0
3     1F1     2B0
4     1B0     2F1
5     0F2     2B1
6     0B0     0F2
7     1F2     0B0
8     1B1     2F2
9     0F3     2B2
10    0B1     0F3
11    1F3     0B1
12    1B2     2F3
13    0B2     2B3
14    1B3     0B2
15    0B3     0B3""")


def test_zb1p_stage_0_input_grad_sends_nothing():
    schedule = build_schedule("zb1p", 4, 4, 4)
    assert not any(a.kind == "SEND_B" and a.stage == 0 for a in schedule.actions[0])
    assert [str(a) for a in schedule.actions[3] if a.kind == "SEND_B"] == ["3SEND_B0", "3SEND_B1", "3SEND_B2",
                                                                         "3SEND_B3"]


@pytest.mark.parametrize("p", [2, 4, 8])
def test_bubbles_match_the_formulas(p):
    for m in (p, 2 * p, 4 * p):
        gpipe = simulate(build_schedule("gpipe", p, m, p))
        one_f_one_b = simulate(build_schedule("1f1b", p, m, p))
        assert gpipe.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
        assert one_f_one_b.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
        assert gpipe.makespan == one_f_one_b.makespan == 3 * (m + p - 1)
        assert simulate(build_schedule("infer_pipe", p, m, p)).bubble_fraction == pytest.approx(
            (p - 1) / (m + p - 1))
        for v in (1, 2, 4):
            # per-stage costs; a rank's v chunks together cost what one 1F1B stage would
            for f, b in ((1.0, 2.0), (1.0, 1.0)):
                interleaved = simulate(build_schedule("1f1b_interleaved", v * p, m, p), f=f, b=b)
                assert interleaved.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))
            assert simulate(build_schedule("infer_pipe", v * p, m, p)).bubble_fraction == pytest.approx(
                (p - 1) / (v * m + p - 1))
        # ZB-H1 with T_F = T_I = T_W: the idle time is exactly a third of 1F1B's (one (F+I+W) per hop
        # instead of three)
        zb = simulate(build_schedule("zb1p", p, m, p), f=1.0, b=2.0, w=1.0)
        assert sum(zb.idle) == pytest.approx(sum(one_f_one_b.idle) / 3)
        assert zb.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1))
        assert zb.busy == one_f_one_b.busy


def test_simulate_timeline_and_latency():
    schedule = build_schedule("1f1b", 2, 2, 2)
    result = simulate(schedule)
    assert [(start, end, str(a)) for start, end, a in result.timeline[1]] == [
        (1.0, 2.0, "1F0"), (2.0, 4.0, "1B0"), (4.0, 5.0, "1F1"), (5.0, 7.0, "1B1")]
    # the critical path 0F0 -> 1F0 1B0 1F1 1B1 -> 0B1 crosses between the ranks twice
    assert simulate(schedule, comm=0.5).makespan == result.makespan + 2 * 0.5
    with pytest.raises(ValueError, match="0 <= w <= b"):
        simulate(schedule, b=1.0, w=2.0)


@pytest.mark.parametrize("args, message", [
    (("pipedream", 2, 4, 2), "unknown pipeline schedule 'pipedream'; choose one of gpipe, 1f1b, "
                             "1f1b_interleaved, 1f1b_plus, chimera_direct, infer_pipe, zb1p"),
    (("chimera_direct", 4, 3, 4), "chimera_direct sends micro-batches down and up the pipeline in pairs"),
    (("chimera_direct", 2, 4, 2), "chimera_direct runs exactly 4 stages on 4 pipeline ranks"),
    (("gpipe", 2, 0, 2), "gpipe: nmicros must be a positive integer, got 0"),
    (("1f1b", 0, 4, 2), "1f1b: nstages must be a positive integer, got 0"),
    (("1f1b_interleaved", 6, 4, 4), "1f1b_interleaved: 6 stages cannot be spread evenly over 4 pipeline ranks; "
                                    "use a multiple of 4 stages"),
    (("gpipe", 4, 4, 2), "gpipe runs one stage per rank, but got 4 stages on 2 ranks; use nstages == nranks, "
                         "or '1f1b_interleaved' for 2 stages per rank"),
    (("zb1p", 8, 8, 4), "zb1p runs one stage per rank"),
    (("1f1b_interleaved", 4, 5, 2), "1f1b_interleaved with 2 stages per rank on 2 ranks switches stage every "
                                    "m // rounds micro-batches, with rounds = max(1, m // 2) = 2, so the number "
                                    "of micro-batches must be a multiple of 2; got nmicros=5. Use a multiple of 2 "
                                    "(nmicros=4 or 6), or nmicros <= 2"),
])
def test_invalid_configurations_say_what_to_change(args, message):
    with pytest.raises(ValueError) as info:
        build_schedule(*args)
    assert message in str(info.value)


def _two_ranks(rank0: str, rank1: str, nmicros: int) -> Schedule:
    """A hand-written 2-stage schedule; actions as "kind stage mb [peer]" separated by commas."""
    def parse(text: str) -> tuple[Action, ...]:
        actions = []
        for item in text.split(","):
            kind, *numbers = item.split()
            actions.append(Action(kind, *map(int, numbers)))
        return tuple(actions)
    return Schedule("hand", 2, nmicros, 2, ((0, 1),), (parse(rank0), parse(rank1)))


class TestRejections(expecttest.TestCase):
    def test_a_cyclic_wait_is_a_deadlock(self):
        # rank 0 waits for micro-batch 0's gradient before sending micro-batch 1's activation, while rank 1
        # runs micro-batch 1 first: each waits for the other
        schedule = _two_ranks(
            "F 0 0, SEND_F 0 0 1, RECV_B 0 0 1, B 0 0, F 0 1, SEND_F 0 1 1, RECV_B 0 1 1, B 0 1",
            "RECV_F 1 1 0, F 1 1, B 1 1, SEND_B 1 1 0, RECV_F 1 0 0, F 1 0, B 1 0, SEND_B 1 0 0", 2)
        with self.assertRaises(DeadlockError) as info:
            check_deadlock_free(schedule)
        self.assertExpectedInline(str(info.exception), """\
schedule 'hand' deadlocks (2 of 2 ranks cannot finish):
  rank 0 is stuck at step 3 (0B0): it waits for 1SEND_B0, step 7 of rank 1, which is stuck at step 1 (1F1)
  rank 1 is stuck at step 1 (1F1): it waits for 0SEND_F1, step 5 of rank 0, which is stuck at step 3 (0B0)""")

    def test_collectives_in_another_order_on_two_ranks_deadlock(self):
        def parse(text):
            return tuple(Action(k, int(st), int(mb)) for k, st, mb in (item.split() for item in text.split(",")))
        lanes = ((ALL, 0, 1),)
        schedule = Schedule("hand", 3, 2, 2, lanes, (
            parse("F 0 0, F 0 1, F 1 0, F 1 1") + (Action("SEND_F", 1, 0, 1), Action("SEND_F", 1, 1, 1)),
            parse("F 0 1, F 0 0") + (Action("RECV_F", 2, 0, 0), Action("RECV_F", 2, 1, 0)) + parse("F 2 0, F 2 1")))
        with self.assertRaises(DeadlockError) as info:
            check_deadlock_free(schedule)
        self.assertExpectedInline(str(info.exception), """\
schedule 'hand' deadlocks (2 of 2 ranks cannot finish):
  rank 0 is stuck at step 0 (0F0), a collective of every rank: rank 1 at 0F1
  rank 1 is stuck at step 0 (0F1), a collective of every rank: rank 0 at 0F0""")

    def test_a_missing_backward_is_incomplete(self):
        schedule = _two_ranks("F 0 0, SEND_F 0 0 1, RECV_B 0 0 1, B 0 0",
                              "RECV_F 1 0 0, F 1 0", 1)
        with self.assertRaises(ScheduleError) as info:
            check_deadlock_free(schedule)
        self.assertExpectedInline(str(info.exception), """\
schedule 'hand' is incomplete:
  stage 1 micro-batch 0 has 0 B, 0 I, 0 W; it needs one B, or one I and one W""")

    def test_unmatched_and_misdirected_messages(self):
        # rank 1 never receives the activation that rank 0 sends
        schedule = _two_ranks("F 0 0, SEND_F 0 0 1, RECV_B 0 0 1, B 0 0",
                              "F 1 0, B 1 0, SEND_B 1 0 0", 1)
        with self.assertRaises(ScheduleError) as info:
            check_deadlock_free(schedule)
        self.assertExpectedInline(str(info.exception), """\
schedule 'hand' has unmatched or out-of-order actions:
  rank 1 step 0: 1F0 consumes 1RECV_F0, which is not posted before it on rank 1
  message 0SEND_F0 has 1 send(s) and 0 receive(s)""")
        # the activation is sent to the wrong rank
        schedule = _two_ranks("F 0 0, SEND_F 0 0 0, RECV_B 0 0 1, B 0 0",
                              "RECV_F 1 0 0, F 1 0, B 1 0, SEND_B 1 0 0", 1)
        with self.assertRaises(ScheduleError) as info:
            check_deadlock_free(schedule)
        self.assertExpectedInline(str(info.exception), """\
schedule 'hand' has misplaced actions:
  rank 0 step 1 (0SEND_F0): the peer must be rank 1 (stage 1), not 0""")
        # the receive is posted after the forward that needs it
        schedule = _two_ranks("F 0 0, SEND_F 0 0 1, RECV_B 0 0 1, B 0 0",
                              "F 1 0, RECV_F 1 0 0, B 1 0, SEND_B 1 0 0", 1)
        with self.assertRaises(ScheduleError) as info:
            check_deadlock_free(schedule)
        self.assertExpectedInline(str(info.exception), """\
schedule 'hand' has unmatched or out-of-order actions:
  rank 1 step 0: 1F0 consumes 1RECV_F0, which is not posted before it on rank 1
  rank 1 step 1: 1RECV_F0 is never consumed""")


@pytest.mark.parametrize("p, k", [(2, 2), (4, 2), (2, 3), (4, 3)])
def test_interleaved_order_matches_torch(p, k):
    """torch's ScheduleInterleaved1F1B (which nnScaler's sched_1f1b_interleaved copies) is the reference."""
    for m in sorted({1, 3, p, 2 * p, 3 * p}):
        if m > p and m % (m // p):
            continue
        ours = build_schedule("1f1b_interleaved", k * p, m, p)
        theirs = compat.torch_pipeline_compute_order("Interleaved1F1B", p, m, stages_per_rank=k)
        assert [[(a.kind, a.stage, a.mb) for a in ours.compute_actions(r)] for r in range(p)] == theirs, (p, k, m)
