"""dynshard.Config: validation, environment variables, and the errors a user sees."""

from __future__ import annotations

import pytest

from dynshard import Config, ConfigError


def test_options_may_be_a_config_or_a_dict_with_the_same_keys():
    assert Config.from_options({"policy": "tp", "plan_ngpus": 2}, environ={}) == Config(policy="tp", plan_ngpus=2)
    assert Config.from_options(Config(policy="data", plan_ngpus=2), environ={}).policy == "data"


def test_no_options_means_data_parallelism_over_all_ranks():
    config = Config.from_options(None, environ={}).resolve(world_size=4)
    assert (config.policy, config.plan_ngpus, config.runtime_ngpus) == ("dp", 1, 4)


def test_unknown_option_key_is_rejected_with_the_valid_keys():
    with pytest.raises(ConfigError, match=r"unknown option\(s\) 'plan_gpus'.*valid options are plan_ngpus"):
        Config.from_options({"plan_gpus": 2}, environ={})


def test_every_field_can_come_from_the_environment_and_explicit_options_win():
    env = {"DYNSHARD_PLAN_NGPUS": "2", "DYNSHARD_POLICY": "tp", "DYNSHARD_COMPILER": "aot_eager",
           "DYNSHARD_INFERENCE_ONLY": "true", "DYNSHARD_PAS_CONFIG": '{"seed": 3}'}
    config = Config.from_options({"compiler": "inductor"}, environ=env)
    assert (config.plan_ngpus, config.policy, config.compiler, config.inference_only) == (2, "tp", "inductor", True)
    assert dict(config.pas_config) == {"seed": 3}
    assert set(Config.fields()) == {"plan_ngpus", "runtime_ngpus", "policy", "pas_config", "user_config",
                                    "inference_only", "constant_folding", "trace_strategy", "compiler", "cache_dir",
                                    "use_zero", "zero_ngroups", "zero_use_reduce_scatter", "use_async_reducer",
                                    "reducer_bucket_cap_mb", "mixed_precision", "recompute_modules", "param_init_fn",
                                    "gather_outputs", "use_end2end", "trace_dir", "regional_compile",
                                    "compile_scope", "share_traces", "verify_inputs_every", "broadcast_buffers",
                                    "save_plan_path", "load_plan_path", "partition_constraints"}
    pinned = Config.from_options(None, environ={"DYNSHARD_PARTITION_CONSTRAINTS": '{"lm_head.weight": "replicate"}'})
    assert dict(pinned.partition_constraints) == {"lm_head.weight": "R"}


def test_plan_files_come_from_the_environment_and_are_paths():
    env = {"DYNSHARD_SAVE_PLAN_PATH": "out/gpt.plan.json", "DYNSHARD_LOAD_PLAN_PATH": "in.plan.json"}
    config = Config.from_options(None, environ=env)
    assert (config.save_plan_path, config.load_plan_path) == ("out/gpt.plan.json", "in.plan.json")
    with pytest.raises(ConfigError, match="load_plan_path must be a file path"):
        Config(load_plan_path=3)


def test_the_unit_checks_read_the_environment_and_refuse_bad_values():
    env = {"DYNSHARD_VERIFY_INPUTS_EVERY": "0", "DYNSHARD_BROADCAST_BUFFERS": "false"}
    config = Config.from_options(None, environ=env)
    assert (config.verify_inputs_every, config.broadcast_buffers) == (0, False)
    assert (Config().verify_inputs_every, Config().broadcast_buffers) == (100, True)
    with pytest.raises(ConfigError, match="verify_inputs_every must be an integer >= 0"):
        Config(verify_inputs_every=-1)
    with pytest.raises(ConfigError, match="broadcast_buffers must be True or False"):
        Config(broadcast_buffers="yes")
    assert Config(broadcast_buffers=False).cache_token() != Config().cache_token()   # ranks must agree


def test_share_traces_reads_auto_from_the_environment_and_is_not_part_of_the_plan():
    assert Config.from_options(None, environ={"DYNSHARD_SHARE_TRACES": "auto"}).share_traces is None
    assert Config.from_options(None, environ={"DYNSHARD_SHARE_TRACES": "1"}).share_traces is True
    assert Config(share_traces=True).cache_token() == Config().cache_token()
    with pytest.raises(ConfigError, match="share_traces must be True, False or None"):
        Config(share_traces="sometimes")


def test_unknown_or_unreadable_environment_variables_are_errors():
    with pytest.raises(ConfigError, match="unknown environment variable DYNSHARD_PLAN_GPUS"):
        Config.from_options(None, environ={"DYNSHARD_PLAN_GPUS": "2"})
    with pytest.raises(ConfigError, match="cannot read DYNSHARD_PLAN_NGPUS='two'"):
        Config.from_options(None, environ={"DYNSHARD_PLAN_NGPUS": "two"})


def test_world_size_must_match_runtime_ngpus():
    with pytest.raises(ConfigError, match="runtime_ngpus=4 but the job has 2 ranks"):
        Config(runtime_ngpus=4).resolve(world_size=2)


def test_runtime_ngpus_must_be_a_multiple_of_plan_ngpus():
    with pytest.raises(ConfigError, match="runtime_ngpus=3 is not a multiple of plan_ngpus=2"):
        Config(policy="tp", plan_ngpus=2, runtime_ngpus=3)
    with pytest.raises(ConfigError, match="plan_ngpus=2 does not divide the world size 3"):
        Config(policy="tp", plan_ngpus=2).resolve(world_size=3)


@pytest.mark.parametrize("kwargs,message", [
    ({"plan_ngpus": 0}, "plan_ngpus must be a positive integer"),
    ({"policy": "zero"}, "unknown policy 'zero'"),
    ({"policy": "dp", "plan_ngpus": 2}, "policy 'dp' needs plan_ngpus=1"),
    ({"compiler": "tvm"}, "unknown compiler 'tvm'"),
    ({"trace_strategy": "cuda"}, "unknown trace_strategy 'cuda'"),
    ({"constant_folding": True}, "needs inference_only=True"),
    ({"compile_scope": "layers"}, "unknown compile_scope 'layers'; use one of program, blocks"),
    ({"compile_scope": "blocks", "regional_compile": False}, "needs regional_compile=True"),
    ({"pas_config": [1]}, "pas_config must be a dict"),
])
def test_invalid_fields_say_what_to_change(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        Config(**kwargs)


def test_config_is_frozen_and_its_dicts_are_read_only():
    config = Config(pas_config={"a": 1})
    with pytest.raises(Exception):
        config.plan_ngpus = 2
    with pytest.raises(TypeError):
        config.pas_config["a"] = 2


def test_a_callable_policy_is_accepted_and_keyed_by_name():
    def my_policy(plan, config):
        pass
    assert "my_policy" in Config(policy=my_policy, plan_ngpus=2).cache_token()


def test_backend_name_resolves_through_the_entry_point_without_importing_dynshard():
    import subprocess
    import sys

    code = ("import sys, torch; from torch._dynamo.backends.registry import lookup_backend; "
            "fn = lookup_backend('dynshard'); print(fn.__module__, fn.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["dynshard.backend", "dynshard_backend"]


def test_memory_fields_take_nnscaler_names_and_come_from_the_environment():
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    env = {"DYNSHARD_USE_ZERO": "true", "DYNSHARD_ZERO_NGROUPS": "2", "DYNSHARD_REDUCER_BUCKET_CAP_MB": "4",
           "DYNSHARD_MIXED_PRECISION": '{"param_dtype": "bfloat16", "reduce_dtype": "float32"}',
           "DYNSHARD_RECOMPUTE_MODULES": " Block, blocks.0 ", "DYNSHARD_USE_ASYNC_REDUCER": "1"}
    config = Config.from_options(None, environ=env)
    assert (config.use_zero, config.zero_ngroups, config.reducer_bucket_cap_mb) == (1, 2, 4.0)
    assert config.use_async_reducer
    assert config.mixed_precision == MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert config.recompute_names == ("Block", "blocks.0")
    assert Config(use_zero=True) == Config(use_zero=1)
    assert Config(mixed_precision=MixedPrecisionPolicy(torch.float16)).mixed_precision.param_dtype == torch.float16


def test_every_memory_field_is_part_of_the_plan_key():
    base = Config(use_zero=1).cache_token()
    for changed in (Config(use_zero=2), Config(use_zero=1, zero_ngroups=2),
                    Config(use_zero=1, zero_use_reduce_scatter=True),
                    Config(use_zero=1, use_async_reducer=True), Config(use_zero=1, reducer_bucket_cap_mb=1),
                    Config(use_zero=1, mixed_precision={"param_dtype": "bfloat16"}),
                    Config(use_zero=1, recompute_modules="Block")):
        assert changed.cache_token() != base


@pytest.mark.parametrize("kwargs,message", [
    ({"use_zero": 4}, "use_zero must be 0/False, 1/True, 2 or 3"),
    ({"zero_ngroups": 2}, "zero_ngroups=2 only applies with use_zero >= 1"),
    ({"zero_use_reduce_scatter": True}, "zero_use_reduce_scatter=True only applies with use_zero"),
    ({"use_zero": 1, "zero_ngroups": 2, "zero_use_reduce_scatter": True}, "needs zero_ngroups=1"),
    ({"reducer_bucket_cap_mb": -1}, "reducer_bucket_cap_mb must be None or a number >= 0"),
    ({"mixed_precision": {"param_dtype": "int8"}}, "must be a floating dtype"),
    ({"mixed_precision": {"dtype": "bfloat16"}}, "unknown mixed_precision field"),
    ({"mixed_precision": "bf16"}, "must be a torch.distributed.fsdp.MixedPrecisionPolicy or a dict"),
    ({"recompute_modules": ["Block"]}, "recompute_modules is a comma-separated string"),
])
def test_invalid_memory_settings_say_what_to_change(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        Config(**kwargs)


def test_zero_groups_must_divide_the_data_parallel_units():
    with pytest.raises(ConfigError, match="zero_ngroups=3 does not divide the 4 data-parallel units"):
        Config(use_zero=1, zero_ngroups=3).resolve(world_size=4)
    assert Config(policy="tp", plan_ngpus=2, use_zero=3, zero_ngroups=2).resolve(world_size=8).zero_ngroups == 2
