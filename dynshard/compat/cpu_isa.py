"""Inductor's probe of the CPU's vector instruction sets (``torch._inductor.cpu_vec_isa``), the pieces
:mod:`dynshard.backend.compiler.cpu_isa_probe` reads and replaces. Each wraps one thing."""

from __future__ import annotations

import os
from typing import Callable


def import_probe_modules() -> None:
    """Import what the probe runs (once, in one thread: not first in two threads at once)."""
    from torch._inductor import codecache, config, cpp_builder, cpu_vec_isa  # noqa: F401


def vec_isa_list() -> Callable[[], list]:
    """``cpu_vec_isa.valid_vec_isa_list`` as it is now (Inductor's probe, or what replaced it)."""
    from torch._inductor import cpu_vec_isa

    return cpu_vec_isa.valid_vec_isa_list


def set_vec_isa_list(valid_vec_isa_list: Callable[[], list]) -> None:
    from torch._inductor import cpu_vec_isa

    cpu_vec_isa.valid_vec_isa_list = valid_vec_isa_list


def load_check() -> Callable:
    """``VecISA._probe_load(isa, library)``: whether an ISA's test library loads (a Python child dlopens it)."""
    from torch._inductor import cpu_vec_isa

    return cpu_vec_isa.VecISA._probe_load


def set_load_check(probe_load: Callable) -> None:
    from torch._inductor import cpu_vec_isa

    cpu_vec_isa.VecISA._probe_load = probe_load


def claimed_x86_isas() -> list:
    """Inductor's x86 ISAs (best first, ``supported_vec_isa_list``) whose flags the CPU claims
    (``x86_isa_checker``), none of them built yet."""
    from torch._inductor import cpu_vec_isa

    flags = cpu_vec_isa.x86_isa_checker()
    return [isa for isa in cpu_vec_isa.supported_vec_isa_list if all(flag in flags for flag in str(isa).split())]


def best_isa_picked() -> bool:
    """Whether ``pick_vec_isa`` takes the first valid ISA (no width or capability asked for: ``cpp.simdlen``,
    ``ATEN_CPU_CAPABILITY``)."""
    from torch._inductor import config

    return config.cpp.simdlen is None and not os.environ.get("ATEN_CPU_CAPABILITY")


def isa_forced() -> bool:
    """Whether Inductor's ``cpp.vec_isa_ok`` forces its answer on the probe."""
    from torch._inductor import config

    return config.cpp.vec_isa_ok is not None
