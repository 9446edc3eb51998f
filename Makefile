# One virtual environment holds the three packages. torch is pinned; which build of it
# comes depends on the package index: where that serves the CUDA build (several GB, as
# the ordinary index does on Linux x86-64), set TORCH_INDEX_URL to a CPU-only PyTorch
# wheel index, as the server's Dockerfile takes it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH := torch==2.13.0
TORCH_INDEX_URL ?=
STAMP := $(VENV)/.installed

PROMPT ?= Write a Python function that returns the n-th Fibonacci number, with a short docstring.
DEMO_TOKENS ?= 128

.PHONY: venv test test-oldest test-oldest-edge demo models bench bench-quick bench-rtt50 bench-replay soak loadtest proto clean

venv: $(STAMP)

$(STAMP): shared/pyproject.toml edge/pyproject.toml server/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install $(TORCH) $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(PY) -m pip install -e 'shared[test]' -e edge -e server
	touch $(STAMP)

# Regenerate the committed gRPC stubs from proto/ (a test checks they are current).
proto: $(STAMP)
	$(PY) proto/generate.py

test: $(STAMP)
	$(PY) -m pytest -q tests

# The tests against the oldest transformers, onnx, onnxscript, ONNX Runtime and numpy the
# pyproject.toml files admit (constraints-oldest.txt), in a venv of their own: about 10 minutes.
# Python 3.11: numpy 1.24 has no build for a later one, and the server needs 3.11.
OLDEST_VENV ?= .venv-oldest
OLDEST_PYTHON ?= python3.11
test-oldest:
	$(OLDEST_PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/python -m pip install $(TORCH) $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(OLDEST_VENV)/bin/python -m pip install -c constraints-oldest.txt -e 'shared[test]' -e edge -e server
	$(OLDEST_VENV)/bin/python -m pytest -q -p no:cacheprovider tests

# The edge at the oldest ONNX Runtime, tokenizers, numpy and jinja2 its pyproject.toml admits
# (constraints-oldest-edge.txt), in a venv of its own without torch, as on a board: the same
# token ids, drafts and logits as the main venv's, from the same tiny fp32 and int4 exports
# (tests/edge_floors.py). test-oldest cannot: the server's higher floors win in its one venv.
OLDEST_EDGE_VENV ?= .venv-oldest-edge
EDGE_FLOORS_DIR ?= .edge-floors
test-oldest-edge: $(STAMP)
	$(OLDEST_PYTHON) -m venv $(OLDEST_EDGE_VENV)
	$(OLDEST_EDGE_VENV)/bin/python -m pip install -c constraints-oldest-edge.txt -e shared -e edge
	rm -rf $(EDGE_FLOORS_DIR)
	$(PY) tests/edge_floors.py record $(EDGE_FLOORS_DIR)
	$(OLDEST_EDGE_VENV)/bin/python tests/edge_floors.py check $(EDGE_FLOORS_DIR)

# Pull and prepare the default models into the cache (~/.cache/specsplit).
models: $(STAMP)
	$(VENV)/bin/specsplit-server models prepare

# The main job: server and edge on their own cores, the default pair, one prompt,
# compared with the server alone. Fails if the two outputs differ.
demo: $(STAMP)
	$(PY) bench/demo.py --max-new-tokens $(DEMO_TOKENS) "$(PROMPT)"

# Benchmarks over the emulated network (server and edge pinned to their own cores).
# The full sweep (12 prompts x RTT 50/0/20/100 ms x 6 modes, plus the draft alone and HF
# assisted generation, 64 new tokens) takes 1 to 3 hours on 2 cores, by the CPU. Its result is saved
# after every run; `make bench BENCH_ARGS=--resume` measures only what a stopped sweep missed.
BENCH_ARGS ?=
bench: $(STAMP)
	$(PY) bench/run_bench.py --name full --max-new-tokens 64 $(BENCH_ARGS)

# A subset under 10 minutes: RTT 50 ms, 3 prompts, 96 new tokens, server only, sync at k=4 and 6
# (the best two k over all 12 prompts at RTT 50 ms: bench/results/rtt50.md), async with and
# without branches, the draft alone; no HF.
bench-quick: $(STAMP)
	$(PY) bench/run_bench.py --name quick --rtt-ms 50 --prompts 3 --max-new-tokens 96 --sync-k 4 6 --no-hf --async-no-branches $(BENCH_ARGS)

# All 12 prompts at the goal's RTT (50 ms) only, every sync k, async with and without
# branches side by side, no HF: 15 to 40 minutes.
bench-rtt50: $(STAMP)
	$(PY) bench/run_bench.py --name rtt50 --rtt-ms 50 --max-new-tokens 64 --sync-k 2 4 6 8 --no-hf --async-no-branches $(BENCH_ARGS)

# What each mode can reach with these models and this target speed, and what-ifs, from the
# 12-prompt RTT 50 ms run (bench/results/rtt50-packed.json) and the target's pass times on this CPU
# (bench/results/cpu-passes-bf16-packed.json, bf16 as served here, from bench/gpu_passes.py): a model, in about a
# minute (most of it the draft run teacher-forced over every prompt).
bench-replay: $(STAMP)
	$(PY) bench/replay.py --bench bench/results/rtt50-packed.json --pass-costs bench/results/cpu-passes-bf16-packed.json --name replay-packed

# 64 concurrent sessions for 5 minutes with tiny models: zero errors, flat server memory.
soak: $(STAMP)
	$(PY) bench/soak.py --sessions 64 --minutes 5

# gRPC load test with the tiny models on CPU: server only, simulated edges (alpha 0.7) and real
# ONNX edges, each at 1, 2, 4, ... concurrent sessions until one session gets less than the SLO.
# A tiny target pass takes milliseconds, so sessions are fast here: the SLO is 20 tokens/s. The
# server paces sessions at 22 tokens/s, as in the GPU runs (docs/capacity.md: pacing).
# bench/results/loadtest-cpu.{json,md}, in 5 to 10 minutes on 2 cores.
loadtest: $(STAMP)
	$(PY) bench/loadtest/run.py --name loadtest-cpu --modes none,sim,onnx --sessions 1,2,4,8,16,32,64,128 \
		--duration 8 --max-new-tokens 64 --alpha 0.7 --slo 20 --server-arg=--pace-tokens-per-s=22

clean:
	rm -rf $(VENV) $(OLDEST_VENV) $(OLDEST_EDGE_VENV) $(EDGE_FLOORS_DIR)
