"""DDP's ``broadcast_buffers`` for dynshard: buffers a program writes stay equal over the data-parallel
replicas.

A buffer a program writes from its batch (BatchNorm's running statistics) would drift apart between
data-parallel units, each updating it from its own batch: evaluation would then differ by rank and a
checkpoint would depend on the rank that wrote it. DDP broadcasts rank 0's buffers before each forward.
dynshard broadcasts, from the first unit, the buffers a call wrote, right after that call: every replica
then holds the first replica's values at all times (after training as well as before each step), and a
call that writes nothing (evaluation, a model without such buffers) sends nothing. What a call wrote is
read from the buffers' version counters, which the same program bumps the same way on every rank.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist


class BufferSync:
    """The buffers of one program, and the broadcast of those a call wrote over the data-parallel group
    (counted: ``broadcasts``, ``bytes``)."""

    def __init__(self, indices: Sequence[int], group: Any):
        self.indices, self.group = list(indices), group
        self.src = dist.get_global_rank(group, 0)
        self.broadcasts = 0
        self.bytes = 0

    @classmethod
    def for_inputs(cls, inputs, dp_group: Any, enabled: bool) -> "BufferSync | None":
        buffers = [inp.index for inp in inputs if inp.kind == "buffer"]
        if not enabled or dp_group is None or not buffers:
            return None
        return cls(buffers, dp_group)

    def versions(self, args: Sequence[Any]) -> list[int]:
        return [args[i]._version for i in self.indices]

    def after_call(self, args: Sequence[Any], before: list[int]) -> None:
        """Broadcast the buffers whose version changed since ``before``: one message of their bytes per
        device (BatchNorm's float statistics and its int64 count travel together)."""
        written = [args[i] for i, version in zip(self.indices, before) if args[i]._version != version]
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for buffer in written:
            if buffer.numel():
                by_device.setdefault(buffer.device, []).append(buffer)
        with torch.no_grad():
            for buffers in by_device.values():
                buffers.sort(key=lambda b: -b.element_size())     # each piece starts aligned to its dtype
                flat = torch.cat([b.reshape(-1).view(torch.uint8) for b in buffers])
                dist.broadcast(flat, src=self.src, group=self.group)
                offset = 0
                for buffer in buffers:
                    size = buffer.numel() * buffer.element_size()
                    buffer.copy_(flat[offset:offset + size].view(buffer.dtype).view_as(buffer))
                    offset += size
                self.broadcasts += 1
                self.bytes += flat.numel()
