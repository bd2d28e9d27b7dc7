"""How dynshard compiles each rank's program (its own policy; torch's private pieces through
:mod:`dynshard.compat`): the driver (:mod:`.inductor_compile`), aot_autograd's cache over dynshard's programs
(:mod:`.cache_names`, :mod:`.cached_compile`), compiles shared by the ranks of a host
(:mod:`.shared_compiles`), C++ kernels built in batches (:mod:`.kernel_batches`), the blocks-only scope
(:mod:`.blocks_only`), ``invoke_subgraph``'s schema once per block (:mod:`.block_schemas`), the CPU ISA probe (:mod:`.cpu_isa_probe`), collective bucketing (:mod:`.bucketing`)
and the rank-free merge of a bucket of all-gathers (:mod:`.gather_merge`)."""

from .bucketing import bucketing_patches  # noqa: F401
from .cpu_isa_probe import start_cpu_isa_probe, wait_cpu_isa_probe  # noqa: F401
from .gather_merge import gather_buckets_copied_out  # noqa: F401
from .inductor_compile import compile_per_rank  # noqa: F401
