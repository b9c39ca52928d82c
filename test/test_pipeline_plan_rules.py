"""A pipeline's stage_plan as the spec checks it (zwdx/protocol/pipeline.py): block ranges from 0,
each after the one before, or module names, none twice; each wrong plan refused naming why."""
import pytest
from pydantic import ValidationError

from zwdx.protocol.pipeline import PipelineSettings


@pytest.mark.parametrize("plan, said", [
    ([[1, 3], [3, 4]], "must start at block 0, got 1"),
    ([[0, 3], [4, 5]], "ranges must follow each other: [0, 3] then [4, 5]"),
    ([[0, 0]], "range [0, 0] must hold at least one block"),
    ([[0, True]], "must be a list of block ranges [start, end] (whole numbers) or of module names"),
    (["h.6", "h.6"], "names a module twice"),
    (["h.6", "not a module"], "must name modules (like 'transformer.h.6'), got 'not a module'"),
    ([], "must be a non-empty list"),
])
def test_a_wrong_plan_is_refused_saying_why(plan, said):
    with pytest.raises(ValidationError) as refused:
        PipelineSettings(stage_plan=plan)
    assert said in str(refused.value)


def test_ranges_and_names_are_kept():
    assert PipelineSettings(stage_plan=[(0, 3), (3, 4)]).stage_plan == [[0, 3], [3, 4]]
    assert PipelineSettings(stage_plan=["h.6", "h.12"]).stages == 3
