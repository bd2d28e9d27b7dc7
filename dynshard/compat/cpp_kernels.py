"""Inductor's builds of C++ kernels (``torch._inductor.async_compile``, ``codecache.CppPythonBindingsCodeCache``),
the pieces :mod:`dynshard.backend.compiler.kernel_batches` builds its libraries with. Each wraps one thing."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from .counted_patch import CountedPatch


def _async_compile() -> type:
    from torch._inductor.async_compile import AsyncCompile

    return AsyncCompile


def cpp_pybinding_patch(replace: Callable[[Callable], Callable]) -> CountedPatch:
    """``AsyncCompile.cpp_pybinding`` (how a generated module defines one C++ kernel) replaced by
    ``replace(inductor's)`` while the patch is applied."""
    return CountedPatch(_async_compile, "cpp_pybinding", replace)


def compile_threads() -> int:
    """Inductor's compile pool size (``async_compile.get_compile_threads``)."""
    from torch._inductor.async_compile import get_compile_threads

    return get_compile_threads()


def log_kernel_code(source_code: str) -> None:
    """Log a kernel's source as Inductor does (``TORCH_LOGS=kernel_code``)."""
    from torch._inductor.async_compile import kernel_code_log

    kernel_code_log.info("CPP+Bindings Kernel:\n%s", source_code)


def kernel_future(result: Callable[[], Any]):
    """A future a generated module waits on (``codecache.LambdaFuture``)."""
    from torch._inductor.codecache import LambdaFuture

    return LambdaFuture(result)


def load_library_async(source_code: str, submit: Callable) -> Callable[[], Any]:
    """Build a C++ Python extension in Inductor's pool and code cache; the returned call loads it."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    return CppPythonBindingsCodeCache.load_async(source_code, "cpu", submit_fn=submit)


def load_kernel_async(argtypes: list[str], source_code: str, submit: Callable) -> Callable[[], Any]:
    """One kernel built as Inductor builds it (``load_pybinding_async``); the returned call gives its entry."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    return CppPythonBindingsCodeCache.load_pybinding_async(argtypes, source_code, submit_fn=submit)


def binding_source(argtypes: Sequence[str], entry_func: str) -> str:
    """Inductor's Python binding of a kernel (its templates), calling ``entry_func`` and exporting
    ``PyInit_<entry_func>``."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache as Bindings

    parse = ", ".join(f"parse_arg<{argtype.replace('const ', '')}>(args, {n})" for n, argtype in enumerate(argtypes))
    return Bindings.suffix_template.format(
        arg_len=len(argtypes), call_entry_func=Bindings.call_entry_function.format(parse),
        entry_func=entry_func, extra_parse_arg=Bindings.extra_parse_arg.format(array_len=-1))


def cpp_compile_error() -> type:
    """The exception a failed C++ build raises (``torch._inductor.exc.CppCompileError``)."""
    from torch._inductor.exc import CppCompileError

    return CppCompileError
