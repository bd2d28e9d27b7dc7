"""policy="pp": its pas_config, the errors a user sees before any work, and one-process pipelines."""

from __future__ import annotations

import pytest
import torch

import dynshard
from dynshard import Config, ConfigError
from workers_pipeline import EndToEndMLP, build

PP = dict(policy="pp", use_end2end=True)


@pytest.mark.parametrize("options, message", [
    (dict(pas_config={}), r"need pas_config\['pipeline_nmicros'\]"),
    (dict(pas_config={"pipeline_nmicros": 4, "pipeline_stages": 2}), r"no option 'pipeline_stages'"),
    (dict(pas_config={"pipeline_nmicros": 0}), r"pipeline_nmicros'\] must be a positive integer"),
    (dict(pas_config={"pipeline_nmicros": 4, "pipeline_scheduler": "1f2b"}), r"unknown pipeline_scheduler '1f2b'"),
    (dict(pas_config={"pipeline_nmicros": 4, "pipeline_nstages": 3}, plan_ngpus=2),
     r"pipeline_nstages=3 does not fit plan_ngpus=2 x pipeline_nchunks=1"),
    (dict(pas_config={"pipeline_nmicros": 4, "pipeline_nchunks": 2}, plan_ngpus=2),
     r"pipeline_nchunks=2 needs pipeline_scheduler '1f1b_interleaved'"),
    (dict(pas_config={"pipeline_nmicros": 4, "pipeline_scheduler": "infer_pipe"}), r"runs forward only"),
    (dict(pas_config={"pipeline_nmicros": 4}, inference_only=True), r"with inference_only=True use 'infer_pipe'"),
    (dict(pas_config={"pipeline_nmicros": 4, "pipeline_scheduler": "chimera_direct"}, plan_ngpus=2),
     r"chimera_direct runs exactly 4 stages .* pipeline_nstages=2, pipeline_nmicros=4"),
    (dict(pas_config={"pipeline_nmicros": 3, "pipeline_scheduler": "chimera_direct"}, plan_ngpus=4),
     r"an even pipeline_nmicros"),
    (dict(pas_config={"pipeline_nmicros": 4, "pipeline_scheduler": "1f1b_plus"}, use_zero=1),
     r"use_zero with pipeline_scheduler '1f1b_plus' is not built yet"),
    (dict(policy="hybrid", plan_ngpus=4, pas_config={"pipeline_nmicros": 4}), r"'hybrid' needs pas_config\['pipeline_nstages'\]"),
    (dict(policy="hybrid", plan_ngpus=4, pas_config={"pipeline_nmicros": 4, "pipeline_nstages": 3}),
     r"runs 3 pipeline ranks .* does not divide plan_ngpus=4"),
    (dict(pas_config={"pipeline_nmicros": 4, "sequence_parallel": True}), r"use policy 'hybrid'"),
])
def test_invalid_pipeline_configs_say_what_to_change(options, message):
    with pytest.raises(ConfigError, match=message):
        Config(**{**PP, **options})


def test_pipelines_need_an_end_to_end_module():
    with pytest.raises(ConfigError, match="needs use_end2end=True"):
        Config(policy="pp", pas_config={"pipeline_nmicros": 4})


def test_pipeline_options_are_typed_and_default_to_1f1b_over_every_rank_of_a_unit():
    config = Config(**PP, plan_ngpus=2, pas_config={"pipeline_nmicros": 8, "pipeline_pivots": "Block, Head"})
    options = config.pipeline
    assert (options.pipeline_scheduler, options.nstages(config), options.pivots) == ("1f1b", 2, ("Block", "Head"))
    env = Config.from_options(None, environ={"DYNSHARD_POLICY": "pp", "DYNSHARD_USE_END2END": "1",
                                              "DYNSHARD_PAS_CONFIG": '{"pipeline_nmicros": 2}'})
    assert env.is_pipeline and env.pipeline.pipeline_nmicros == 2


def _one_process(model, scheduler="gpipe", nchunks=1, m=4):
    return torch.compile(model, backend="dynshard", options=Config(**PP, compiler="aot_eager", pas_config={
        "pipeline_nmicros": m, "pipeline_scheduler": scheduler, "pipeline_nchunks": nchunks}))


def test_train_step_refuses_the_wrong_number_of_samples_before_any_work():
    model, make = build("mlp")
    compiled = _one_process(model)
    with pytest.raises(ValueError, match=r"got 3 samples but the pipeline runs pipeline_nmicros=4"):
        dynshard.train_step(compiled, [make(2, i) for i in range(3)])
    assert all(p.grad is None for p in model.parameters())


def test_a_batch_that_does_not_split_into_the_micro_batches_is_an_error():
    model, make = build("mlp")
    with pytest.raises(Exception, match=r"batch size 6, which does not split into 4 equal micro-batches"):
        _one_process(model)(make(6, 0))


def test_a_graph_break_inside_the_pipelined_model_is_an_error():
    class Broken(EndToEndMLP):
        def forward(self, batch):
            x = batch["x"] + self.blocks[0](batch["x"])
            torch._dynamo.graph_break()
            for block in self.blocks[1:]:
                x = x + block(x)
            return torch.nn.functional.mse_loss(self.head(x).squeeze(-1), batch["y"])

    model, make = Broken(), build("mlp")[1]
    with pytest.raises(RuntimeError, match="must compile into one graph"):
        dynshard.train_step(_one_process(model), [make(2, i) for i in range(4)])
    with pytest.raises(Exception, match="a graph break splits the model into several graphs"):
        _one_process(Broken())(make(8, 0)).backward()
