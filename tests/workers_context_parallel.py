"""What each rank runs in tests/test_context_parallel.py: the sequence split over a unit's ranks."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import dynshard
from models import GPT, GPTConfig, LlamaLM, causal_lm, gpt_batch
from training import one_process_step, train_beside_one_process


def _model(name: str, cfg: GPTConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    return LlamaLM(cfg) if name == "llama" else GPT(cfg)


def _padded_batch(cfg: GPTConfig, batch: int, step: int):
    """Token ids and targets, the targets' tails padded (-100) by a different length on each row."""
    idx, targets = gpt_batch(cfg, batch, step)
    for row in range(batch):
        targets[row, cfg.seq - (3 * row + step) % cfg.seq:] = -100
    return idx, targets


def sgd_parity(rank: int, world: int, name: str, context_parallel: int, steps: int = 3, batch: int = 2,
               options: dict | None = None, seq: int = GPTConfig.seq) -> dict:
    """Train with the sequence split over ``context_parallel`` ranks per unit (units: data parallel; ``options``
    added to the config or replacing its entries) and, on the same global batch, one process; SGD with
    momentum, targets padded."""
    cfg = GPTConfig(seq=seq)
    model = _model(name, cfg)
    reference = copy.deepcopy(model)
    settings = dict(policy="tp", plan_ngpus=context_parallel, compiler="aot_eager",
                    pas_config={"context_parallel": context_parallel})
    compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(**{**settings, **(options or {})}))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    units = world // context_parallel
    losses, ref_losses = train_beside_one_process(
        compiled, opt, one_process_step(reference, ref_opt),
        (_padded_batch(cfg, batch * units, step) for step in range(steps)), context_parallel)
    report = dynshard.explain(compiled)
    chosen = [p.plan.predicted.autodist.chosen for p in report.programs
              if p.plan is not None and p.plan.predicted.autodist is not None]
    return {"losses": losses, "chosen": chosen, "ref_losses": ref_losses, "params": dynshard.collect_state_dict(compiled),
            "ref_params": {k: v.detach() for k, v in reference.state_dict().items()},
            "collectives": [(c.phase, c.kind, c.group) for c in report.collectives()], "explain": str(report)}


def _split_beside_one_process(model: torch.nn.Module):
    """``model`` compiled with its sequence split over two ranks, its copy for one process, an SGD with
    momentum for each: (compiled, its optimizer, the copy, the copy's optimizer)."""
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="dynshard", options=dynshard.Config(
        policy="tp", plan_ngpus=2, compiler="aot_eager", pas_config={"context_parallel": 2}))
    return (compiled, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), reference,
            torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9))


def transformers_sgd_parity(rank: int, world: int, name: str, steps: int = 3) -> dict:
    """A transformers causal LM (tests/models.causal_lm) with the sequence split over the two ranks against one
    process, SGD with momentum, a row's labels padded (-100) by a different length each step."""
    compiled, opt, reference, ref_opt = _split_beside_one_process(causal_lm(name))
    generator = torch.Generator().manual_seed(0)
    losses, ref_losses = [], []
    for step in range(steps):
        ids = torch.randint(0, 128, (2, 16), generator=generator)
        labels = ids.clone()
        labels[1, 10 + step:] = -100
        for net, optimizer, out in ((compiled, opt, losses), (reference, ref_opt, ref_losses)):
            loss = net(input_ids=ids, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            out.append(loss.item())
    return {"losses": losses, "ref_losses": ref_losses, "params": dynshard.collect_state_dict(compiled),
            "ref_params": {k: v.detach() for k, v in reference.state_dict().items()},
            "collectives": sorted({(c.phase, c.kind) for c in dynshard.explain(compiled).collectives()})}


def refuses_uneven_sequence(rank: int, world: int) -> str:
    """A sequence of 15 tokens under context_parallel=2 (causal: 4 chunks): the error every rank raises."""
    cfg = GPTConfig(seq=15)
    compiled = torch.compile(_model("gpt", cfg), backend="dynshard", options=dynshard.Config(
        policy="tp", plan_ngpus=2, compiler="aot_eager", pas_config={"context_parallel": 2}))
    idx, targets = gpt_batch(cfg, 2, 0)
    try:
        compiled(idx, targets)
    except Exception as error:      # (Dynamo wraps the backend's error)
        return f"{type(error).__name__}: {error}"
    return "no error"


def attention_exact(rank: int, world: int) -> dict:
    """The split attention against one process's, in float64: outputs and the gradients of q, k and v of this
    rank's tokens, causal and bidirectional, with grouped-query heads (largest absolute difference)."""
    import torch.nn.functional as F

    from dynshard.passes.context_parallel_attention import _SequenceGather, attend

    dist.init_process_group("gloo")
    group = dist.distributed_c10d._get_default_group().group_name
    found = {}
    for causal in (True, False):
        torch.manual_seed(0)
        q = torch.randn(2, 4, 16, 8, dtype=torch.float64, requires_grad=True)
        k, v = (torch.randn(2, 2, 16, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
        whole = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        grad = torch.randn_like(whole)
        whole.backward(grad)
        mine = slice(rank * 16 // world, (rank + 1) * 16 // world)
        local = [t.detach()[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
        keys, values = (_SequenceGather.apply(t, world, group) for t in local[1:])
        out = attend(local[0], keys, values, is_causal=causal, scale=None, ranks=world, rank=rank, group_name=group)
        out.backward(grad[:, :, mine])
        found[causal] = max((a - b).abs().max().item() for a, b in (
            (out, whole[:, :, mine]), (local[0].grad, q.grad[:, :, mine]), (local[1].grad, k.grad[:, :, mine]),
            (local[2].grad, v.grad[:, :, mine])))
    return found


def autodist_candidates(rank: int, world: int, seq: int) -> list[tuple[str, float, int]]:
    """autodist's priced candidates (name, step seconds, peak bytes) for a GPT of ``seq`` tokens, one row per
    unit of two ranks, planned offline as the training job plans it."""
    cfg = GPTConfig(seq=seq)
    plan, = dynshard.plan(_model("gpt", cfg), gpt_batch(cfg, 1, 0), dynshard.Config(
        policy="autodist", plan_ngpus=2, compiler="aot_eager"), world_size=2)
    return [(c.plan, c.step_seconds, c.peak_bytes) for c in plan.predicted.autodist.candidates]


def after_training(rank: int, world: int) -> dict:
    """What users do with a model trained with the sequence split: evaluate it (a length that splits, and one
    that does not), ``generate`` with it, ``save_pretrained`` it and read it back with ``from_pretrained``;
    each beside the same done to one process trained on the same batches."""
    import tempfile

    import transformers

    compiled, opt, reference, ref_opt = _split_beside_one_process(causal_lm("llama"))
    generator = torch.Generator().manual_seed(0)
    for _ in range(2):
        ids = torch.randint(0, 128, (2, 16), generator=generator)
        for net, optimizer in ((compiled, opt), (reference, ref_opt)):
            net(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    compiled.eval()
    reference.eval()
    ids = torch.randint(0, 128, (2, 12), generator=generator)
    found = {}
    with torch.no_grad():
        for length in (12, 7):      # 12 splits into 4 chunks, 7 does not
            rows = ids[:, :length]
            found[f"eval{length}"] = (compiled(input_ids=rows, labels=rows).loss.item(),
                                      reference(input_ids=rows, labels=rows).loss.item())
    prompt = ids[:, :5]
    found["generated"] = (compiled.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4,
                                            do_sample=False, pad_token_id=0).tolist(),
                          reference.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4,
                                             do_sample=False, pad_token_id=0).tolist())
    directory = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(directory)
    compiled.save_pretrained(directory[0])
    dist.barrier()
    read = transformers.LlamaForCausalLM.from_pretrained(directory[0]).state_dict()
    found["pretrained"] = {k: read[k] for k in reference.state_dict()}
    found["ref_params"] = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    return found
