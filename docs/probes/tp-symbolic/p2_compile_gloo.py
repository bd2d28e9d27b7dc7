"""Probe 1c: torch.compile a DTensor Megatron block (from_local inside) with symbolic sequence length in a real
2-process gloo job; run it at several lengths, compare loss and grads with a one-process reference, count compiles.
usage: python p2_compile_gloo.py BACKEND [--dyn-batch] [--dynamic-true] [--no-softmax] [--math] [--no-vocab]"""
import os, sys, traceback
os.environ["OMP_NUM_THREADS"] = "1"
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(rank, world, argv):
    torch.set_num_threads(1)
    import block
    if "--patch" in argv:
        import torch_patches; torch_patches.patch_all()
    import dynshard.compat    # noqa: F401  DTensor strategies for CPU flash attention (compat/cpu_attention.py)
    from torch.distributed.device_mesh import init_device_mesh
    from torch._dynamo.testing import CompileCounterWithBackend
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", "29533"
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    backend = argv[0]
    kw = dict(math_path="--math" in argv, vocab_loss="--no-vocab" not in argv,
              explicit_softmax="--no-softmax" not in argv)
    counter = CompileCounterWithBackend(backend)
    fn = lambda t, l, *ps: block.forward(mesh, t, l, *ps, **kw)
    if "--static" in argv:
        torch._dynamo.config.automatic_dynamic_shapes = False
    compiled = torch.compile(fn, backend=counter, fullgraph=True,
                             dynamic=True if "--dynamic-true" in argv else None)
    full = block.full_params()
    lengths = [8, 12, 6, 20, 7] if "--odd" in argv else [8, 12, 6, 20]
    batches = [2, 3] if "--dyn-batch" in argv else [2]
    log = []
    for B in batches:
        for S in lengths:
            g = torch.Generator().manual_seed(S * 10 + B)
            tokens = torch.randint(0, block.V, (B, S), generator=g)
            labels = torch.randint(0, block.V, (B, S), generator=g)
            if "--static" in argv:
                pass
            elif "--dynamic-true" not in argv:
                torch._dynamo.mark_dynamic(tokens, 1); torch._dynamo.mark_dynamic(labels, 1)
                if "--dyn-batch" in argv:
                    torch._dynamo.mark_dynamic(tokens, 0); torch._dynamo.mark_dynamic(labels, 0)
            grad = "--no-grad" not in argv
            loc = {k: v.requires_grad_(grad) for k, v in block.local_params(full, rank, world).items()}
            ref_p = {k: v.clone().requires_grad_(True) for k, v in full.items()}
            try:
                loss = compiled(tokens, labels, *[loc[k] for k in block.NAMES])
                ref = block.reference(tokens, labels, ref_p, explicit_softmax=kw["explicit_softmax"])
                if grad:
                    loss.backward()
                    ref.backward()
                err = 0.0 if not grad else max((loc[k].grad - (ref_p[k].grad.chunk(world, block.PLACE[k].dim)[rank]
                          if isinstance(block.PLACE[k], block.Shard) else ref_p[k].grad)).abs().max().item()
                          for k in block.NAMES)
                log.append(f"B={B} S={S}: loss {loss.item():.5f} ref {ref.item():.5f} max grad err {err:.2e} "
                           f"frames compiled so far {counter.frame_count}")
            except Exception as e:
                log.append(f"B={B} S={S}: FAILED {type(e).__name__}: {str(e)[:1500]}")
                if rank == 0:
                    traceback.print_exc(limit=-12)
                break
    if rank == 0:
        print(f"== backend={backend} argv={argv}")
        print("\n".join(log))
        print("frame_count", counter.frame_count, "op_count", counter.op_count)
        try:
            gm = counter.graphs[0] if hasattr(counter, "graphs") else None
        except Exception:
            gm = None
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(main, args=(2, sys.argv[1:]), nprocs=2, join=True)
