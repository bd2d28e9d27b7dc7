"""dynshard.checkpoint across plans: save under plan A, load under plan B, continue, compare with one process.

Three jobs share one directory of checkpoints: a 2-rank job (tp2 -> pp2 -> tp2, a data2 save, two straight
AdamW runs that save halfway), a 4-rank job (hybrid, tp2 x dp2, ZeRO-1 in 2 groups) and a new 2-rank job that
loads the 4-rank saves under other plans, data2 under ZeRO-3, and resumes the AdamW runs. Every checkpoint is
exported with ``dcp_to_torch_save``: it must hold exactly what the saving plan held, a plan that loads it must
hold exactly that before it steps, and its next steps must match one process continuing from the export.
"""

from __future__ import annotations

import copy

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

from distributed import run_ranks
from workers_checkpoint_matrix import (ADAMW, CFG, SGD, STATE_KEYS, EndToEndGPT, batch, four_rank_sources,
                                       make_optimizer, two_rank_loads, two_rank_sources_and_pipeline)

# from -> to: (checkpoint directory, step it was saved at, optimizer), the job and key of the result
MATRIX = [("tp2", "pp2", SGD, "tp2 -> pp2"), ("pp2", "tp2", SGD, "pp2 -> tp2"),
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


def _check_equal(got: dict, expected: dict, what: str) -> list[str]:
    problems = [f"{what}: keys {sorted(set(got) ^ set(expected))}"] if got.keys() != expected.keys() else []
    for key in sorted(got.keys() & expected.keys()):
        if not torch.equal(got[key], expected[key]):
            problems.append(f"{what} {key}: differs (max {float((got[key] - expected[key]).abs().max()):.3g})")
    return problems


def _check_close(got: dict, expected: dict, what: str, rtol=1e-4, atol=1e-6) -> list[str]:
    problems = []
    for key, value in expected.items():
        try:
            torch.testing.assert_close(got[key], value, rtol=rtol, atol=atol)
        except (AssertionError, KeyError) as error:
            problems.append(f"{what} {key}: {str(error).splitlines()[0]}")
    return problems


def _check_case(result: dict, saved: dict, optimizer, start: int) -> list[str]:
    kind = optimizer[0]
    problems = []
    if result["extra"] != {"step": start}:
        problems.append(f"extra {result['extra']}")
    # loaded: exactly the checkpoint's contents (before any step of the new plan)
    problems += _check_equal(result["loaded"]["params"], saved["model"], "loaded")
    problems += _check_equal(result["loaded"]["state"], _flat_state(saved["optim"], kind), "loaded state")
    ref = _reference(saved, optimizer, start)
    if kind == "sgd":
        problems += _check_close({"losses": torch.tensor(result["losses"])}, {"losses": torch.tensor(ref["losses"])},
                                 "", rtol=1e-4, atol=1e-6)
        problems += _check_close(result["params"], ref["params"], "param")
        problems += _check_close(result["state"], ref["state"], "state")
        return problems
    # AdamW divides by sqrt(exp_avg_sq): an element with a near-zero gradient turns rounding noise into a
    # full step, so updates are compared per tensor (their norms); the moments are sums of gradients
    problems += _check_close({"losses": torch.tensor(result["losses"])}, {"losses": torch.tensor(ref["losses"])},
                             "", rtol=1e-5, atol=0)
    for name, expected in ref["params"].items():
        update, ref_update = result["params"][name] - saved["model"][name], expected - saved["model"][name]
        torch_norms = (torch.linalg.vector_norm(update), torch.linalg.vector_norm(ref_update))
        if not torch.allclose(*torch_norms, rtol=1e-3, atol=1e-7):
            problems.append(f"update norm {name}: {float(torch_norms[0]):.6g} vs {float(torch_norms[1]):.6g}")
    steps = {k: v for k, v in ref["state"].items() if k.endswith(".step")}
    problems += _check_equal({k: result["state"][k] for k in steps}, steps, "state")
    moments = {k: v for k, v in ref["state"].items() if not k.endswith(".step")}
    problems += _check_close(result["state"], moments, "state", rtol=1e-4, atol=1e-6)
    return problems


def test_checkpoint_resharding_matrix(tmp_path):
    root = str(tmp_path)
    first = run_ranks(two_rank_sources_and_pipeline, 2, root)
    four = run_ranks(four_rank_sources, 4, root)
    loads = run_ranks(two_rank_loads, 2, root)
    results = [{**a, **b} for a, b in zip(first + [{}, {}], four)]       # rank r of every job
    for rank, more in enumerate(loads):
        results[rank].update(more)

    exported = {}
    table, failures = [], []
    # every checkpoint holds exactly what its plan held when it saved (the same on every rank)
    for name, optimizer in (("tp2", SGD), ("pp2", SGD), ("data2", SGD), ("hybrid4", ADAMW), ("tp2_dp2", SGD),
                            ("zero1_ngroups2", ADAMW)):
        saved = exported[name] = _export(root, name, SAVED_AT.get(name, 2))
        problems = []
        for rank, result in enumerate(results):
            if f"saved {name}" not in result:
                continue
            held = result[f"saved {name}"]
            problems += _check_equal(held["params"], saved["model"], f"rank {rank} param")
            # (AdamW's step is a scalar each rank has for the parameters it holds; pipelines hold some)
            expected = {k: v for k, v in _flat_state(saved["optim"], optimizer[0]).items()
                        if k in held["state"] or not k.endswith(".step")}
            problems += _check_equal(held["state"], expected, f"rank {rank} state")
        table.append((name, "(export)", problems))
    for source, target, optimizer, key in MATRIX:
        problems = []
        for rank, result in enumerate(results[:2]):
            problems += [f"rank {rank} {p}" for p in _check_case(result[key], exported[source], optimizer,
                                                                    SAVED_AT.get(source, 2))]
        table.append((source, target, problems))

    # the same plan, a new job: bitwise equal to the straight run (parameters, AdamW state with its step,
    # losses, the GradScaler's scale and growth tracker)
    for plan in ("tp2", "zero2"):
        problems = []
        for rank, result in enumerate(results[:2]):
            straight, resumed = result[f"straight adamw {plan}"], result[f"resumed adamw {plan}"]
            if resumed["extra"] != {"step": 2}:
                problems.append(f"rank {rank} extra {resumed['extra']}")
            if resumed["losses"] != straight["losses"][2:]:
                problems.append(f"rank {rank} losses {resumed['losses']} vs {straight['losses'][2:]}")
            problems += _check_equal(resumed["params"], straight["params"], f"rank {rank} param")
            problems += _check_equal(resumed["state"], straight["state"], f"rank {rank} state")
            if resumed["scaler"] != straight["scaler"]:
                problems.append(f"rank {rank} scaler {resumed['scaler']} vs {straight['scaler']}")
        table.append((f"adamw {plan} step 2", f"{plan} (new job, bitwise)", problems))

    report = "\n".join(f"{a:>22} -> {b:<26} {'ok' if not p else p[0] + f' (+{len(p) - 1} more)'}"
                       for a, b, p in table)
    print("\n" + report)
    assert not any(p for _, _, p in table), report
