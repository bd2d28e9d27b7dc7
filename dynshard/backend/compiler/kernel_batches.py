"""Inductor's C++ kernels of one compiled graph built as a few libraries instead of one each.

On CPU Inductor builds every kernel as its own Python extension: one g++ run per kernel. Each run
loads the precompiled ``cpp_prefix.h`` (~150 MB) before it compiles a line: measured 0.45 s of a
kernel's 0.6-1.0 s, so a graph of 10 kernels spends most of its compile loading the same header.
:func:`cpp_kernels_batched` collects the kernels a generated module defines (``async_compile.
cpp_pybinding``) and, when the module first waits for one, builds them as ``compile_threads``
libraries of balanced size, compiled in parallel by Inductor's own pool and code cache (so ranks
with the same program share them as before, and a warm cache finds them).

Each kernel keeps its code and Inductor's Python binding, each inside a namespace of its own; its
``kernel`` loses C linkage (the binding calls it from the same file), and the library's
``PyInit_kernel`` gathers the kernels' entry points into one module. Include lines move to the top
of the file, ahead of every namespace, the kernels' first and then the bindings' (the order of a
kernel built alone). A kernel whose code does not have that shape (one entry point; no macros,
conditional compilation or explicit specializations of its own) is built alone, as Inductor does, and
so is each kernel of a library that fails to compile, so that the error is Inductor's own.
"""

from __future__ import annotations

import contextlib
import re
import threading
from typing import Any, Callable, Iterator, Sequence

from ...compat import cpp_kernels

_ENTRY = re.compile(r'extern\s+"C"\s+(void\s+kernel\s*\()')
_HOISTED = ("#include", "#define PY_SSIZE_T_CLEAN")
_NOT_BATCHABLE = ("#define", "#undef", "#if", "#elif", "#else", "#endif", "template <>", "template<>")
_state = threading.local()            # .active: this thread's compile batches its kernels


def _batching(single: Callable) -> Callable:
    """``AsyncCompile.cpp_pybinding`` that collects the kernels of a thread that batches (``single``:
    Inductor's, which builds one kernel)."""
    def cpp_pybinding(self, argtypes: list[str], source_code: str):
        # (one compile thread: AsyncCompile.wait waits for nothing, so each kernel is built here)
        if (not getattr(_state, "active", False) or cpp_kernels.compile_threads() <= 1
                or not _batchable(source_code)):
            return single(self, argtypes, source_code)
        cpp_kernels.log_kernel_code(source_code)
        batch = vars(self).setdefault("_dynshard_cpp_batch", _Batch(self))
        return batch.add(argtypes, source_code)
    return cpp_pybinding


_PATCH = cpp_kernels.cpp_pybinding_patch(_batching)


@contextlib.contextmanager
def cpp_kernels_batched() -> Iterator[None]:
    """While active in this thread, the C++ kernels of each module Inductor generates are built in
    batches (above)."""
    if getattr(_state, "active", False) or cpp_kernels.compile_threads() <= 1:
        yield      # nested (already batching), or no pool: each kernel is compiled when defined
        return
    with _PATCH.applied():
        _state.active = True
        try:
            yield
        finally:
            _state.active = False


def _batchable(source_code: str) -> bool:
    lines = [line.strip() for line in source_code.splitlines()]
    return len(_ENTRY.findall(source_code)) == 1 and not any(line.startswith(_NOT_BATCHABLE) for line in lines)


class _Batch:
    """The kernels one generated module defined, built together at its first wait."""

    def __init__(self, async_compile):
        self.async_compile = async_compile
        self.kernels: list[tuple[list[str], str]] = []
        self.results: list[Callable[[], Any]] | None = None
        self.lock = threading.Lock()

    def add(self, argtypes: list[str], source_code: str):
        with self.lock:
            if self.results is not None:     # defined after the others were built: a batch of its own
                return _Batch(self.async_compile).add(argtypes, source_code)
            index = len(self.kernels)
            self.kernels.append((argtypes, source_code))
        return cpp_kernels.kernel_future(lambda: self.result(index))

    def result(self, index: int):
        with self.lock:
            if self.results is None:
                self.results = self._build()
        return self.results[index]()

    def _build(self) -> list[Callable[[], Any]]:
        groups = _balanced(range(len(self.kernels)), [len(code) for _, code in self.kernels],
                           cpp_kernels.compile_threads())
        results: list[Callable[[], Any] | None] = [None] * len(self.kernels)
        for group in groups:
            if len(group) == 1:
                argtypes, code = self.kernels[group[0]]
                results[group[0]] = _single(argtypes, code, self.async_compile.submit)
                continue
            library = _Library(cpp_kernels.load_library_async(
                _library_source([self.kernels[i] for i in group]), self.async_compile.submit))
            for slot, index in enumerate(group):
                results[index] = library.entry(slot, *self.kernels[index], self.async_compile.submit)
        return results


def _single(argtypes: list[str], code: str, submit: Callable) -> Callable[[], Any]:
    return cpp_kernels.load_kernel_async(argtypes, code, submit)


class _Library:
    """A library of several kernels; if it does not compile, each of its kernels is built alone."""

    def __init__(self, load: Callable[[], Any]):
        self.load, self.module, self.failed = load, None, False
        self.lock = threading.Lock()

    def entry(self, slot: int, argtypes: list[str], code: str, submit: Callable) -> Callable[[], Any]:
        return lambda: self.kernel(slot, argtypes, code, submit)

    def kernel(self, slot: int, argtypes: list[str], code: str, submit: Callable):
        with self.lock:
            if self.module is None and not self.failed:
                try:
                    self.module = self.load()
                except cpp_kernels.cpp_compile_error():
                    self.failed = True
        if self.failed:
            return _single(argtypes, code, submit)()
        return getattr(self.module, f"kernel_{slot}")


def _balanced(indices: Sequence[int], sizes: Sequence[int], bins: int) -> list[list[int]]:
    """Indices in ``bins`` groups of about equal total size (largest first into the lightest group);
    deterministic, so that ranks compiling the same kernels build the same libraries."""
    groups: list[list[int]] = [[] for _ in range(max(1, min(bins, len(indices))))]
    totals = [0] * len(groups)
    for index in sorted(indices, key=lambda i: (-sizes[i], i)):
        lightest = totals.index(min(totals))
        groups[lightest].append(index)
        totals[lightest] += sizes[index]
    return [sorted(group) for group in groups if group]


def _library_source(kernels: Sequence[tuple[list[str], str]]) -> str:
    """One C++ file defining each kernel and its binding in a namespace, and ``PyInit_kernel``."""
    hoisted = {line.strip(): None for _, code in kernels for line in code.splitlines()
               if line.strip().startswith(_HOISTED)}
    parts = []
    for slot, (argtypes, code) in enumerate(kernels):
        binding = cpp_kernels.binding_source(argtypes, f"kernel_{slot}")
        body = []
        for line in (_ENTRY.sub(r"\1", code, count=1) + binding).splitlines():
            if line.strip().startswith(_HOISTED):
                hoisted[line.strip()] = None
            else:
                body.append(line)
        parts.append(f"namespace dynshard_kernel_{slot} {{\n" + "\n".join(body) + f"\n}}  // dynshard_kernel_{slot}\n")
    init = "\n".join(f"    {{\"kernel_{slot}\", dynshard_kernel_{slot}::PyInit_kernel_{slot}}},"
                     for slot in range(len(kernels)))
    return "\n".join(hoisted) + "\n\n" + "\n".join(parts) + _INIT_TEMPLATE.replace("@ENTRIES@", init)


_INIT_TEMPLATE = """
static struct PyModuleDef dynshard_kernels = {PyModuleDef_HEAD_INIT, "kernel", NULL, -1, NULL};

PyMODINIT_FUNC PyInit_kernel(void) {
    struct Entry { const char* name; PyObject* (*init)(void); };
    static const Entry entries[] = {
@ENTRIES@
    };
    PyObject* module = PyModule_Create(&dynshard_kernels);
    if (module == NULL) {
        return NULL;
    }
    #ifdef Py_GIL_DISABLED
        PyUnstable_Module_SetGIL(module, Py_MOD_GIL_NOT_USED);
    #endif
    for (const Entry& entry : entries) {
        PyObject* part = entry.init();
        PyObject* function = part == NULL ? NULL : PyObject_GetAttrString(part, entry.name);
        Py_XDECREF(part);
        if (function == NULL || PyModule_AddObject(module, entry.name, function) < 0) {
            Py_XDECREF(function);
            Py_DECREF(module);
            return NULL;
        }
    }
    return module;
}
"""
