"""Checkpoint directories: atomic publication and finding the newest complete one.

A save writes into ``<path>.tmp-<uuid>`` (rank 0 picks the name and broadcasts it). Once every rank has
written, rank 0 renames an existing ``<path>`` to ``<path>.old-<uuid>``, renames the new directory to
``<path>``, writes its ``COMPLETE`` marker, and then removes ``<path>.old-*`` and ``<path>.tmp-*``
(leftovers of this save and of killed ones). While ``<path>`` is missing or has no marker,
:func:`latest` and :func:`resolve` fall back to the newest complete ``<path>.old-*``, so at every
instant of a save over an existing checkpoint a complete one is found. A save to a new path killed
midway leaves a ``.tmp-`` directory, or ``<path>`` without the marker, which :func:`latest` skips.
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


def _write_marker(path: str) -> None:
    with open(os.path.join(path, COMPLETE), "w") as f:
        f.write("ok\n")
        f.flush()
        os.fsync(f.fileno())


def _leftovers(path: str) -> list[str]:
    """``<path>.tmp-*`` and ``<path>.old-*``: what saves to ``path`` leave until the next one completes."""
    parent, base = os.path.split(path)
    parent = parent or os.curdir
    if not os.path.isdir(parent):
        return []
    return [os.path.join(parent, n) for n in os.listdir(parent) if n.startswith((base + _TMP, base + _OLD))]


def publish(tmp: str, path: str) -> None:
    """Every rank has written ``tmp``: make it ``path``, complete. Collective."""
    barrier()
    if is_coordinator():
        path = os.fspath(path).rstrip(os.sep)
        if os.path.exists(path):          # replacing a checkpoint: move it aside first (rename is atomic)
            os.replace(path, f"{path}{_OLD}{uuid.uuid4().hex[:12]}")
        os.replace(tmp, path)
        _write_marker(path)
        for leftover in _leftovers(path):
            shutil.rmtree(leftover, ignore_errors=True)
    barrier()


def _has_marker(path: str) -> bool:
    return os.path.isfile(os.path.join(path, COMPLETE))


def is_complete(path: str) -> bool:
    name = os.path.basename(os.fspath(path).rstrip(os.sep))
    return _TMP not in name and _OLD not in name and _has_marker(path)


def _complete_or_replaced(path: str) -> str | None:
    """``path`` if it is complete, else the newest complete ``<path>.old-*`` (the checkpoint a save over
    ``path`` moved aside before it was killed), else None."""
    if is_complete(path):
        return path
    old = [p for p in _leftovers(path) if _OLD in os.path.basename(p) and _has_marker(p)]
    return max(old, key=lambda p: os.stat(os.path.join(p, COMPLETE)).st_mtime_ns, default=None)


def resolve(path: str) -> str:
    """The directory to read for ``path``: ``path`` itself if it exists, else the checkpoint a killed save
    over it moved aside (if any)."""
    path = os.fspath(path).rstrip(os.sep)
    if os.path.exists(path):
        return path
    return _complete_or_replaced(path) or path


def _step(name: str) -> int | None:
    numbers = re.findall(r"\d+", name)
    return int(numbers[-1]) if numbers else None


def latest(root: str) -> str | None:
    """The newest complete checkpoint directory under ``root`` (by the last number in its name when every
    candidate has one, else by modification time), or None. Partial saves are skipped; where a save over a
    checkpoint was killed, the checkpoint it moved aside (``<name>.old-*``) stands for ``<name>``."""
    if not os.path.isdir(root):
        return None
    names = {n.rpartition(_OLD)[0] if _OLD in n else n for n in os.listdir(root) if _TMP not in n}
    candidates = {n: _complete_or_replaced(os.path.join(root, n)) for n in names}
    candidates = {n: c for n, c in candidates.items() if c is not None}
    if not candidates:
        return None
    steps = {n: _step(n) for n in candidates}
    if all(s is not None for s in steps.values()):
        return candidates[max(candidates, key=lambda n: (steps[n], n))]
    return max(candidates.values(), key=lambda c: os.path.getmtime(os.path.join(c, COMPLETE)))
