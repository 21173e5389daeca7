from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


@pytest.fixture
def seed_path():
    return EXAMPLES / "seed-64gpu.toml"
