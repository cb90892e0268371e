"""Fixtures shared by the agent's tests."""
import pytest


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    """The tiny model, tokenizer and PEFT adapters (``make fixtures``; torch needed)."""
    pytest.importorskip("torch")
    # imported here: the CUDA machine's image runs tests/gpu_agent/test_cuda.py without
    # the gateway's dependencies that tests.support pulls in (make gpu-check)
    from tests.support.vllm import fixtures_dir

    return fixtures_dir(tmp_path_factory)
