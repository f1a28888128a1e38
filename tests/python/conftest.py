"""Shared by the Python tests: the fuzz tests' figures (fuzz_support.py), reported once, at the end of a pytest
run that ran any of them."""
from __future__ import annotations

import sys
import time

import pytest


@pytest.fixture(scope="session", autouse=True)
def fuzz_figures(request):
    t0 = time.time()
    yield
    support = sys.modules.get("fuzz_support")
    if support is not None:
        support.report_figures(request.config, time.time() - t0)
