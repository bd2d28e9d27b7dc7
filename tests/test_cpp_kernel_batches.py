"""dynshard.backend.compiler.kernel_batches: a graph's C++ kernels built as a few libraries."""

from __future__ import annotations

import contextlib

import torch

from dynshard.backend.compiler.kernel_batches import _balanced, _batchable, cpp_kernels_batched


def test_kernels_are_split_into_balanced_groups_the_same_way_on_every_rank():
    sizes = [5, 40, 10, 30, 20, 7]
    groups = _balanced(range(len(sizes)), sizes, 2)
    assert groups == _balanced(range(len(sizes)), sizes, 2)
    assert sorted(i for group in groups for i in group) == list(range(len(sizes)))
    assert [sum(sizes[i] for i in group) for group in groups] == [57, 55]     # largest first, into the lightest
    assert _balanced(range(1), [3], 4) == [[0]]


def test_a_kernel_with_macros_conditions_or_specializations_of_its_own_or_another_entry_is_built_alone():
    entry = 'extern "C"  void  kernel(float* out)\n{\n    #pragma omp simd\n}\n'
    assert _batchable('#include "x.h"\n' + entry)
    assert not _batchable("#define N 4\n" + entry)
    assert not _batchable('#if defined(CPU_CAPABILITY_AVX512)\n#include "x.h"\n#endif\n' + entry)
    assert not _batchable("template <> struct Helper<float> {};\n" + entry)
    assert not _batchable(entry.replace("kernel", "other"))
    assert not _batchable(entry + entry.replace("kernel(", "kernel(int n, "))


def _three_kernels(x):
    scores = (x.softmax(-1) @ x.t()).log_softmax(0)       # a kernel, a matmul, a kernel
    mixed = scores @ x
    return mixed.sum(0) + mixed.amax(1).sum(), scores.cumsum(0)


def _compiled(x, cache_dir, batched: bool, **options):
    from torch._inductor import config
    from torch._inductor.utils import fresh_cache

    cache_dir.mkdir(exist_ok=True)
    torch._dynamo.reset()
    # (with one compile thread Inductor compiles each kernel where it is defined: nothing to batch)
    with config.patch(compile_threads=2), fresh_cache(dir=str(cache_dir)), \
            (cpp_kernels_batched() if batched else contextlib.nullcontext()):
        out = torch.compile(_three_kernels, backend="inductor", options=options)(x)
        sources = [path.read_text() for path in cache_dir.rglob("*.cpp")]
    torch._dynamo.reset()
    return out, sources


def test_a_graphs_kernels_built_together_compute_exactly_what_each_built_alone_computes(tmp_path):
    x = torch.randn(33, 17, generator=torch.Generator().manual_seed(0))
    alone, _ = _compiled(x, tmp_path / "alone", batched=False)
    together, sources = _compiled(x, tmp_path / "together", batched=True)
    torch.testing.assert_close(together, alone, rtol=0, atol=0)
    libraries = [source for source in sources if "PyInit_kernel_1" in source]
    assert len(libraries) == 1 and "dynshard_kernel_0::PyInit_kernel_0" in libraries[0]


def test_a_compile_with_one_compile_thread_builds_each_kernel_where_it_is_defined(tmp_path):
    # (Inductor's wait waits for nothing with one thread: a kernel left to build later would never be)
    x = torch.randn(33, 17, generator=torch.Generator().manual_seed(0))
    out, sources = _compiled(x, tmp_path, batched=True, compile_threads=1)
    torch.testing.assert_close(out, _three_kernels(x), rtol=1e-4, atol=1e-4)
    assert not any("PyInit_kernel_1" in source for source in sources)


def test_when_a_library_does_not_compile_each_of_its_kernels_is_built_alone(monkeypatch):
    from torch._inductor.exc import CppCompileError

    from dynshard.backend.compiler import kernel_batches

    def load():
        raise CppCompileError(["g++", "library.cpp"], "library.cpp:3: error: redefinition")

    alone = []
    monkeypatch.setattr(kernel_batches, "_single",
                        lambda argtypes, code, submit: lambda: alone.append(code) or f"built {code}")
    library = kernel_batches._Library(load)
    entries = [library.entry(slot, [], f"kernel {slot}", submit=None) for slot in range(2)]
    assert [entry() for entry in entries] == ["built kernel 0", "built kernel 1"]
    assert alone == ["kernel 0", "kernel 1"]
