"""Programs of a family every rank has agreed on are compiled alone, with no message to the other ranks.

Dynamo compiles a frame again on one rank only when only that rank's batch leaves the frame's guards: a
batch of one row (Dynamo keeps sizes 0 and 1 out of a symbolic family), a length past a guard. A dynshard
compile communicates (the plan key's agreement, rank 0's plan), so that rank would wait at it for ranks that
are inside their step, waiting for its gradients.

Where a plan unit is one rank (dp, ZeRO 1-3), what crosses ranks is the parameters' gradients and shards,
which the batch's sizes do not change. Where it is several (tp, sequence parallel, ``data``, styles), what
crosses units is the same, and the unit's ranks read one batch, so they leave the frame's guards at the same
call and compile together: what is alone then is the unit, whose ranks plan alike (the policy decides by the
graph and its sizes, which they share) and tell each other only whether the program on symbols succeeded
(``plan_and_compile``). The collectives checked are the ones that cross units; a unit's own (tp's, which
carry activations: their bytes follow the sizes) are the unit's ranks' alike. A program's *family* is what
decides its plan and cross-unit collectives without the sizes: the frame Dynamo compiles, the config, the grad/autocast modes, the parameters and
buffers, and the user inputs' names, kinds, dtypes and ranks (not their sizes, nor the size inputs a
symbolic graph has).

- The first program of a family is compiled as every program is: the ranks agree on its key and rank 0
  sends the plan. Every rank then records the family at the same compile, so every rank sends the same
  later compiles alone.
- A later program of a recorded family is planned by the policy on its own rank and compiled, with no
  message, and checked against the family's first program on that rank: the same placements of the
  parameters and buffers, and the same collectives in the same order (phase, kind, group, bytes). The
  backward's are checked when it is compiled, at its first call, before it runs. A difference raises
  :class:`AloneCompileError` on that rank before any of its collectives runs (the others are then inside
  their step, and see their collective fail when this rank exits).
- A plan from a file, autodist's search or a planner comes from rank 0: those compiles always agree.
- The family's first programs may differ in size across ranks too (each rank pads its own rows and Dynamo
  compiles the first call static at its sizes): the ranks agree on the family, each plans its own program
  with no message, and the ranks compare what their collectives carry (the state's placements and the
  forward's collectives at the compile, the backward's when it is compiled, all at the same step) with one
  all-gather of a digest each: :func:`check_together`.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Sequence

import torch

from .. import compat
from ..config import Config
from ..runtime.graph_inputs import GraphInput
from ..runtime.mesh import Layout
from .agreement import PlanMismatchError, ensure_ranks_communicate_alike
from .plan_cache import modes_token


log = logging.getLogger("dynshard")


class AloneCompileError(PlanMismatchError):
    """A program compiled alone would not issue the collectives its family's first program issues."""


def family_key(inputs: Sequence[GraphInput], config: Config) -> str | None:
    """The family of a graph's programs, or None where its plan comes from rank 0 (a plan file, autodist,
    a planner): what decides a unit of one rank's plan and collectives, without the batch's sizes."""
    if config.load_plan_path or not isinstance(config.policy, str) or config.policy == "autodist":
        return None
    described = []       # (in no order: Dynamo puts a symbolic graph's parameters before its inputs)
    for inp in inputs:
        if inp.is_state or inp.is_split_value or inp.tag is not None:
            described.append(inp.token())
        elif inp.kind != "size":
            described.append(f"{inp.kind}:{inp.name}:{inp.dtype}:{len(inp.shape)}:{inp.requires_grad}")
    parts = [str(compat.dynamo_frame_id()), config.cache_token(), torch.__version__, modes_token(), *sorted(described)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def recorded_for(layout: Layout, outline) -> bool:
    """Whether a program of this layout can be compiled alone (by a rank, or a unit's ranks together): no
    pipeline (a stage's graph is traced again per micro-batch, at its plan's inputs)."""
    return layout.world_size > 1 and outline.pipeline is None


def check_alone(compiled, family, family_index: int) -> None:
    """``compiled`` (a CompiledPlan made alone) against ``family``'s first program on this rank: the state's
    placements now, the collectives of each phase now and when a later phase (the backward) is compiled."""
    mine, theirs = _state_choices(compiled, compiled.plan), _state_choices(compiled, family.plan)
    if mine != theirs:
        first = next((n for n in sorted(set(mine) | set(theirs)) if mine.get(n) != theirs.get(n)), "?")
        _refuse(compiled, family_index, f"it places {first} as {mine.get(first)}, the family's first program as "
                                        f"{theirs.get(first)}")
    program = compiled.program

    def check(phase: str) -> None:
        got = _sequence(program.collectives, phase, compiled.layout)
        want = _sequence(family.program.collectives, phase, compiled.layout)
        if phase == "backward" and "backward" not in family.program.graphs:
            # (the first program has not run a backward: this one's backward is the family's from now on)
            log.warning("dynshard: rank %d compiled a program alone whose backward cannot be checked: its family's "
                        "first program has not run a backward", compiled.layout.rank)
            family.program.graphs["backward"] = program.graphs["backward"]
            family.program.collectives.extend(c for c in program.collectives if c.phase == "backward")
            return
        if got != want:
            at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            _refuse(compiled, family_index, f"its {phase} issues {len(got)} collectives, the family's first "
                                            f"program {len(want)}; the first difference is #{at}: "
                                            f"{_describe(got, at)} against {_describe(want, at)}")

    for phase in program.graphs:
        check(phase)
    program.on_collectives = check


def check_together(compiled) -> None:
    """The first programs of a family the ranks planned on their own, at their own sizes, against each other:
    the state's placements and each phase's collectives, compared across ranks when the phase is compiled."""
    placements = sorted((name, str(choice)) for name, choice in _state_choices(compiled, compiled.plan).items())
    program = compiled.program

    def check(phase: str) -> None:
        ensure_ranks_communicate_alike(f"the {phase}'s collectives",
                                       lambda: repr(_sequence(program.collectives, phase, compiled.layout)))

    ensure_ranks_communicate_alike("the parameters' and buffers' placements", lambda: repr(placements))
    for phase in program.graphs:
        check(phase)
    program.on_collectives = check


def _state_choices(compiled, plan) -> dict:
    """``plan``'s choices for the parameters and buffers of ``compiled``'s graph, by name."""
    state = {inp.name for inp in compiled.inputs if inp.is_state}
    return {name: choice for name, choice in plan.tensors.items() if name in state}


def _sequence(collectives, phase: str, layout: Layout) -> list[tuple[str, str, int]]:
    """A phase's collectives that cross units (a unit's own are its ranks' alike, at sizes units differ in)."""
    return [(c.kind, c.group, c.bytes) for c in collectives if c.phase == phase and c.group not in layout.placement_dims]


def _describe(sequence: list[tuple[str, str, int]], at: int) -> str:
    if at >= len(sequence):
        return "none"
    kind, group, nbytes = sequence[at]
    return f"{kind} of {nbytes} bytes over {group!r}"


def _refuse(compiled, family_index: int, what: str) -> None:
    raise AloneCompileError(
        f"dynshard: rank {compiled.layout.rank} compiled a new program of a graph alone (Dynamo compiled the frame again "
        f"for this rank's (or unit's) batch only: a batch of one row, or a size outside its guards), from the family every "
        f"rank agreed on at compile #{family_index}, and it would not communicate as that family does: {what}. "
        "The other ranks' collectives would not match. Keep the model's code path the same for every batch size "
        "(no Python branch on a size), or give every rank batches of the same sizes (drop_last=True for the "
        "ragged last batch; a collator's pad_to_multiple_of)")
