"""The shared Prefect test server starts only for runs that can select a test needing it."""

import pytest

from tests.conftest import markers_of
from tests.helpers.shared_prefect import selected


@pytest.mark.parametrize("markexpr", ["", "not llama_server and not matrix", "prefect", "slow and prefect"])
def test_a_marker_expression_that_can_select_a_prefect_test_starts_the_shared_server(markexpr):
    assert selected(markexpr, markers_of("prefect"))


@pytest.mark.parametrize("markexpr", ["not slow", "not prefect", "matrix", "llama_server and not slow"])
def test_a_marker_expression_that_leaves_every_prefect_test_out_starts_no_server(markexpr):
    assert not selected(markexpr, markers_of("prefect"))
