"""Checkpoint directories: atomic publication and finding the newest complete one.

A save writes into ``<path>.tmp-<uuid>`` (rank 0 picks the name and broadcasts it); once every rank has
written, rank 0 renames it to ``<path>`` and then writes a ``COMPLETE`` marker. A job killed mid-save
leaves a ``.tmp-`` directory (or one without the marker), which :func:`latest` skips.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid

import torch.distributed as dist

COMPLETE = "COMPLETE"
_TMP = ".tmp-"
_OLD = ".old-"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def is_coordinator() -> bool:
    return not _distributed() or dist.get_rank() == 0


def barrier() -> None:
    if _distributed():
        dist.barrier()


def temporary_dir(path: str) -> str:
    """The directory this save writes into, the same on every rank."""
    name = [f"{os.fspath(path).rstrip(os.sep)}{_TMP}{uuid.uuid4().hex[:12]}" if is_coordinator() else None]
    if _distributed():
        dist.broadcast_object_list(name, src=0)
    return name[0]


def publish(tmp: str, path: str) -> None:
    """Every rank has written ``tmp``: make it ``path``, complete. Collective."""
    barrier()
    if is_coordinator():
        path = os.fspath(path).rstrip(os.sep)
        old = None
        if os.path.exists(path):          # replacing a checkpoint: move it aside first (rename is atomic)
            old = f"{path}{_OLD}{uuid.uuid4().hex[:12]}"
            os.replace(path, old)
        os.replace(tmp, path)
        marker = os.path.join(path, COMPLETE)
        with open(marker, "w") as f:
            f.write("ok\n")
            f.flush()
            os.fsync(f.fileno())
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    barrier()


def is_complete(path: str) -> bool:
    name = os.path.basename(os.fspath(path).rstrip(os.sep))
    return _TMP not in name and _OLD not in name and os.path.isfile(os.path.join(path, COMPLETE))


def _step(name: str) -> int | None:
    numbers = re.findall(r"\d+", name)
    return int(numbers[-1]) if numbers else None


def latest(root: str) -> str | None:
    """The newest complete checkpoint directory under ``root`` (by the last number in its name when every
    candidate has one, else by modification time), or None. Partial saves are skipped."""
    if not os.path.isdir(root):
        return None
    candidates = [os.path.join(root, n) for n in os.listdir(root)]
    candidates = [c for c in candidates if os.path.isdir(c) and is_complete(c)]
    if not candidates:
        return None
    steps = [_step(os.path.basename(c)) for c in candidates]
    if all(s is not None for s in steps):
        return max(zip(steps, candidates))[1]
    return max(candidates, key=lambda c: os.path.getmtime(os.path.join(c, COMPLETE)))
