"""The pipeline flow's ``corpus_path`` parameter (``flows.params.with_corpus_path``): it points the
config's one corpus source at a folder and the config is validated again; a config with no or
several corpus sources is refused with one line."""

import pytest

from embed_core.config import load_config, parse_config
from embed_core.errors import ConfigError
from flows.params import with_corpus_path
from tests.helpers.repo import REPO


def test_corpus_path_points_the_recipes_corpus_source_at_another_folder_and_keeps_the_rest():
    recipe = load_config(REPO / "deployments/configs/corpus.yaml")
    moved = with_corpus_path(recipe, "/srv/my_documents")
    (source,) = moved.prepare.sources
    assert source.kind == "corpus" and source.path == "/srv/my_documents"
    assert source.params == recipe.prepare.sources[0].params          # chunking settings stay
    assert moved.model_dump(exclude={"prepare"}) == recipe.model_dump(exclude={"prepare"})
    assert moved.prepare.contamination == recipe.prepare.contamination
    assert with_corpus_path(recipe, None) is recipe and with_corpus_path(recipe, "") is recipe


def _sources(*kinds):
    return parse_config({"prepare": {"sources": [{"name": f"s{i}", "kind": kind, "path": f"p{i}"}
                                                 for i, kind in enumerate(kinds)]}})


def test_corpus_path_with_no_corpus_source_is_refused_with_one_line():
    with pytest.raises(ConfigError) as err:
        with_corpus_path(_sources("sts"), "docs")
    assert str(err.value) == ("corpus_path docs: the config has 0 corpus sources (kind: corpus); corpus_path points "
                              "exactly one at a folder (with several, set prepare.sources in the inline config)")


def test_corpus_path_with_two_corpus_sources_is_refused_naming_them():
    with pytest.raises(ConfigError, match=r"^corpus_path docs: the config has 2 corpus sources \(kind: corpus\): s0, s2;"):
        with_corpus_path(_sources("corpus", "sts", "corpus"), "docs")


def test_the_pipeline_form_describes_corpus_path():
    from prefect.utilities.callables import parameter_schema

    from flows.pipeline import pipeline_flow

    props = parameter_schema(pipeline_flow.fn).model_dump()["properties"]
    assert "one corpus source" in props["corpus_path"]["description"]
