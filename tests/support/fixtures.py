"""Where the tests find the tiny model, tokenizer and adapters (``make fixtures``).

Imports nothing of the gateway: the CUDA machine's image runs the agent's CUDA tests
(``make gpu-check``) without the gateway's dependencies."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def fixtures_dir(tmp_factory) -> Path:
    """The fixtures `make fixtures` wrote, or a fresh copy made for this session."""
    made = REPO / ".fixtures"
    if (made / "catalog.yaml").is_file() and (made / "model" / "config.json").is_file():
        return made
    from gpu_agent.fixtures import make_fixtures
    out = tmp_factory.mktemp("fixtures")
    make_fixtures(out)
    return out
