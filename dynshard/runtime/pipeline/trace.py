"""Chrome traces of pipeline steps (``Config.trace_dir``), and the idle fraction they show.

Each rank records, per step, spans of its compute actions (forward, backward) and of the time it waits
for a receive or for its sends; the rest of the step is idle. The file is Chrome's trace-event JSON,
which Perfetto (ui.perfetto.dev) and chrome://tracing open: one process per rank, one row per kind.
"""

from __future__ import annotations

import atexit
import json
import os
import time

import torch.distributed as dist

_ROWS = {"forward": 0, "backward": 0, "recv": 1, "send": 1, "step": 2}
_MAX_EVENTS = 200_000
_WRITERS: dict[str, "TraceWriter"] = {}
_EVERY_STEP, _LATER_EVERY = 20, 50     # the file is rewritten after each of the first steps, then every 50


class StepTrace:
    """The spans of one step on this rank (times in microseconds since the step began)."""

    def __init__(self, step: int):
        self.step = step
        self.start = time.perf_counter()
        self.spans: list[tuple[str, str, float, float]] = []   # (category, name, begin, end)

    def now(self) -> float:
        return (time.perf_counter() - self.start) * 1e6

    def span(self, category: str, name: str, begin: float) -> None:
        self.spans.append((category, name, begin, self.now()))

    def busy(self) -> float:
        return sum(end - begin for category, _, begin, end in self.spans if category in ("forward", "backward"))


def idle_fraction(trace: StepTrace, wall: float | None = None) -> float:
    """1 - compute time / the step's wall time, for this rank."""
    wall = trace.now() if wall is None else wall
    return 1.0 - trace.busy() / wall if wall > 0 else 0.0


def writer_for(directory: str) -> "TraceWriter":
    """The writer of this process's trace file in ``directory`` (one file for all its pipelines)."""
    if directory not in _WRITERS:
        _WRITERS[directory] = TraceWriter(directory)
        atexit.register(_WRITERS[directory].write)
    return _WRITERS[directory]


class TraceWriter:
    """Keeps the steps of this process and rewrites its trace file (after each of the first 20 steps, then
    every 50, and at exit)."""

    def __init__(self, directory: str):
        self.directory = directory
        self.events: list[dict] = []
        self.steps = 0
        self.origin = time.perf_counter()
        self.rank = 0

    def add(self, trace: StepTrace, wall: float) -> None:
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        offset = (trace.start - self.origin) * 1e6
        for category, name, begin, end in trace.spans:
            self.events.append({"name": name, "cat": category, "ph": "X", "ts": offset + begin, "dur": end - begin,
                                "pid": self.rank, "tid": _ROWS[category]})
        self.events.append({"name": f"step {trace.step} (idle {idle_fraction(trace, wall):.1%})", "cat": "step",
                            "ph": "X", "ts": offset, "dur": wall, "pid": self.rank, "tid": _ROWS["step"]})
        del self.events[:-_MAX_EVENTS]
        self.steps += 1
        if self.steps <= _EVERY_STEP or self.steps % _LATER_EVERY == 0:   # rewriting costs O(events)
            self.write()

    def write(self) -> None:
        if not self.events:
            return
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory, f"dynshard_trace_rank{self.rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"traceEvents": self.events, "displayTimeUnit": "ms"}, f)
        os.replace(path + ".tmp", path)
