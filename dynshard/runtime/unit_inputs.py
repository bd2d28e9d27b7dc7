"""The ranks of a plan unit must be fed the same batch; a run where they are not trains silently wrong.

nnScaler's data convention: the ranks of one plan unit read the same batch (they split the model, or the
batch, between them) and units are data-parallel replicas. A user coming from DDP who keeps
``DistributedSampler(dataset)`` over the whole world feeds each rank of a unit a different batch, and
nothing in the step fails: tp's collectives sum partial results of different inputs. So the ranks compare
a digest of every user input on a program's first call and then every ``verify_inputs_every``-th call,
and all raise where the ranks of any unit differ.

A program that draws random numbers (dropout) needs one more thing to be the same on the ranks that hold
its values: the random generator's state. Each rank draws a value it holds whole (a residual stream's
dropout mask) or split (:mod:`dynshard.passes.random_draws`) from its own generator; ranks seeded apart
(nanoGPT's ``torch.manual_seed(1337 + rank)``) drop different positions of one replicated value, and its
replicas, then the parameters they train, drift apart with nothing failing. So the generator's state is
compared with the inputs, among the ranks of a unit that run the same program (a pipeline's stages draw
apart by design).

The digest of a tensor is two float64 numbers: the sum of its elements and the sum of its rows' sums
weighted by position (another batch, or the same rows in another order, changes it), reduced without a
converted copy of the input. One all-gather of these numbers over the world per check: every rank sees
every unit, so every rank raises.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

FIX = ("The ranks of one plan unit must read the same batch: give the sampler the data-parallel rank and "
       "size, `dp_rank, dp_size = dynshard.data_parallel_rank(plan_ngpus)` and "
       "`DistributedSampler(dataset, num_replicas=dp_size, rank=dp_rank)`, not the world's rank. "
       "(Config.verify_inputs_every / DYNSHARD_VERIFY_INPUTS_EVERY=0 switches this check off.)")
RANDOM_FIX = ("Seed the ranks of a plan unit alike before the first step, `torch.manual_seed(seed + dp_rank)` with "
              "`dp_rank, _ = dynshard.data_parallel_rank(plan_ngpus)` (units may differ, as their batches do), and "
              "draw random numbers outside the model alike on them too (not on rank 0 only). "
              "(Config.verify_inputs_every / DYNSHARD_VERIFY_INPUTS_EVERY=0 switches this check off.)")


class UnitInputMismatchError(RuntimeError):
    """The ranks of a plan unit were fed different inputs; raised on every rank."""


def digest(tensor: torch.Tensor) -> torch.Tensor:
    """Two float64 numbers that differ, in practice, wherever the tensor's values or row order differ."""
    rows = tensor.detach().reshape(tensor.shape[0] if tensor.dim() else 1, -1)
    if rows.dtype.is_complex:
        rows = torch.view_as_real(rows).flatten(1)
    sums = rows.sum(1, dtype=torch.float64).nan_to_num(nan=1.5e300, posinf=1e300, neginf=-1e300)
    weights = torch.arange(1, sums.numel() + 1, dtype=torch.float64, device=sums.device)
    return torch.stack([sums.sum(), (sums * weights).sum()])


def _collective_device() -> torch.device:
    """Where the default group's collectives take tensors (NCCL: the current GPU)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def generator_state(device_type: str) -> Callable[[], torch.Tensor]:
    """The state of the generator a program on ``device_type`` draws from (Inductor's seeds included)."""
    if device_type == "cuda":
        return lambda: torch.cuda.get_rng_state(torch.cuda.current_device())
    return torch.get_rng_state


class InputCheck:
    """Per program: counts its calls and checks the unit's inputs (and the generator's state, where it draws
    random numbers) on the first and every N-th one."""

    def __init__(self, names: Sequence[str], indices: Sequence[int], plan_ngpus: int, every: int,
                 random_state: Callable[[], torch.Tensor] | None, peers: int,
                 group: dist.ProcessGroup | None = None, first_rank: int = 0):
        self.names, self.indices = list(names), list(indices)
        # the ranks compared: the unit's (its group; ``first_rank`` its first), or the job's (group None)
        self.group, self.first_rank = group, first_rank
        self.plan_ngpus, self.every = plan_ngpus, every
        self.random_state = random_state
        self.peers = peers       # the consecutive ranks that run one program (and draw alike)
        self.calls = 0
        self.checks = 0

    @classmethod
    def for_program(cls, inputs, layout, every: int, draws_random: bool) -> "InputCheck | None":
        """None where there is nothing to compare: units of one rank, no user input and no random draw that
        several ranks run alike, or checks off. ``draws_random``: the program has a random op, drawn alike by
        each group of ``layout.tp_size`` ranks (a unit, or one stage of a pipeline's)."""
        # (split values, DTensors another program returned, differ between the ranks by design)
        user = [inp for inp in inputs if inp.kind == "input" and not inp.is_split_value]
        random_state = generator_state(layout.device_type) if draws_random and layout.tp_size > 1 else None
        if every <= 0 or layout.plan_ngpus <= 1 or not (user or random_state) or not dist.is_initialized():
            return None
        # a unit of tp ranks compares over its own group: a unit may run a program the others do not (one it
        # compiled alone, see backend.families); a pipeline's unit has no group of its own, and compiles together
        unit = layout.tp_mesh.get_group() if layout.pp_size == 1 and layout.tp_mesh is not None else None
        return cls([inp.name for inp in user], [inp.index for inp in user], layout.plan_ngpus, every, random_state,
                   layout.tp_size, unit, layout.rank - layout.tp_rank if unit is not None else 0)

    def __call__(self, args: Sequence[Any]) -> None:
        due = self.calls % self.every == 0
        self.calls += 1
        if due:
            self.check(args)

    def check(self, args: Sequence[Any]) -> None:
        self.checks += 1
        values = [args[i] for i in self.indices]
        if self.random_state is not None:
            values.append(self.random_state())
        local = [digest(v).cpu() for v in values]
        mine = torch.stack(local).flatten().to(_collective_device())
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(gathered, mine, group=self.group)
        digests = [g.cpu().view(-1, 2) for g in gathered]
        if self.random_state is not None:
            self._raise_on_random_mismatch([d[-1:] for d in digests])
            digests = [d[:-1] for d in digests]
        self._raise_on_mismatch(digests)

    def _raise_on_random_mismatch(self, digests: list[torch.Tensor]) -> None:
        for first, rank in _differing(digests, self.peers):
            first, rank = first + self.first_rank, rank + self.first_rank
            raise UnitInputMismatchError(
                f"dynshard: ranks {first} and {rank} of plan unit {first // self.plan_ngpus} run one program that "
                f"draws random numbers (dropout), but the random generator's state differs between them (call #{self.calls} of "
                f"this program): they would drop different positions of the values they hold alike, and their "
                f"replicas, then the parameters trained from them, would drift apart. {RANDOM_FIX}")

    def _raise_on_mismatch(self, digests: list[torch.Tensor]) -> None:
        for first, rank in _differing(digests, self.plan_ngpus):
            name = self.names[int((~_same(digests[rank], digests[first])).nonzero()[0])]
            first, rank = first + self.first_rank, rank + self.first_rank
            raise UnitInputMismatchError(
                f"dynshard: ranks {first} and {rank} of plan unit {first // self.plan_ngpus} "
                f"(plan_ngpus={self.plan_ngpus}) were fed different values for input {name!r} "
                f"(call #{self.calls} of this program), so every step would train on a mix of two "
                f"batches. {FIX}")


def _same(digest: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    return torch.isclose(digest, other, rtol=1e-9, atol=0, equal_nan=True).all(1)


def _differing(digests: list[torch.Tensor], group: int):
    """(first rank, rank) of each group of ``group`` consecutive ranks whose digests differ from the first's."""
    for first in range(0, len(digests), group):
        for rank in range(first + 1, min(first + group, len(digests))):
            if not bool(_same(digests[rank], digests[first]).all()):
                yield first, rank
