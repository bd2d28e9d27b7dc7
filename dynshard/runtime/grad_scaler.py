"""Loss scaling for fp16 that sees every shard: an inf on any rank skips the step on every rank.

dynshard's ranks hold different gradient elements (tp shards, ZeRO rows), so a plain
``torch.amp.GradScaler`` could find an inf on one rank only and step the others. torch's
``ShardedGradScaler`` all-reduces ``found_inf`` over its process group; with none given it uses the
default group at the time it unscales, i.e. every rank of the job.
"""

from __future__ import annotations

from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler


def GradScaler(device: str = "cuda", **kwargs) -> ShardedGradScaler:  # noqa: N802 (torch's class name)
    """``torch.amp.GradScaler``'s arguments; ``found_inf`` agreed over all ranks."""
    kwargs.setdefault("process_group", None)
    return ShardedGradScaler(device=device, **kwargs)
