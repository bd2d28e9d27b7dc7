"""What each rank runs in tests/test_mixed_precision.py."""

from __future__ import annotations

import copy

import torch

import dynshard
from models import GPTConfig, LlamaLM, gpt_batch
from training import train_beside_one_process


def bf16_llama_against_fsdp2_semantics(rank: int, world: int, policy: str, plan_ngpus: int, steps: int = 3) -> dict:
    """transformers' Llama under ``mixed_precision={"param_dtype": "bfloat16"}`` against one process that does
    what FSDP2's MixedPrecisionPolicy does: each step the fp32 master weights copied into a bf16 model, its
    forward and backward in bf16, the gradients back in fp32, SGD with momentum on the masters."""
    cfg = GPTConfig()
    torch.manual_seed(0)
    model = LlamaLM(cfg)
    master = copy.deepcopy(model)
    compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(
        policy=policy, plan_ngpus=plan_ngpus, compiler="aot_eager", mixed_precision={"param_dtype": "bfloat16"}))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(master.parameters(), lr=0.1, momentum=0.9)

    def fsdp2_step(units) -> float:
        low = copy.deepcopy(master).to(torch.bfloat16)
        loss = sum(low(*rows) for rows in units) / len(units)
        loss.backward()
        for p, q in zip(master.parameters(), low.parameters()):
            p.grad = q.grad.float()
        ref_opt.step()
        ref_opt.zero_grad()
        return loss.float().item()

    units = world // plan_ngpus
    losses, ref_losses = train_beside_one_process(
        compiled, opt, fsdp2_step, (gpt_batch(cfg, 2 * units, step) for step in range(steps)), plan_ngpus)
    params = dynshard.collect_state_dict(compiled)
    torch.manual_seed(0)
    start = {k: v.detach() for k, v in LlamaLM(cfg).state_dict().items()}
    ref = {k: v.detach() for k, v in master.state_dict().items()}
    updates = {k: ((params[k] - ref[k]).norm() / (ref[k] - start[k]).norm().clamp_min(1e-12)).item()
               for k in ref if (ref[k] - start[k]).norm() > 0}
    return {"losses": losses, "ref_losses": ref_losses, "updates": updates}
