"""Batch field names: every constant is unique, documented and has a shape."""
from __future__ import annotations

from hybridflow.data import fields as F


def constants() -> dict[str, str]:
    return {name: value for name, value in vars(F).items() if name.isupper() and isinstance(value, str)}


def test_constants_are_unique_documented_and_shaped():
    found = constants()
    assert len(found) >= 24
    assert len(set(found.values())) == len(found), "two constants share a field name"
    assert set(F.FIELD_SHAPES) == set(found.values())
    for name in found:
        assert f"\n{name} " in F.__doc__, f"{name} missing from the fields table"


def test_prompt_field_groups_and_read_only_shapes():
    assert set(F.PROMPT_TENSOR_FIELDS) | set(F.PROMPT_LIST_FIELDS) <= set(F.FIELD_SHAPES)
    assert all(F.FIELD_SHAPES[f].startswith("LongTensor") for f in F.PROMPT_TENSOR_FIELDS)
    assert F.FIELD_SHAPES[F.INPUT_IDS] == "LongTensor[B, T]" and F.FIELD_SHAPES[F.SCORES] == "FloatTensor[B]"
    try:
        F.FIELD_SHAPES["x"] = "y"  # type: ignore[index]
    except TypeError:
        pass
    else:
        raise AssertionError("FIELD_SHAPES must be read-only")
