"""The ranks of a plan unit must be fed the same batch; a run where they are not trains silently wrong.

nnScaler's data convention: the ranks of one plan unit read the same batch (they split the model, or the
batch, between them) and units are data-parallel replicas. A user coming from DDP who keeps
``DistributedSampler(dataset)`` over the whole world feeds each rank of a unit a different batch, and
nothing in the step fails: tp's collectives sum partial results of different inputs. So the ranks compare
a digest of every user input on a program's first call and then every ``verify_inputs_every``-th call,
and all raise where the ranks of any unit differ.

The digest of a tensor is two float64 numbers: the sum of its elements and the sum of its rows' sums
weighted by position (another batch, or the same rows in another order, changes it), reduced without a
converted copy of the input. One all-gather of these numbers over the world per check: every rank sees
every unit, so every rank raises.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

FIX = ("The ranks of one plan unit must read the same batch: give the sampler the data-parallel rank and "
       "size, `dp_rank, dp_size = dynshard.data_parallel_rank(plan_ngpus)` and "
       "`DistributedSampler(dataset, num_replicas=dp_size, rank=dp_rank)`, not the world's rank. "
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


class InputCheck:
    """Per program: counts its calls and checks the unit's inputs on the first and every N-th one."""

    def __init__(self, names: Sequence[str], indices: Sequence[int], plan_ngpus: int, every: int):
        self.names, self.indices = list(names), list(indices)
        self.plan_ngpus, self.every = plan_ngpus, every
        self.calls = 0
        self.checks = 0

    @classmethod
    def for_inputs(cls, inputs, plan_ngpus: int, every: int) -> "InputCheck | None":
        """None where there is nothing to compare: units of one rank, no user input, or checks off."""
        # (split values, DTensors another program returned, differ between the ranks by design)
        user = [inp for inp in inputs if inp.kind == "input" and not inp.is_split_value]
        if every <= 0 or plan_ngpus <= 1 or not user or not dist.is_initialized():
            return None
        return cls([inp.name for inp in user], [inp.index for inp in user], plan_ngpus, every)

    def __call__(self, args: Sequence[Any]) -> None:
        due = self.calls % self.every == 0
        self.calls += 1
        if due:
            self.check(args)

    def check(self, args: Sequence[Any]) -> None:
        self.checks += 1
        values = [args[i] for i in self.indices]
        local = [digest(v).cpu() for v in values]
        mine = torch.stack(local).flatten().to(_collective_device())
        world = dist.get_world_size()
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)
        self._raise_on_mismatch([g.cpu().view(-1, 2) for g in gathered])

    def _raise_on_mismatch(self, digests: list[torch.Tensor]) -> None:
        for first in range(0, len(digests), self.plan_ngpus):
            for rank in range(first + 1, min(first + self.plan_ngpus, len(digests))):
                same = torch.isclose(digests[rank], digests[first], rtol=1e-9, atol=0, equal_nan=True).all(1)
                if not bool(same.all()):
                    name = self.names[int((~same).nonzero()[0])]
                    raise UnitInputMismatchError(
                        f"dynshard: ranks {first} and {rank} of plan unit {first // self.plan_ngpus} "
                        f"(plan_ngpus={self.plan_ngpus}) were fed different values for input {name!r} "
                        f"(call #{self.calls} of this program), so every step would train on a mix of two "
                        f"batches. {FIX}")
