"""What each rank runs in tests/test_transformers_tp.py: small models of Hugging Face transformers trained
with the ``tp`` policy (module level, so spawned processes can import it)."""

from __future__ import annotations

import copy
import warnings

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import dynshard

VOCAB, SEQ, ROWS = 128, 16, 2     # ROWS: the batch rows of one data-parallel unit
LR, MOMENTUM, STEPS = 0.1, 0.9, 3


def build(name: str) -> torch.nn.Module:
    """A small transformers model with dropout off (its losses are then deterministic)."""
    import transformers

    torch.manual_seed(0)
    if name in ("llama", "llama_mqa"):      # grouped-query attention: 2 kv heads, or 1 (does not divide tp=2)
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2 if name == "llama" else 1, max_position_embeddings=64, use_cache=False)
        return transformers.LlamaForCausalLM(config)
    if name == "gpt2":                       # Conv1D, fused c_attn, wte tied to lm_head
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, attn_pdrop=0.0, resid_pdrop=0.0,
            embd_pdrop=0.0, use_cache=False)
        model = transformers.GPT2LMHeadModel(config)
        # transformers finds the loss from the class name, and "GPT2LMHeadModel" names none: its
        # logger.warning_once about that breaks Dynamo's graph before the loss, which would then run in a
        # second program on gathered logits (no vocab-parallel cross-entropy to test)
        model.loss_type = "ForCausalLM"
        return model
    if name == "bert":
        config = transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        return transformers.BertForMaskedLM(config)
    if name in ("t5", "t5_gated"):
        # one table shared by the encoder, the decoder and the LM head (transformers 5 always ties it);
        # t5: the head's input scaled by d_model^-0.5; t5_gated as T5 v1.1 / flan-T5: gated-GELU FFN (wi_0,
        # wi_1), no scaling (tie_word_embeddings=False only turns the scaling off)
        gated = name == "t5_gated"
        config = transformers.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
            dropout_rate=0.0, use_cache=False, decoder_start_token_id=0, pad_token_id=0,
            feed_forward_proj="gated-gelu" if gated else "relu", tie_word_embeddings=not gated)
        return transformers.T5ForConditionalGeneration(config)
    raise ValueError(name)


def make_batch(name: str, rows: int, step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, VOCAB, (rows, SEQ), generator=generator)
    batch = {"input_ids": x, "labels": x}
    if name == "bert":
        batch["token_type_ids"] = torch.randint(0, 2, (rows, SEQ), generator=generator)
    if name == "t5_gated":     # the decoder's ids given (T5 shifts the labels itself when they are not)
        batch["decoder_input_ids"] = torch.cat([torch.zeros(rows, 1, dtype=x.dtype), x[:, :-1]], dim=1)
    return batch


def _unit_rows(batch: dict[str, torch.Tensor], dp_rank: int, rows: int) -> dict[str, torch.Tensor]:
    return {key: value[dp_rank * rows:(dp_rank + 1) * rows] for key, value in batch.items()}


def train_transformers(rank: int, world: int, name: str, plan_ngpus: int = 2, sequence_parallel: bool = False,
                       steps: int = STEPS, policy: str = "tp", options: dict | None = None) -> dict:
    """Train with dynshard (tp) and, on the same global batch, single-process eager; report both, with
    the placements, the collectives and the warnings of the first step. ``sequence_parallel`` also
    returns split outputs (the logits) as DTensors rather than gathering them; ``options``: more Config
    fields (they win)."""
    from torch._dynamo.utils import counters

    model = build(name)
    model.train()
    reference = copy.deepcopy(model)
    full_numel = {n: p.numel() for n, p in model.named_parameters()}
    compiled = torch.compile(model, backend="dynshard",
                             options=dynshard.Config(policy=policy, plan_ngpus=plan_ngpus, compiler="aot_eager",
                                                     **{"pas_config": {"sequence_parallel": sequence_parallel}
                                                        if policy == "tp" else {},
                                                        "gather_outputs": not sequence_parallel, **(options or {})}))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR, momentum=MOMENTUM)
    dp_rank, dp_size = dynshard.data_parallel_rank(plan_ngpus)
    losses, ref_losses, caught = [], [], []
    for step in range(steps):
        global_batch = make_batch(name, ROWS * dp_size, step)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            out = compiled(**_unit_rows(global_batch, dp_rank, ROWS))
            loss = out.loss
            loss.backward()
        if step == 0:   # split logits come back as DTensors (gather_outputs=False), whole ones as tensors
            with torch.no_grad():
                expected = reference(**_unit_rows(global_batch, dp_rank, ROWS)).logits
            logits = out.logits
            split_logits = isinstance(logits, DTensor)
            logits_error = ((logits.full_tensor() if split_logits else logits) - expected).abs().max().item()
        if step == 0:
            caught = [(w.category.__name__, str(w.message)) for w in record]
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)           # ranks of a unit hold the same loss; units hold their rows'
        losses.append(mean.item() / world)
        ref_loss = reference(**global_batch).loss
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    report = dynshard.explain(compiled)
    return {
        "losses": losses, "ref_losses": ref_losses,
        "params": dynshard.collect_state_dict(compiled),
        "ref_params": {k: v.detach().clone() for k, v in reference.state_dict().items()},
        "local_numel": {n: p.numel() for n, p in model.named_parameters()},
        "local_shapes": {n: tuple(p.shape) for n, p in model.named_parameters()},
        "full_numel": full_numel,
        "collectives": [(c.phase, c.kind, c.group, c.bytes, tuple(c.shape)) for c in report.collectives()],
        "programs": len(report.programs),
        "dynamo_graphs": counters["stats"]["unique_graphs"],     # 1: no graph break
        "warnings": caught,
        "split_logits": split_logits, "logits_error": logits_error,
        "explain": str(report),
    }
