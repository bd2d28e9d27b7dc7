"""dynshard.checkpoint across plans: save under plan A, load under plan B, continue, compare with one process.

Three jobs share one directory of checkpoints: a 2-rank job (tp2 -> pp2 -> tp2, a data2 save, two straight
AdamW runs that save halfway), a 4-rank job (hybrid, tp2 x dp2, ZeRO-1 in 2 groups) and a new 2-rank job that
loads the 4-rank saves under other plans, data2 under ZeRO-3, and resumes the tp2, ZeRO-2 and pp2 runs (AdamW)
under their own plans, bit for bit. Every checkpoint is
exported with ``dcp_to_torch_save``: it must hold exactly what the saving plan held, a plan that loads it must
hold exactly that before it steps, and its next steps must match one process continuing from the export.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

import dynshard
from distributed import run_ranks
from parity import loss_problems, tensor_problems, update_problems
from workers_checkpoint_matrix import (ADAMW, CFG, SGD, STATE_KEYS, EndToEndGPT, batch, four_rank_sources,
                                       make_optimizer, pipeline_zero_load, pipeline_zero_save, resumed_runs,
                                       straight_runs, two_rank_loads, two_rank_sources_and_pipeline)

# from -> to: (checkpoint directory, step it was saved at, optimizer), the job and key of the result
MATRIX = [("adamw_tp2", "pp2", ADAMW, "tp2 -> pp2"), ("pp2", "tp2", ADAMW, "pp2 -> tp2"),
          ("hybrid4", "dp", ADAMW, "hybrid4 -> dp"), ("tp2_dp2", "data2", SGD, "tp2_dp2 -> data2"),
          ("zero1_ngroups2", "tp2", ADAMW, "zero1_ngroups2 -> tp2"), ("data2", "zero3", SGD, "data2 -> zero3")]
SAVED_AT = {"pp2": 4}


def _export(root, name: str, step: int) -> dict:
    path = f"{root}/{name}/step{step}"
    dcp_to_torch_save(path, f"{path}.pt")
    return torch.load(f"{path}.pt", weights_only=False)


def _flat_state(saved_optim: dict, kind: str) -> dict:
    return {f"{name}.{key}": value for name, entries in saved_optim["state"].items()
            for key, value in entries.items() if key in STATE_KEYS[kind]}


def _reference(saved: dict, optimizer, start: int, steps: int = 2) -> dict:
    """One process continues from the exported checkpoint on the whole global batches."""
    saved = copy.deepcopy(saved)           # the optimizer steps its state in place
    model = EndToEndGPT(CFG)
    model.load_state_dict(saved["model"], strict=True)
    opt = make_optimizer(optimizer, model.parameters())
    set_optimizer_state_dict(model, opt, saved["optim"])
    losses = []
    for step in range(start, start + steps):
        loss = model(batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    state = {f"{n}.{k}": v for n, p in model.named_parameters() for k, v in opt.state[p].items()}
    return {"losses": losses, "params": {k: v.detach() for k, v in model.state_dict().items()}, "state": state}


def _check_case(result: dict, saved: dict, optimizer, start: int) -> list[str]:
    kind = optimizer[0]
    problems = []
    if result["extra"] != {"step": start}:
        problems.append(f"extra {result['extra']}")
    # loaded: exactly the checkpoint's contents (before any step of the new plan)
    problems += tensor_problems(result["loaded"]["params"], saved["model"], "loaded", exact=True)
    problems += tensor_problems(result["loaded"]["state"], _flat_state(saved["optim"], kind), "loaded state",
                                exact=True)
    ref = _reference(saved, optimizer, start)
    problems += loss_problems(result["losses"], ref["losses"])
    if kind == "sgd":
        problems += tensor_problems(result["params"], ref["params"], "param")
        problems += tensor_problems(result["state"], ref["state"], "state")
        return problems
    # AdamW: each parameter's update from the checkpoint (parity's AdamW standard); its step counts exactly,
    # and its moments are sums of gradients (element by element)
    problems += update_problems(result["params"], ref["params"], saved["model"], "param")
    steps = {k: v for k, v in ref["state"].items() if k.endswith(".step")}
    problems += tensor_problems({k: v for k, v in result["state"].items() if k.endswith(".step")}, steps, "state",
                                exact=True)
    problems += tensor_problems({k: v for k, v in result["state"].items() if not k.endswith(".step")},
                                {k: v for k, v in ref["state"].items() if not k.endswith(".step")}, "state")
    return problems


def _check_layouts(results: list[dict]) -> None:
    """Each plan of the matrix is the one it is meant to be (c_attn: 32 x 96 = 3072 elements, wpe 15 x 32)."""
    attn, wpe = "blocks.0.attn.c_attn.weight", "wpe.weight"
    layouts = {key[len("saved "):]: [r[key]["layout"] for r in results if key in r]
               for key in results[0] if key.startswith("saved ")}
    assert all("_StridedShard" in r[attn]["placements"] and r[attn]["numel"] == 1536 for r in layouts["adamw_tp2"])
    assert [r[wpe]["zero"] for r in layouts["adamw_zero2"]] == [(2, 1, 1)] * 2       # one padding row
    assert [r[attn]["numel"] for r in layouts["pp2"]] == [3072, 0]                   # stage 0 on rank 0 only
    assert [r[attn]["numel"] for r in layouts["hybrid4"]] == [1536, 1536, 0, 0]      # stage 0 split over tp
    assert [r[attn]["numel"] for r in layouts["tp2_dp2"]] == [1536] * 4
    assert [r[wpe]["zero"] for r in layouts["zero1_ngroups2"]] == [(2, 2, 1)] * 4    # 2 groups of 2
    assert [r[attn]["numel"] for r in layouts["data2"]] == [3072] * 2


@pytest.mark.slow       # (about 50 s; test_checkpoint.py reshards in the default suite)
def test_checkpoint_resharding_matrix(tmp_path):
    root = str(tmp_path)
    first = run_ranks(two_rank_sources_and_pipeline, 2, root)
    four = run_ranks(four_rank_sources, 4, root)
    loads = run_ranks(two_rank_loads, 2, root)
    results = [{**a, **b} for a, b in zip(first + [{}, {}], four)]       # rank r of every job
    for rank, more in enumerate(loads):
        results[rank].update(more)

    _check_layouts(results)
    exported = {}
    table = []
    # every checkpoint holds exactly what its plan held when it saved (the same on every rank)
    for name, optimizer in (("adamw_tp2", ADAMW), ("adamw_zero2", ADAMW), ("pp2", ADAMW), ("data2", SGD),
                            ("hybrid4", ADAMW), ("tp2_dp2", SGD), ("zero1_ngroups2", ADAMW)):
        saved = exported[name] = _export(root, name, SAVED_AT.get(name, 2))
        problems = []
        for rank, result in enumerate(results):
            if f"saved {name}" not in result:
                continue
            held = result[f"saved {name}"]
            problems += tensor_problems(held["params"], saved["model"], f"rank {rank} param", exact=True)
            problems += tensor_problems(held["state"], _flat_state(saved["optim"], optimizer[0]), f"rank {rank} state",
                                        exact=True)
        table.append((name, "(export)", problems))
    for source, target, optimizer, key in MATRIX:
        problems = []
        for rank, result in enumerate(results[:2]):
            problems += [f"rank {rank} {p}" for p in _check_case(result[key], exported[source], optimizer,
                                                                    SAVED_AT.get(source, 2))]
        table.append((source, target, problems))

    # the same plan, a new job: bitwise equal to the straight run (parameters, AdamW state with its step,
    # losses, the GradScaler's scale and growth tracker)
    for name, plan, start in (("adamw tp2", "tp2", 2), ("adamw zero2", "zero2", 2), ("pp2", "pp2", 4)):
        problems = []
        for rank, result in enumerate(results[:2]):
            straight, resumed = result[f"straight {name.replace(' ', '_')}"], result[f"resumed {name}"]
            if resumed["extra"] != {"step": start}:
                problems.append(f"rank {rank} extra {resumed['extra']}")
            if resumed["losses"] != straight["losses"][-2:]:
                problems.append(f"rank {rank} losses {resumed['losses']} vs {straight['losses'][-2:]}")
            problems += tensor_problems(resumed["params"], straight["params"], f"rank {rank} param", exact=True)
            problems += tensor_problems(resumed["state"], straight["state"], f"rank {rank} state", exact=True)
            if resumed["scaler"] != straight["scaler"]:
                problems.append(f"rank {rank} scaler {resumed['scaler']} vs {straight['scaler']}")
        table.append((f"{name} step {start}", f"{plan} (new job, bitwise)", problems))

    report = "\n".join(f"{a:>22} -> {b:<26} {'ok' if not p else p[0] + f' (+{len(p) - 1} more)'}"
                       for a, b, p in table)
    print("\n" + report)
    assert not any(p for _, _, p in table), report


def _bitwise_problems(straight: list[dict], resumed: list[dict], plans: list[str]) -> list[str]:
    problems = []
    for rank, (a, b) in enumerate(zip(straight, resumed)):
        for plan in plans:
            ref, got = a[f"straight bitwise_{plan}"], b[f"resumed bitwise_{plan}"]
            if got["extra"] != {"step": 2}:
                problems.append(f"{plan} rank {rank}: extra {got['extra']}")
            if got["losses"] != ref["losses"][-2:]:
                problems.append(f"{plan} rank {rank}: losses {got['losses']} vs {ref['losses'][-2:]}")
            problems += tensor_problems(got["params"], ref["params"], f"{plan} rank {rank} param", exact=True)
            problems += tensor_problems(got["state"], ref["state"], f"{plan} rank {rank} AdamW state", exact=True)
    return problems


def test_a_new_job_resumes_bit_for_bit_under_dp_data_and_every_zero_level(tmp_path):
    """4 AdamW steps straight against 2 + save + a new job + load (before its first step) + 2: the same
    parameters, AdamW state (its step included) and losses, bit for bit, on each rank. (tp, ZeRO-2 and pp
    are in the matrix test.)"""
    plans = ["dp", "data2", "zero1", "zero3"]
    straight = run_ranks(straight_runs, 2, str(tmp_path), plans)
    resumed = run_ranks(resumed_runs, 2, str(tmp_path), plans)
    problems = _bitwise_problems(straight, resumed, plans)
    assert not problems, problems


@pytest.mark.slow       # (4 ranks, about 30 s; dp, data and every ZeRO level resume in the default suite)
def test_a_new_job_resumes_bit_for_bit_under_hybrid(tmp_path):
    """2 stages x tp 2 on 4 ranks, as above."""
    straight = run_ranks(straight_runs, 4, str(tmp_path), ["hybrid4"])
    resumed = run_ranks(resumed_runs, 4, str(tmp_path), ["hybrid4"])
    problems = _bitwise_problems(straight, resumed, ["hybrid4"])
    assert not problems, problems


@pytest.mark.slow
def test_a_pipeline_zero_checkpoint_loads_under_the_pipeline_on_two_ranks(tmp_path):
    """pp 2 x dp 2 with ZeRO-1 rows of the stages' parameters (4 ranks) -> pp 2 (2 ranks), AdamW."""
    root = str(tmp_path)
    saves = run_ranks(pipeline_zero_save, 4, root)
    assert [r["saved pp2_zero1"]["layout"]["blocks.0.attn.c_attn.weight"]["numel"] for r in saves] == [1536, 0] * 2
    assert saves[0]["saved pp2_zero1"]["layout"]["wpe.weight"]["zero"] == (2, 1, 1)
    saved = _export(root, "pp2_zero1", 2)
    problems = []
    for rank, result in enumerate(saves):
        problems += tensor_problems(result["saved pp2_zero1"]["params"], saved["model"], f"rank {rank} param",
                                    exact=True)
        problems += tensor_problems(result["saved pp2_zero1"]["state"], _flat_state(saved["optim"], "adamw"),
                                    f"rank {rank} state", exact=True)
    for rank, result in enumerate(run_ranks(pipeline_zero_load, 2, root)):
        problems += [f"rank {rank} {p}" for p in _check_case(result["pp2_zero1 -> pp2"], saved, ADAMW, 2)]
    assert not problems, problems


def test_grad_scaler_state_is_saved_with_scaler_and_exported(tmp_path):
    model = EndToEndGPT(CFG)
    opt = make_optimizer(ADAMW, model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
    for step in range(3):
        scaler.scale(model(batch(step))).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    path = str(tmp_path / "step3")
    dynshard.checkpoint.save(path, model, opt, extra={"step": 3}, scaler=scaler)
    other = torch.amp.GradScaler("cpu")
    assert dynshard.checkpoint.load(path, EndToEndGPT(CFG), scaler=other) == {"step": 3}
    assert other.state_dict() == scaler.state_dict() == {"scale": 512.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                                                        "growth_interval": 2, "_growth_tracker": 1}
    # the plain torch.save conversion holds it as scaler.state_dict() gave it: torch's scaler loads it
    dcp_to_torch_save(path, str(tmp_path / "full.pt"))
    plain = torch.amp.GradScaler("cpu")
    plain.load_state_dict(torch.load(str(tmp_path / "full.pt"), weights_only=False)["scaler"])
    assert plain.state_dict() == scaler.state_dict()

    # a checkpoint without scaler state: an enabled scaler is refused (nothing is loaded), a disabled one is not
    bare = str(tmp_path / "bare")
    dynshard.checkpoint.save(bare, model, opt, scaler=torch.amp.GradScaler("cpu", enabled=False))
    with pytest.raises(ValueError, match="holds no GradScaler state"):
        dynshard.checkpoint.load(bare, EndToEndGPT(CFG), scaler=torch.amp.GradScaler("cpu"))
    dynshard.checkpoint.load(bare, EndToEndGPT(CFG), scaler=torch.amp.GradScaler("cpu", enabled=False))
    dynshard.checkpoint.load(path, EndToEndGPT(CFG))       # saved scaler state, none asked for: ignored


def test_a_scalar_state_of_another_stages_parameter_keeps_its_scalar_size():
    """Adam's step of a parameter another pipeline rank holds: no piece to write or read, and the scalar
    size DCP compares with the saved one (it used to take the parameter's shape: a load failed)."""
    from dynshard.checkpoint.state import Pieces, describe
    from dynshard.runtime.sharding import ShardTag, StageOwnership

    owner = StageOwnership(stages=(1,), src=1, group=None, held=False)
    tag = ShardTag(fqn="w", global_shape=torch.Size((4, 3)), global_stride=(3, 1), placements=(), layout=None,
                   owner=owner)
    step, moment = describe(torch.tensor(2.0), tag), describe(torch.empty(0), tag)
    assert isinstance(step, Pieces) and step.size() == torch.Size(()) and step.chunks == []
    assert isinstance(moment, Pieces) and moment.size() == torch.Size((4, 3)) and moment.chunks == []
