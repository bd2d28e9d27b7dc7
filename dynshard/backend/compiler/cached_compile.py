"""A program compiled through aot_autograd's cache, and dynshard's records of its traced graphs kept beside
the entry: a hit loads the traced and partitioned program, and what dynshard learned from its graphs
(explain's collectives, code and saved bytes) is read back under the entry's key. The key tells dynshard's
programs apart by the names :mod:`.cache_names` gives their calls."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import threading
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx as fx

from ... import compat
from ...compat import aot_autograd, inductor
from .cpu_isa_probe import wait_cpu_isa_probe
from .gather_merge import gather_buckets_copied_out
from .kernel_batches import cpp_kernels_batched
from .shared_compiles import compiled_once_per_host, group_alias, rank_free_compiles


@dataclasses.dataclass
class CacheUse:
    """One compile through aot_autograd's cache."""

    traced: bool = False                    # the compiler saw the graphs: a miss (a hit loads them)
    unrecorded_backward: str | None = None  # the key whose records wait for the backward's compile


_SEEN = threading.local()


def _recording_keys(autograd_cache_key):
    def recorded(*args, **kwargs):
        key, debug_lines = autograd_cache_key(*args, **kwargs)
        keys = getattr(_SEEN, "keys", None)
        if keys is not None:
            keys.append(key)
        return key, debug_lines
    return recorded


_KEYS_RECORDED = aot_autograd.cache_key_patch(_recording_keys)


@contextlib.contextmanager
def aot_keys_seen() -> Iterator[list[str]]:
    """The keys aot_autograd's cache computes in this thread while the context is active, in order."""
    keys: list[str] = []
    previous = getattr(_SEEN, "keys", None)
    _SEEN.keys = keys
    try:
        with _KEYS_RECORDED.applied():
            yield keys
    finally:
        _SEEN.keys = previous


def compile_cached(gm: fx.GraphModule, example_inputs: Sequence[Any], compile_now: Callable[[], Any],
                   keep: Callable[[], Any], recall: Callable[[Any], None], shared: bool, use: CacheUse):
    """``compile_now()`` through aot_autograd's cache (``shared``: one rank of the host at a time per
    program), and dynshard's records of the traced graphs kept beside the entry (where the backward is
    compiled at its first call, which is when aot_autograd saves the entry, again then). A hit whose
    records are lost is compiled again."""
    prepared_for_cache_hits()
    wait_cpu_isa_probe()

    def keep_records():
        if len(keys) == 1:
            # (shared: the backward was compiled with the forward, the records are whole)
            remember(keys[0], keep(), replace=shared)
            use.unrecorded_backward = None if shared else keys[0]

    def compile_and_keep():
        compiled = compile_now()
        if use.traced:
            keep_records()
        return compiled

    # (what a hit loads runs Inductor's code for the gathers and batches its kernels as a compile would;
    # a shared trace compiles its backward at once, so that the entry is saved before the next rank looks)
    with aot_autograd.settings(force_non_lazy_backward_lowering=shared), aot_keys_seen() as keys, \
            gather_buckets_copied_out(), cpp_kernels_batched():
        compiled = (compiled_once_per_host(gm, example_inputs, compile_and_keep, cache="aot_autograd") if shared
                    else compile_and_keep())
        if use.traced:
            return compiled
        kept = remembered(keys[0]) if len(keys) == 1 else None
        if kept is not None:
            recall(kept)
            return compiled
        with aot_autograd.settings(enable_autograd_cache=False):
            compiled = compile_now()
        keep_records()
        return compiled


def prepared_for_cache_hits() -> None:
    """What a program read from aot_autograd's cache needs that its compile would have done: every group's
    alias registered on this rank (the cached code names groups by alias) and ``dynshard::copy_out_gathered``
    registered (Inductor's bucketing ops: ``compile_per_rank`` imports them for every compile)."""
    from ...runtime import gathered_bucket  # noqa: F401  (registers dynshard::copy_out_gathered)

    if torch.distributed.is_initialized() and rank_free_compiles():
        for name in compat.process_group_names():
            group_alias(name)


# what the records hold and how they were counted: a change makes older records unread (their programs
# compile once more), e.g. 2: activations saved by each call of an outlined block counted
RECORDS_VERSION = 2


def _records_path(key: str) -> str:
    return os.path.join(inductor.cache_dir(), "dynshard_compiles", f"{key}.v{RECORDS_VERSION}.records")


def remember(key: str, records: Any, replace: bool = True) -> None:
    """Keep ``records`` (what dynshard learned from the traced graphs) beside the entry ``key``;
    ``replace=False``: only where none are kept yet (a forward's records, before its backward compiles,
    must not replace the complete ones another rank of the same program kept)."""
    path = _records_path(key)
    if not replace and os.path.exists(path):
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "wb") as file:
        pickle.dump(records, file)
    os.replace(temporary, path)


def remembered(key: str) -> Any | None:
    """The records kept beside the entry ``key``; None where there are none."""
    try:
        with open(_records_path(key), "rb") as file:
            return pickle.load(file)
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError):
        return None
