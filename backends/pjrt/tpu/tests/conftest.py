import os
import random
import sys
from pathlib import Path

import pytest

# Import the package from this checkout whatever the working directory.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_SEED = int(os.environ.get("FP8NSA_TEST_SEED") or random.SystemRandom().randrange(2**31))


def pytest_report_header(config):
    return f"fp8nsa_tpu seed: {_SEED} (replay with FP8NSA_TEST_SEED={_SEED})"


def pytest_configure(config):
    config.addinivalue_line("markers", "tpu: needs a real TPU (jax.devices()[0].platform == 'tpu')")


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"fp8nsa_tpu seed: {_SEED} (replay with FP8NSA_TEST_SEED={_SEED})")


@pytest.fixture(scope="session")
def seed():
    return _SEED
