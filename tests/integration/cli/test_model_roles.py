"""A model in the wrong role through the real CLI: ``embedpipe mine`` with an embedding model as its
cross-encoder teacher is exit 2 with one line, before any mining, and commits nothing (it used to
load the model with a randomly initialised head, drop candidates as false negatives on its scores,
and save them as distillation targets with exit 0)."""

import pytest
import yaml

from tests.helpers.cli_run import in_process
from tests.helpers.repo import REPO

pytestmark = pytest.mark.prefect


@pytest.fixture(autouse=True)
def _prefect(prefect_harness):
    yield


def test_an_embedding_model_as_the_cross_encoder_teacher_is_one_line_and_mine_commits_nothing(tmp_path, capfd,
                                                                                                tiny_model):
    config = {"data_root": str(REPO / "data"), "run_root": str(tmp_path / "runs"), "run_name": "r",
              "embedding_cache": {"machine_wide": False},
              "prepare": {"sources": [{"name": "flag", "kind": "flagembedding", "path": "flagembedding/msmarco.jsonl",
                                       "max_rows": 20}]},
              "mine": {"model": str(tiny_model), "max_length": 32, "tasks": ["retrieval"],
                       "teacher": {"path": str(tiny_model), "kind": "cross_encoder", "max_length": 64}}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    assert in_process(capfd, "prepare", "--config", path).rc == 0
    result = in_process(capfd, "mine", "--config", path)
    result.assert_one_line_error(f"{tiny_model}: mine.teacher kind cross_encoder needs a cross-encoder",
                                 "config.json names BertModel")
    assert not (tmp_path / "runs/r/mine/manifest.json").exists()
