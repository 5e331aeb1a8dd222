import json
import os
import random
import sys
import time
from pathlib import Path

import pytest

# Import the package from this checkout whatever the working directory.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_START = time.time()
_ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
_SEED = int(os.environ.get("FP8NSA_TEST_SEED") or random.SystemRandom().randrange(2**31))


def pytest_report_header(config):
    return f"fp8nsa_tpu seed: {_SEED} (replay with FP8NSA_TEST_SEED={_SEED})"


def pytest_configure(config):
    config.addinivalue_line("markers", "tpu: needs a real TPU (jax.devices()[0].platform == 'tpu')")


def pytest_terminal_summary(terminalreporter):
    tr = terminalreporter
    manifest = _ARTIFACTS / "manifest.json"
    if manifest.exists() and manifest.stat().st_mtime >= _START:  # written by this run
        tr.write_line("Mosaic dumps for `fp8nsa inspect --expect <variant>`:")
        for e in json.loads(manifest.read_text())["entries"]:
            tr.write_line(f"  {e['variant']}: {_ARTIFACTS / e['mlir']}")
    tr.write_line(f"fp8nsa_tpu seed: {_SEED} (replay with FP8NSA_TEST_SEED={_SEED})")


@pytest.fixture(scope="session")
def seed():
    return _SEED
