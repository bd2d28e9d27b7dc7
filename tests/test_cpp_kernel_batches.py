"""dynshard.compat.cpp_kernel_batches: a graph's C++ kernels built as a few libraries."""

from __future__ import annotations

import torch

from dynshard.compat.cpp_kernel_batches import _balanced, _batchable, cpp_kernels_batched


def test_kernels_are_split_into_balanced_groups_the_same_way_on_every_rank():
    sizes = [5, 40, 10, 30, 20, 7]
    groups = _balanced(range(len(sizes)), sizes, 2)
    assert groups == _balanced(range(len(sizes)), sizes, 2)
    assert sorted(i for group in groups for i in group) == list(range(len(sizes)))
    assert [sum(sizes[i] for i in group) for group in groups] == [57, 55]     # largest first, into the lightest
    assert _balanced(range(1), [3], 4) == [[0]]


def test_a_kernel_with_macros_of_its_own_or_another_entry_point_is_built_alone():
    entry = 'extern "C"  void  kernel(float* out)\n{\n}\n'
    assert _batchable('#include "x.h"\n' + entry)
    assert not _batchable("#define N 4\n" + entry)
    assert not _batchable(entry.replace("kernel", "other"))
    assert not _batchable(entry + entry.replace("kernel(", "kernel(int n, "))


def _three_kernels(x):
    scores = (x.softmax(-1) @ x.t()).log_softmax(0)       # a kernel, a matmul, a kernel
    mixed = scores @ x
    return mixed.sum(0) + mixed.amax(1).sum(), scores.cumsum(0)


def test_a_graphs_kernels_built_together_compute_what_each_built_alone_computes(tmp_path):
    torch._dynamo.reset()
    x = torch.randn(33, 17)
    expected = _three_kernels(x)
    from torch._inductor import config
    from torch._inductor.utils import fresh_cache

    # (with one compile thread Inductor compiles each kernel where it is defined: nothing to batch)
    with config.patch(compile_threads=2), fresh_cache(dir=str(tmp_path)), cpp_kernels_batched():
        actual = torch.compile(_three_kernels, backend="inductor")(x)
        sources = [path.read_text() for path in tmp_path.rglob("*.cpp")]
    torch._dynamo.reset()
    torch.testing.assert_close(actual, expected)
    libraries = [source for source in sources if "PyInit_kernel_1" in source]
    assert len(libraries) == 1 and "dynshard_kernel_0::PyInit_kernel_0" in libraries[0]
