"""How flow runs are named: after the run, unless the user typed a name; a config that does not
load still names the run."""

import pytest
import yaml


def test_names_prefect_makes_up_are_recognised_as_generated():
    from prefect.utilities.names import generate_slug

    from flows.params import is_generated_name

    assert all(is_generated_name(generate_slug(2)) for _ in range(500))  # the API's, for run_deployment
    # the UI form's suggestions (its Run Name field comes filled with one)
    assert all(map(is_generated_name, ["lambda2-arietis", "mu-canis-majoris", "omega413-ceti-nebula", "pi-leonis-k"]))


@pytest.mark.parametrize("typed", ["from-api", "ui-demo", "nightly retrain", "Try 2", "alphabet-soup", "my-run-3"])
def test_a_name_a_user_types_is_not_taken_for_a_generated_one(typed):
    from flows.params import is_generated_name

    assert not is_generated_name(typed)


def test_the_run_name_comes_from_the_parameter_then_the_inline_config_then_the_file(tmp_path):
    from flows.params import run_name_of

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"run_name": "from-file", "prepare": {"sources": [
        {"name": "s", "kind": "sts", "path": "s.csv"}]}}))
    assert run_name_of({"config_path": str(path), "run_name": "param"}) == "param"
    assert run_name_of({"config_path": str(path), "config": {"run_name": "inline"}}) == "inline"
    assert run_name_of({"config_path": str(path), "config": {"seed": 3}}) == "from-file"


def test_a_config_that_fails_to_load_still_names_the_run(tmp_path):
    from flows.params import run_name_of

    invalid = tmp_path / "nightly.yaml"
    invalid.write_text(yaml.safe_dump({"run_name": "scifact-nightly", "prepare": {"sourcez": []}}))
    assert run_name_of({"config_path": str(invalid)}) == "scifact-nightly"  # as written, though invalid
    unparsable = tmp_path / "weekly-retrain.yaml"
    unparsable.write_text("prepare: [unclosed\n")
    assert run_name_of({"config_path": str(unparsable)}) == "weekly-retrain"  # the file's stem
    assert run_name_of({"config_path": str(tmp_path / "missing.yaml")}) == "missing"
