"""dynshard.checkpoint when things go wrong: a save over an existing checkpoint killed at any point, and a
checkpoint loaded into an optimizer or model it does not match. One process, plain modules."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import dynshard
import dynshard.checkpoint.io as ckpt_io
from parity import assert_tensors_equal

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Killed(Exception):
    """Stands for the job dying at that instant."""


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


def _step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _loaded(path: str) -> tuple[object, dict[str, torch.Tensor]]:
    model = _model(seed=1)
    extra = dynshard.checkpoint.load(path, model)
    return extra, _weights(model)


def _kill_at(where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the next save to a checkpoint that exists die at ``where``."""
    replace = os.replace

    def replace_then_die(src, dst, *args, **kwargs):
        replace(src, dst, *args, **kwargs)
        done = {"moved_aside": ckpt_io._OLD in os.fspath(dst), "renamed": ckpt_io._TMP in os.fspath(src)}
        if done.get(where):
            raise Killed(where)

    def die(*args, **kwargs):
        raise Killed(where)

    if where == "written":                      # every rank wrote, rank 0 died before its first rename
        monkeypatch.setattr(ckpt_io, "publish", die)
    elif where in ("moved_aside", "renamed"):   # the old one renamed aside; the new one renamed into place
        monkeypatch.setattr(ckpt_io.os, "replace", replace_then_die)
    elif where == "marked":                     # the new one complete, the leftovers not yet removed
        monkeypatch.setattr(ckpt_io.shutil, "rmtree", die)
    else:
        raise ValueError(where)


# the names (their beginnings) a save over "last" killed there leaves, and whose contents latest() gives
KILLED_SAVES = {
    "written": (["last", "last.tmp-"], "old"),
    "moved_aside": (["last.old-", "last.tmp-"], "old"),
    "renamed": (["last", "last.old-"], "old"),      # "last" is the new one, without its COMPLETE marker yet
    "marked": (["last", "last.old-"], "new"),
}


@pytest.mark.parametrize("where", list(KILLED_SAVES))
def test_a_save_over_a_checkpoint_killed_anywhere_leaves_a_complete_one_and_the_next_save_cleans_up(
        tmp_path, monkeypatch, where):
    root = str(tmp_path)
    path = os.path.join(root, "last")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _step(model, opt)
    dynshard.checkpoint.save(path, model, opt, extra={"step": 1})
    old = _weights(model)
    _step(model, opt)
    new = _weights(model)

    with monkeypatch.context() as patch:
        _kill_at(where, patch)
        with pytest.raises(Killed):
            dynshard.checkpoint.save(path, model, opt, extra={"step": 2})
    left, expected = KILLED_SAVES[where]
    names = sorted(os.listdir(root))
    assert [n[:len(p)] for n, p in zip(names, left)] == left and len(names) == len(left), names

    latest = dynshard.checkpoint.latest(root)
    assert latest is not None and ckpt_io._TMP not in latest, names
    extra, weights = _loaded(latest)
    assert extra == {"step": 1 if expected == "old" else 2}, (where, latest)
    assert_tensors_equal(weights, old if expected == "old" else new)
    if where == "moved_aside":               # "last" is gone: load("…/last") reads the one moved aside
        extra, weights = _loaded(path)
        assert extra == {"step": 1}
        assert_tensors_equal(weights, old)

    _step(model, opt)
    dynshard.checkpoint.save(path, model, opt, extra={"step": 3})
    assert os.listdir(root) == ["last"]
    assert dynshard.checkpoint.latest(root) == path
    extra, weights = _loaded(path)
    assert extra == {"step": 3}
    assert_tensors_equal(weights, _weights(model))


def test_latest_stands_a_checkpoint_moved_aside_for_its_name_and_a_save_removes_only_its_own_leftovers(tmp_path):
    def make(name: str, complete: bool = True) -> None:
        os.makedirs(tmp_path / name)
        if complete:
            (tmp_path / name / "COMPLETE").write_text("ok\n")

    make("step1")
    make("step2.old-aaa")        # a save over step2 killed after moving it aside
    make("step2", complete=False)
    assert dynshard.checkpoint.latest(str(tmp_path)) == str(tmp_path / "step2.old-aaa")
    make("step3")
    make("step3.old-bbb")        # killed after the new step3 was complete
    assert dynshard.checkpoint.latest(str(tmp_path)) == str(tmp_path / "step3")

    make("step1.tmp-ccc", complete=False)
    make("step1.old-ddd")
    make("step10.tmp-eee", complete=False)
    model = _model()
    dynshard.checkpoint.save(str(tmp_path / "step1"), model)
    assert sorted(os.listdir(tmp_path)) == ["step1", "step10.tmp-eee", "step2", "step2.old-aaa", "step3",
                                            "step3.old-bbb"]


def _saved(tmp_path, optimizer_cls, **options) -> str:
    model = _model()
    opt = optimizer_cls(model.parameters(), **options)
    _step(model, opt)
    path = str(tmp_path / "ckpt")
    dynshard.checkpoint.save(path, model, opt, extra={"step": 1})
    return path


_WHAT_TO_DO = r"Build the optimizer the checkpoint was saved with .*call load\(path, model\) without the optimizer"


@pytest.mark.parametrize("stepped", [False, True], ids=["before_first_step", "after_a_step"])
@pytest.mark.parametrize("saved, loading, message", [
    ((torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}), (torch.optim.AdamW, {}),
     "parameter 0.weight needs optimizer state exp_avg, exp_avg_sq, step, but the checkpoint holds momentum_buffer"),
    ((torch.optim.AdamW, {}), (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
     "parameter 0.weight needs optimizer state momentum_buffer, but the checkpoint holds exp_avg, exp_avg_sq, step"),
    ((torch.optim.AdamW, {}), (torch.optim.SGD, {"lr": 0.1}),    # no state at all: its options tell
     "its parameter group 0 has options dampening, momentum, nesterov, which the checkpoint's group lacks"),
], ids=["sgd_to_adamw", "adamw_to_sgd", "adamw_to_plain_sgd"])
def test_loading_into_another_optimizer_says_what_differs_and_what_to_do_before_reading(
        tmp_path, saved, loading, message, stepped):
    path = _saved(tmp_path, saved[0], **saved[1])
    model = _model(seed=1)
    opt = loading[0](model.parameters(), **loading[1])
    if stepped:
        _step(model, opt)
    before = _weights(model)
    with pytest.raises(ValueError, match=f"does not match this {loading[0].__name__}: {message}.*{_WHAT_TO_DO}"):
        dynshard.checkpoint.load(path, model, opt)
    assert_tensors_equal(_weights(model), before)          # nothing was read
    assert dynshard.checkpoint.load(path, model) == {"step": 1}     # the weights alone, as the error says


def test_loading_into_an_optimizer_over_other_parameters_says_so(tmp_path):
    path = _saved(tmp_path, torch.optim.SGD, lr=0.1, momentum=0.9)
    model = _model(seed=1)
    params = list(model.parameters())
    with pytest.raises(ValueError, match=r"the checkpoint has optimizer state for 2\.weight, 2\.bias, which this "
                                         f"optimizer does not hold.*{_WHAT_TO_DO}"):
        dynshard.checkpoint.load(path, model, torch.optim.SGD(params[:2], lr=0.1, momentum=0.9))
    groups = [{"params": params[:2]}, {"params": params[2:], "lr": 0.01}]
    with pytest.raises(ValueError, match=f"it has 2 parameter groups, the checkpoint 1.*{_WHAT_TO_DO}"):
        dynshard.checkpoint.load(path, model, torch.optim.SGD(groups, lr=0.1, momentum=0.9))
    no_optimizer = str(tmp_path / "weights")
    dynshard.checkpoint.save(no_optimizer, model)
    with pytest.raises(ValueError, match="the checkpoint holds no optimizer"):
        dynshard.checkpoint.load(no_optimizer, model, torch.optim.SGD(params, lr=0.1))


def test_loading_into_a_model_with_other_parameter_names_names_them(tmp_path):
    path = _saved(tmp_path, torch.optim.SGD, lr=0.1)
    torch.manual_seed(1)
    bigger = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2), nn.Linear(2, 2))
    before = _weights(bigger)
    with pytest.raises(ValueError, match=r"holds no 3\.weight, 3\.bias of this model: load it into the model it "
                                         "was saved from"):
        dynshard.checkpoint.load(path, bigger)
    assert_tensors_equal(_weights(bigger), before)
    renamed = nn.Sequential()
    renamed.add_module("first", nn.Linear(4, 3))
    with pytest.raises(ValueError, match=r"holds no first\.weight, first\.bias of this model \(it holds 0\.bias, "
                                         r"0\.weight, 2\.bias, 2\.weight instead\)"):
        dynshard.checkpoint.load(path, renamed)


def test_planning_failed_error_is_public():
    from dynshard.backend.agreement import PlanningFailedError

    assert dynshard.PlanningFailedError is PlanningFailedError and "PlanningFailedError" in dynshard.__all__
    assert issubclass(dynshard.PlanningFailedError, dynshard.PlanMismatchError)


def test_a_tied_weight_is_written_once_and_both_keys_load(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from models import GPT, GPTConfig, gpt_batch

    cfg = GPTConfig(vocab=512, layers=1)
    model = GPT(cfg)
    path = str(tmp_path / "tied")
    dynshard.checkpoint.save(path, model)
    metadata = dcp.FileSystemReader(path).read_metadata()
    storage = {index.fqn: info for index, info in metadata.storage_data.items()}
    assert storage["model.lm_head.weight"] == storage["model.wte.weight"]       # the same bytes
    data = sum(info.length for fqn, info in storage.items() if fqn != "model.lm_head.weight")
    assert os.path.getsize(os.path.join(path, "__0_0.distcp")) == data
    dcp_to_torch_save(path, str(tmp_path / "tied.pt"))
    plain = GPT(cfg)
    plain.load_state_dict(torch.load(str(tmp_path / "tied.pt"), weights_only=False)["model"], strict=True)
    assert torch.equal(plain.lm_head.weight, model.wte.weight)
    again = GPT(GPTConfig(vocab=512, layers=1))
    dynshard.checkpoint.load(path, again)
    assert again.lm_head.weight is again.wte.weight and torch.equal(again.wte.weight, model.wte.weight)
    assert torch.equal(again(*gpt_batch(cfg, 2, 0)), model(*gpt_batch(cfg, 2, 0)))
