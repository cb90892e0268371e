"""Fixtures shared by the agent's tests."""
import pytest

from tests.support.fixtures import fixtures_dir   # no gateway imports (make gpu-check's image)


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    """The tiny model, tokenizer and PEFT adapters (``make fixtures``; torch needed)."""
    pytest.importorskip("torch")
    return fixtures_dir(tmp_path_factory)
