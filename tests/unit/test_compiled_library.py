"""The shared loader of the optional compiled extensions (plain C loaded with ctypes)."""

import ctypes
import importlib.util

import pytest

from recserve.backends.base.compiled import compiled_library


def test_an_extension_that_is_not_built_is_none():
    assert compiled_library("recserve.backends.request_log", "_not_an_extension", keep_gil=False) is None
    assert compiled_library("recserve.backends.request_log", "_not_an_extension", keep_gil=True) is None


@pytest.mark.parametrize("keep_gil, kind", [(False, ctypes.CDLL), (True, ctypes.PyDLL)])
def test_a_built_extension_is_loaded_with_its_symbols(keep_gil, kind):
    if importlib.util.find_spec("recserve.backends.request_log._histories") is None:
        pytest.skip("the _histories extension was not built (no C compiler at install)")
    library = compiled_library("recserve.backends.request_log", "_histories", keep_gil=keep_gil)
    assert library is not None
    assert type(library) is kind  # PyDLL keeps the interpreter lock, CDLL lets go of it
    assert callable(library.recserve_history_columns)
