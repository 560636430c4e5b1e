# Targets mirror CI: install, test, lint, bench, demo.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TORCH   ?= torch==2.13.0
PYTEST_ARGS ?=
# pytest-xdist workers of `make test` (0: one process); CI's machine has 2 cores
TEST_WORKERS ?= 2
BENCH_ARGS ?=

.PHONY: install demo test test-solvers test-gpu lint format bench bench-quick bench-peers bench-peers-full bench-peers-compile bench-second-run bench-overhead bench-budget bench-loop bench-scale bench-ddp bench-big bench-predict bench-zoo-inductor bench-host bench-polish clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch is pinned explicitly and installed first: an open range would pull a multi-GB CUDA build.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e '.[dev,plot,cpsat,hf]'
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/python examples/train_transformer.py

test: install
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=15 $(PYTEST_ARGS)

# The torch-free core alone (what `pip install` without torch supports).
test-solvers: install
	$(BIN)/python -m pytest -q tests/unit $(PYTEST_ARGS)

# The CUDA tests alone, printing their measured peaks; they skip without a GPU. A fresh .venv needs a CUDA
# build of torch: TORCH="torch==2.13.0 --index-url <your CUDA version's index>" (README, Install).
test-gpu: install
	$(BIN)/python -m pytest -q -s tests/gpu $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check solvers checkmate tests examples benchmarks
	$(BIN)/ruff format --check solvers checkmate tests examples benchmarks
	$(BIN)/mypy

format: install
	$(BIN)/ruff format solvers checkmate tests examples benchmarks
	$(BIN)/ruff check --fix solvers checkmate tests examples benchmarks

# The solver table on the public graphs and traced models (long: up to 60 s per instance).
# Hours on 2 cores (60 s per search); `make bench BENCH_ARGS=--resume` goes on after an interrupt.
bench: install
	$(BIN)/python -m benchmarks.run $(BENCH_ARGS)

bench-quick: install
	$(BIN)/python -m benchmarks.run --quick

# Side by side with torch.utils.checkpoint and PyTorch's activation_memory_budget (~5 min);
# bench-peers-full runs GPT-2 small and a ResNet-18-wide CNN (hours on 2 cores).
bench-peers: install
	$(BIN)/python -m benchmarks.peers --quick --steps 25

bench-peers-full: install
	$(BIN)/python -m benchmarks.peers

# checkmate with compiler="inductor" beside torch.compile and its activation_memory_budget at
# 0.2-1.0, at equal measured memory, on GPT-2, a Llama-like model and the CNN (CUDA, ~8 min on
# an H100); here on CPU: BENCH_ARGS="--device cpu --quick --models resnet --budgets 0.4,1.0".
bench-peers-compile: install
	$(BIN)/python -m benchmarks.peers_compile $(BENCH_ARGS)

# Step time of checkmate against eager at budgets 1.0 and 0.5, then with dropout 0.1 at 1.0, 0.9
# and 0.5 (issue 3's overhead target; ~1 min).
bench-overhead: install
	$(BIN)/python -m benchmarks.overhead
	$(BIN)/python -m benchmarks.overhead --dropout 0.1 --budgets 1.0,0.9,0.5 --prefix overhead_dropout

# Calls and seconds a budget costs: 5 models at 0.5, 0.7 and bytes, retrying at exc.minimum (~15 min).
bench-budget: install
	$(BIN)/python -m benchmarks.budget_calls $(BENCH_ARGS)

# A second process making the same optimize() call hits the plan cache.
bench-second-run: install
	$(BIN)/python -m benchmarks.second_run

# A training loop over 30 input shapes per model at 0.5, 0.7 and a byte budget: plans made,
# planning seconds per new shape, measured peak over budget (~4 min on 2 cores).
bench-loop: install
	$(BIN)/python -m benchmarks.loop $(BENCH_ARGS)

# checkmate solve -s checkpoint-all on a 400,000-node chain: plan written within 60 s and 2 GB RSS.
bench-scale: install
	$(BIN)/python -m benchmarks.scale $(BENCH_ARGS)

# Two gloo ranks on CPU: step time and per-rank peak of checkmate against eager DDP (budget 0.5)
# and eager FSDP2 (per-block plans, 0.75), written to benchmarks/results/ddp.md (~90 s).
bench-ddp: install
	$(BIN)/python -m benchmarks.ddp $(BENCH_ARGS)

# Plan for a GPU you do not have: Llama-2-7B- and GPT-2-XL-shaped decoders traced with --fake
# (no storage) and planned with the h100 profile at 80/60/40/30/20 GiB, plus a Pareto curve per
# model (8 budgets, 25 s each) drawn to benchmarks/results/big_<model>_pareto.png (~10 min on 2 cores).
bench-big: install
	nice $(BIN)/python -m benchmarks.big $(BENCH_ARGS)

# A scaled-down Llama predicted (fake trace, h100 profile) and then measured on a CUDA GPU at the same
# budgets: benchmarks/results/predict_check.md. BENCH_ARGS=--device cpu does the same on the CPU.
bench-predict: install
	$(BIN)/python -m benchmarks.predict_check $(BENCH_ARGS)

# compiler="inductor" on 12 small Hugging Face models (decoders, encoders, T5, ViT, ConvNeXt) at 0.6 of
# eager's step peak: budget held, gradients against eager, first-call seconds with empty Inductor caches,
# written to benchmarks/results/zoo_inductor.md (~12 min on 2 cores).
bench-zoo-inductor: install
	$(BIN)/python -m benchmarks.zoo_inductor --fresh-cache $(BENCH_ARGS)

# Where compiler="inductor"'s step spends host time against torch.compile's (a GPU's small steps are
# host-bound): GPT-2 quick and the ResNet-like CNN at 1.0, with Inductor's buffer reuse and without.
# On CPU: BENCH_ARGS="--device cpu --size tiny --pairs 10".
bench-host: install
	$(BIN)/python -m benchmarks.host_time --reuse $(BENCH_ARGS)

# auto with and without polishing (solvers/polish.py) at the same instances, alternating, 30 s each:
# benchmarks/results/polish.md (~15 min on 2 cores).
bench-polish: install
	$(BIN)/python -m benchmarks.polish $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
