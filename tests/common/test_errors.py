"""The notes adaptmem adds to exceptions it lets through, on every supported Python."""

from __future__ import annotations

import sys

import pytest

from adaptmem._common.errors import add_note


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes came in Python 3.11")
def test_a_note_is_added_as_python_prints_it() -> None:
    exc = RuntimeError("Tensor.item() cannot be called on meta tensors")
    add_note(exc, "adaptmem: build the model yourself")
    assert exc.__notes__ == ["adaptmem: build the model yourself"]
    assert str(exc) == "Tensor.item() cannot be called on meta tensors"


class _Python310Error(RuntimeError):
    add_note = None  # as every exception on Python 3.10, which has no add_note


def test_without_exception_notes_the_note_goes_into_the_message() -> None:
    exc = _Python310Error("Tensor.item() cannot be called on meta tensors", 7)
    add_note(exc, "adaptmem: build the model yourself")
    assert str(exc.args[0]) == ("Tensor.item() cannot be called on meta tensors\n"
                                "adaptmem: build the model yourself")
    assert exc.args[1] == 7  # the other arguments are kept
    assert not hasattr(exc, "__notes__")
