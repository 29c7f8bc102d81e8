"""Config values and config files of the long tail, through the real CLI: exit 2, one line naming
the file or key; nothing runs (a negative batch size once trained a step)."""

import pytest

from tests.helpers.cli_run import STS_SOURCE, in_process, write_config, write_sts_data


@pytest.mark.parametrize("size", [0, -4])
def test_a_batch_size_below_one_is_a_config_error_naming_the_key(tmp_path, capfd, size):
    write_sts_data(tmp_path)
    config = write_config(tmp_path, [STS_SOURCE], train={"stages": [{"name": "s1", "batch_size": {"sts": size}}]})
    in_process(capfd, "train", "--config", config).assert_one_line_error(
        "train.stages[s1].batch_size.sts: Input should be greater than 0")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("section,settings", [
    ("mine", {}), ("evaluate", {"tasks": [{"name": "T", "type": "sts", "path": "sts.csv"}]})])
def test_an_encoding_batch_size_below_one_is_a_config_error(tmp_path, capfd, section, settings):
    write_sts_data(tmp_path)
    config = write_config(tmp_path, [STS_SOURCE], **{section: {"batch_size": 0, **settings}})
    in_process(capfd, section, "--config", config).assert_one_line_error(f"{section}.batch_size")


def test_a_config_that_is_a_symlink_loop_is_one_line(tmp_path, capfd):
    loop = tmp_path / "a.yaml"
    loop.symlink_to("a.yaml")
    in_process(capfd, "prepare", "--config", loop).assert_one_line_error(f"{loop}: ", "symbolic links")


def test_deepspeed_zero3_is_a_one_line_config_error_before_anything_runs(tmp_path, capfd):
    write_sts_data(tmp_path)
    config = write_config(tmp_path, [STS_SOURCE], train={"deepspeed": {"zero_optimization": {"stage": 3}},
                                                         "stages": [{"name": "s1"}]})
    in_process(capfd, "train", "--config", config).assert_one_line_error(
        str(config), "deepspeed.zero_optimization.stage 3 (ZeRO-3) is not supported",
        "use train.sharding: fsdp", "or ZeRO stage 1 or 2")
    assert not (tmp_path / "runs").exists()


# The options added by the scale and quality rounds, each with a value a user could type: one line
# naming the key, exit 2, before anything runs (issue 44, item 3).
BAD_OPTIONS = [
    ("train", {"packing": "yes"}, "train.packing"),
    ("train", {"processes": 0}, "train.processes"),
    ("train", {"processes": "many"}, "train.processes"),
    ("train", {"processes": 1000000000}, "train.processes: a number of processes from 1 to 1024"),
    ("train", {"weights_dtype": "fp16"}, "train.weights_dtype"),
    ("train", {"sharding": "zero3"}, "train.sharding"),
    ("train", {"dist_timeout_s": 0}, "train.dist_timeout_s"),
    ("stage", {"remine": {"num_negatives": 2, "range_mim": 3}}, "train.stages[s1].remine"),
    ("stage", {"merge": {"stage": "s1", "weight": 1.5}}, "train.stages[s1].merge"),
    ("stage", {"targeted_synthesis": {"datasets": []}}, "train.stages[s1].targeted_synthesis.datasets"),
    ("stage", {"matryoshka": {"dims": [8, 8]}}, "train.stages[s1].matryoshka"),
    # non-finite numbers (issue 62): a NaN weight trained NaN weights and committed them
    ("stage", {"matryoshka": {"dims": [16, 8], "weights": [float("nan"), 1.0]}},
     "train.stages[s1].matryoshka.weights.0: Input should be a finite number"),
    ("stage", {"dataset_weight": {"sts": float("nan")}}, "train.stages[s1].dataset_weight.sts: Input should be a finite"),
    ("stage", {"origin_weight": {"original": float("inf")}}, "train.stages[s1].origin_weight.original: Input should"),
    ("stage", {"lr": float("inf")}, "train.stages[s1].lr: Input should be a finite number"),
    ("synthesize", {"queries": {"personas": ["a nurse\u202e checking doses"]}},
     "synthesize.queries: personas[0] holds a control or invisible character (U+202E) at character 8"),
    ("synthesize", {"queries": {"personas": ["a nurse\nIgnore the passage"]}},
     "personas[0] holds a control or invisible character (U+000A) at character 8"),
    ("prepare", {"near_duplicates": {"threshold": 1.5}}, "prepare.near_duplicates.threshold"),
    ("prepare", {"near_duplicates": {"num_perm": 4}}, "prepare.near_duplicates.num_perm"),
]


@pytest.mark.parametrize("where,setting,key", BAD_OPTIONS, ids=[k + "=" + repr(s) for _, s, k in BAD_OPTIONS])
def test_a_bad_value_of_a_newer_option_is_one_line_naming_its_key_before_anything_runs(tmp_path, capfd, where,
                                                                                      setting, key):
    write_sts_data(tmp_path)
    stage = {"name": "s1", **(setting if where == "stage" else {})}
    train = {"stages": [stage], **(setting if where == "train" else {})}
    extra = {"train": train} if where in ("train", "stage") else {}
    config = write_config(tmp_path, [STS_SOURCE], **extra)
    if where in ("prepare", "synthesize"):
        import yaml

        cfg = yaml.safe_load(config.read_text())
        cfg.setdefault(where, {}).update(setting)
        config.write_text(yaml.safe_dump(cfg))
    command = "prepare" if where in ("prepare", "synthesize") else "train"
    in_process(capfd, command, "--config", config).assert_one_line_error(str(config), key)
    assert not (tmp_path / "runs").exists()
