"""A parity worker's loop: the units train on their rows of each global batch while one process trains on the
whole batch, step for step, so that the two can be compared (:mod:`parity`)."""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

import dynshard

Rows = tuple[torch.Tensor, ...]


def unit_rows(batch: Sequence[torch.Tensor], units: int) -> list[Rows]:
    """Each unit's rows of a global ``batch`` (tensors of one leading dimension), in unit order."""
    size = batch[0].shape[0] // units
    return [tuple(t[u * size:(u + 1) * size] for t in batch) for u in range(units)]


def one_process_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Callable[[list[Rows]], float]:
    """One process's step on the units' rows: their losses averaged as data parallelism averages the units'
    (each unit's batch has its own count of targets), backward, the optimizer's step."""
    def step(units: list[Rows]) -> float:
        loss = sum(model(*rows) for rows in units) / len(units)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.float().item()
    return step


def train_beside_one_process(compiled: Callable, opt: torch.optim.Optimizer, reference_step: Callable[[list[Rows]], float],
                             batches: Iterable[Sequence[torch.Tensor]], plan_ngpus: int) -> tuple[list[float], list[float]]:
    """Per-step losses of ``compiled`` (this unit's rows through it, ``opt``'s step; the mean over the ranks)
    and of ``reference_step`` on the same global batches."""
    dp_rank, dp_size = dynshard.data_parallel_rank(plan_ngpus)
    losses, ref_losses = [], []
    for batch in batches:
        units = unit_rows(batch, dp_size)
        loss = compiled(*units[dp_rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())   # (the group exists once the backend ran)
        ref_losses.append(reference_step(units))
    return losses, ref_losses
