"""What each rank runs in tests/test_moe_tp.py: tiny mixture-of-experts models of transformers (Mixtral,
Qwen3-MoE) trained with the ``tp`` policy next to one eager process on the same batch (module level, so
spawned processes can import it)."""

from __future__ import annotations

import copy
import warnings

import torch
import torch.distributed as dist

import dynshard

VOCAB, SEQ, ROWS = 128, 16, 2     # ROWS: the batch rows of one data-parallel unit
HIDDEN, INTERMEDIATE, LAYERS, EXPERTS, TOP_K = 32, 64, 2, 4, 2
LR, MOMENTUM, STEPS = 0.1, 0.9, 3
AUX_COEF = 0.02


def build(name: str, experts_implementation: str) -> torch.nn.Module:
    """A tiny MoE causal LM with the router's auxiliary loss in its loss, dropout and jitter off."""
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, use_cache=False, num_experts_per_tok=TOP_K,
                  output_router_logits=True, router_aux_loss_coef=AUX_COEF,
                  experts_implementation=experts_implementation)
    if name == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=INTERMEDIATE, num_local_experts=EXPERTS, **common)
        return transformers.MixtralForCausalLM(config)
    if name == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(moe_intermediate_size=INTERMEDIATE, intermediate_size=INTERMEDIATE,
                                             num_experts=EXPERTS, decoder_sparse_step=1, mlp_only_layers=[],
                                             head_dim=HIDDEN // 4, **common)
        model = transformers.Qwen3MoeForCausalLM(config)
        with torch.no_grad():      # the router starts at zero: every expert ties; give it something to route on
            for layer in model.model.layers:
                layer.mlp.gate.weight.normal_(0, 0.2)
        return model
    raise ValueError(name)


def make_batch(rows: int, step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, VOCAB, (rows, SEQ), generator=generator)
    return {"input_ids": x, "labels": x}


def _unit_rows(batch: dict[str, torch.Tensor], dp_rank: int, rows: int) -> dict[str, torch.Tensor]:
    return {key: value[dp_rank * rows:(dp_rank + 1) * rows] for key, value in batch.items()}


def train_moe(rank: int, world: int, name: str, experts_implementation: str, plan_ngpus: int = 2,
              steps: int = STEPS, use_zero: int = 0, dtype: str = "float32") -> dict:
    """Train with dynshard (tp) and, on the same global batch, single-process eager; report losses (the
    total and the router's auxiliary loss), parameters, placements, collectives and Dynamo's graphs.
    ``dtype="bfloat16"``: the whole model in bf16, so that transformers' grouped_mm compiles to
    ``torch._grouped_mm`` (in fp32 it calls its own opaque ``transformers::grouped_mm_fallback``)."""
    from torch._dynamo.utils import counters

    model = build(name, experts_implementation).to(getattr(torch, dtype))
    model.train()
    reference = copy.deepcopy(model)
    full_numel = {n: p.numel() for n, p in model.named_parameters()}
    compiled = torch.compile(model, backend="dynshard",
                             options=dynshard.Config(policy="tp", plan_ngpus=plan_ngpus, compiler="aot_eager",
                                                     use_zero=use_zero))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR, momentum=MOMENTUM)
    dp_rank, dp_size = dynshard.data_parallel_rank(plan_ngpus)
    losses, aux, ref_losses, ref_aux, caught = [], [], [], [], []
    for step in range(steps):
        global_batch = make_batch(ROWS * dp_size, step)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            out = compiled(**_unit_rows(global_batch, dp_rank, ROWS))
            out.loss.backward()
        if step == 0:
            caught = [(w.category.__name__, str(w.message)) for w in record]
        opt.step()
        opt.zero_grad()
        both = torch.stack([out.loss.detach(), out.aux_loss.detach()]).float()
        dist.all_reduce(both)           # ranks of a unit hold the same loss; units hold their rows'
        losses.append(both[0].item() / world)
        aux.append(both[1].item() / world)
        # the reference as DDP trains: each unit's loss on its own rows (the router's load-balancing loss is
        # not a mean over rows: over the whole batch it is another number), gradients averaged over units
        ref_loss = ref_aux_loss = 0.0
        for unit in range(dp_size):
            ref = reference(**_unit_rows(global_batch, unit, ROWS))
            (ref.loss / dp_size).backward()
            ref_loss += ref.loss.item() / dp_size
            ref_aux_loss += ref.aux_loss.item() / dp_size
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss)
        ref_aux.append(ref_aux_loss)
    report = dynshard.explain(compiled)
    return {
        "losses": losses, "aux": aux, "ref_losses": ref_losses, "ref_aux": ref_aux,
        "params": dynshard.collect_state_dict(compiled),
        "ref_params": {k: v.detach().clone() for k, v in reference.state_dict().items()},
        "local_numel": {n: p.numel() for n, p in model.named_parameters()},
        "full_numel": full_numel,
        "collectives": [(c.phase, c.kind, c.group, c.bytes, tuple(c.shape)) for c in report.collectives()],
        "programs": len(report.programs),
        "dynamo_graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": dict(counters["graph_break"]),
        "warnings": caught,
        "explain": str(report),
    }


def refused_moe(rank: int, world: int, name: str, experts_implementation: str = "eager") -> str:
    """The first step of ``train_moe``'s model under tp; the error it raises (every rank must raise)."""
    model = build(name, experts_implementation)
    model.train()
    compiled = torch.compile(model, backend="dynshard",
                             options=dynshard.Config(policy="tp", plan_ngpus=world, compiler="aot_eager"))
    try:
        compiled(**make_batch(ROWS, 0)).loss.backward()
    except Exception as error:  # noqa: BLE001 - what the user sees is the point
        return f"{type(error).__name__}: {error}"
    raise AssertionError(f"rank {rank}: experts_implementation={experts_implementation!r} trained under tp")
