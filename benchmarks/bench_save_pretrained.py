"""Host memory of a whole-model save on 2 CPU ranks (gloo): ``save_pretrained`` on every rank (dynshard gathers
to rank 0 a tensor at a time) against ``dynshard.collect_state_dict`` (every rank gathers the whole state).

    python benchmarks/bench_save_pretrained.py                       # Llama-shaped, ~59M parameters, tp and ZeRO-3
    python benchmarks/bench_save_pretrained.py --hidden 256 --layers 2 --vocab 4096   # a quick look

Each rank builds transformers' LlamaForCausalLM (fp32, tied=False), compiles it with dynshard (aot_eager), takes
one SGD step, then measures two calls, each alone: its resident set size (``/proc/self/statm``) is sampled every
millisecond by a thread, and the peak above the RSS just before the call is reported, with the model's full
size and its largest tensor. The expectation: save_pretrained's rank 0 peak ~ the full model (its host copy)
plus safetensors' write buffer, rank 1 ~ one whole tensor; collect_state_dict ~ the full model on every rank.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time

import torch
import torch.multiprocessing as mp

MB = 1e6
PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRSS:
    """The highest RSS seen while the block runs, above the RSS when it started."""

    def __enter__(self):
        self.start, self.peak, self._stop = _rss(), 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())
        self.above = self.peak - self.start


def _rank(rank: int, world: int, port: int, args, outdir: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
                       "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)
    import transformers

    import dynshard

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=64,
        use_cache=False, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    options = {"tp": {"policy": "tp", "plan_ngpus": 2}, "zero3": {"use_zero": 3}}[args.plan]
    compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(compiler="aot_eager", **options))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ids = torch.randint(0, args.vocab, (2, 16), generator=torch.Generator().manual_seed(rank // 2))
    compiled(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    import torch.distributed as dist

    dist.barrier()
    with PeakRSS() as saving:
        model.save_pretrained(os.path.join(outdir, "saved"))
    dist.barrier()
    with PeakRSS() as collecting:
        full = dynshard.collect_state_dict(compiled)
    del full
    row = (args.plan, rank, saving.above / MB, collecting.above / MB, full_bytes / MB, largest / MB)
    with open(os.path.join(outdir, f"{args.plan}.{rank}"), "w") as f:
        f.write(repr(row))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--plans", default="tp,zero3")
    args = parser.parse_args()
    rows = []
    for plan in args.plans.split(","):
        args.plan = plan
        with tempfile.TemporaryDirectory() as outdir:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            mp.start_processes(_rank, args=(2, port, args, outdir), nprocs=2, start_method="spawn")
            rows += [eval(open(os.path.join(outdir, f"{plan}.{r}")).read()) for r in range(2)]
    print(f"{'plan':<6} {'rank':>4} {'save_pretrained peak MB':>24} {'collect_state_dict peak MB':>27} "
          f"{'full model MB':>14} {'largest tensor MB':>18}")
    for plan, rank, saving, collecting, full, largest in rows:
        print(f"{plan:<6} {rank:>4} {saving:>24.1f} {collecting:>27.1f} {full:>14.1f} {largest:>18.1f}")


if __name__ == "__main__":
    sys.exit(main())
