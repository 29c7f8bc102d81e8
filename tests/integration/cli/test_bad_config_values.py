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
