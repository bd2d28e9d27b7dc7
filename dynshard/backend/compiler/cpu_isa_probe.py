"""Inductor's probe of the CPU's vector instruction sets (its ``cpu_vec_isa``, read and replaced through
:mod:`dynshard.compat.cpu_isa`), made cheaper and moved off the first compile's path.

Inductor works out once per process which vector ISAs it can compile for (``valid_vec_isa_list``):
for every ISA the CPU claims, a g++ build of a test file that includes ATen's vector headers (about
3 s of CPU each), then a Python child that dlopens the library (0.2 s each, six per process). On a
2-core machine that was 7-9 s before the first kernel, paid by every rank. dynshard:

- starts it in the background at the first backend call (:func:`start_cpu_isa_probe`), so it overlaps
  planning and aot_autograd; Inductor's first compile waits for it (:func:`wait_cpu_isa_probe`);
- builds only the best ISA the CPU claims, and a lesser one only when it fails: Inductor generates code
  for the first valid ISA (``pick_vec_isa``) unless ``config.cpp.simdlen`` or ``ATEN_CPU_CAPABILITY``
  asks for another, and then every candidate is probed as Inductor does;
- lets the first rank of a host whose load check of a test library passes record it for the others.
"""

from __future__ import annotations

import contextlib
import os
import platform
import socket
import threading
from typing import Callable, Sequence

from ...compat import cpu_isa

_ISA_PROBES: list = []      # the probe thread, once per process
_STARTING = threading.Lock()


def start_cpu_isa_probe() -> None:
    """Start the probe in the background. Until it ends, a ``valid_vec_isa_list`` call from another
    thread (an Inductor compile dynshard does not drive) waits for it instead of probing the same ISA
    objects a second time, concurrently (their ``__bool__`` edits their flags while it builds)."""
    cpu_isa.import_probe_modules()     # (here, not first in two threads at once)
    with _STARTING:
        if not _ISA_PROBES:
            _start_probe()


def _start_probe() -> None:
    inductor_list = cpu_isa.vec_isa_list()
    load_in_child = cpu_isa.load_check()
    answer = inductor_list      # what valid_vec_isa_list is once the probe ends

    def probe() -> None:
        nonlocal answer
        cpu_isa.set_load_check(_load_verdict_shared_on_host(load_in_child))
        try:
            if platform.machine() in ("x86_64", "AMD64"):
                claimed = cpu_isa.claimed_x86_isas()
                if cpu_isa.best_isa_picked() and not cpu_isa.isa_forced():
                    best = first_valid(claimed)
                    # (asked again at each call: a later compile may set simdlen, and get Inductor's list)
                    answer = lambda: list(best) if cpu_isa.best_isa_picked() else inductor_list()  # noqa: E731
                    return
                _probe_at_once(claimed)
            inductor_list()
        except Exception:  # noqa: BLE001 - Inductor probes again, and reports, when it needs the list
            answer = inductor_list
        finally:
            cpu_isa.set_load_check(load_in_child)
            cpu_isa.set_vec_isa_list(answer)

    def after_probe():
        wait_cpu_isa_probe()
        return answer()

    thread = threading.Thread(target=probe, name="dynshard-isa-probe", daemon=True)
    _ISA_PROBES.append(thread)
    cpu_isa.set_vec_isa_list(after_probe)
    thread.start()


def wait_cpu_isa_probe() -> None:
    """Wait for :func:`start_cpu_isa_probe` (its result is cached; a second probe would redo the builds)."""
    for probe in _ISA_PROBES:
        if probe is not threading.current_thread():
            probe.join()


def first_valid(claimed: Sequence) -> list:
    """The best of ``claimed`` (best first, as Inductor lists them) that builds and loads, as the list
    ``pick_vec_isa`` reads its first entry from; the ISAs after it are never built."""
    for isa in claimed:
        if isa:
            return [isa]
    return []


def _probe_at_once(claimed: Sequence) -> None:
    """Every candidate probed in a thread of its own (each ``bool(isa)`` is cached for Inductor)."""
    candidates = [threading.Thread(target=bool, args=(isa,), daemon=True) for isa in claimed]
    for candidate in candidates:
        candidate.start()
    for candidate in candidates:
        candidate.join()


def _load_verdict_shared_on_host(load_in_child: Callable) -> Callable:
    """Inductor checks that each ISA's test library loads by starting a Python child that dlopens it:
    every rank of a host repeated the same checks on the same files. The first rank whose check passes
    records it beside the library, for this host only (a cache directory shared between hosts may be
    read by another CPU) and for this build of the library (its size and time); the others read it. A
    failed check is not recorded (it may be a timeout or a killed child): the next process checks again.
    Inductor calls this holding the library's file lock, and the record is written by a rename."""
    def probe_load(isa, output_path: str) -> bool:
        record = f"{output_path}.{socket.gethostname()}.loads"
        try:
            with open(record) as fh:
                if fh.read() == _library_version(output_path):
                    return True
        except (OSError, UnicodeDecodeError):
            pass
        loads = load_in_child(isa, output_path)
        if loads:
            with contextlib.suppress(OSError):
                with open(f"{record}.{os.getpid()}", "w") as fh:
                    fh.write(_library_version(output_path))
                os.replace(f"{record}.{os.getpid()}", record)
        return loads
    return probe_load


def _library_version(path: str) -> str:
    stat = os.stat(path)
    return f"{stat.st_size}:{stat.st_mtime_ns}"
