import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import harness  # noqa: E402


@pytest.fixture
def fleet(tmp_path):
    """Two mock engines of 2 ranks each, a relay beside each, and kv-router following both."""
    engines = [harness.EngineProc(tmp_path, dp=2, name=f"engine{i}") for i in range(2)]
    relays = [harness.RelayProc(e, tmp_path, name=f"relay{i}") for i, e in enumerate(engines)]
    router = harness.RouterProc([r.url for r in relays], tmp_path)
    yield engines, relays, router
    router.stop()
    for r in relays:
        r.stop()
    for e in engines:
        e.stop()
