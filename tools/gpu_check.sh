#!/usr/bin/env bash
# make gpu-check: what only a CUDA machine can check, in one short run.
#   1. the CUDA-only tests (tests/gpu_agent/test_cuda.py: pool pages on the device,
#      host -> device loads exact, the batched mixed-rank op vs the dense reference,
#      churn without reallocation, a load that returns before its side-stream copy with
#      the first batch ordered after the copy's event, a batch while another copy is held);
#   2. make bench-agent on the device -> reports/agent_cuda.json (or $OUT/ when set);
#   3. forward steps while loads stream in (bench.load_interference: the pool part, disk
#      reads through the staging buffers, host-tier hits and reads pinned per load; the
#      engine part, the builtin engine's TTFT while prefetches cycle) on the device
#      -> reports/load_interference_cuda.json.
# Runs with whatever python3 has torch + CUDA (the device machine's image), from the
# repository root; no install, no network. Exit status: the tests', then the bench's.
# The fixtures (make fixtures) must be there: a device machine is bare, so send .fixtures
# with the working tree (it is git-ignored). The agent's tests import nothing of the
# gateway (tests/support/fixtures.py), whose dependencies (orjson) that image lacks.
# One run on an H200 takes about a minute (docs/bench-history.md, 2026-12-04).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
DEST=${OUT:-reports}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
"$PY" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.__version__, torch.cuda.get_device_name())'
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$PY" -m pytest -q -p no:cacheprovider -m cuda tests/gpu_agent/test_cuda.py
"$PY" -m bench.agent --device cuda --out "$DEST/agent_cuda.json" --fixtures "${FIXTURES:-.fixtures}"
"$PY" -m bench.load_interference --device cuda --steps 400 --fixtures "${FIXTURES:-.fixtures}" --out "$DEST/load_interference_cuda.json"
