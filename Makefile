# The two commands: `make demo` and `make test`. Both create .venv and install the pinned stack first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The CPU wheel 2.13.0 on the project's machines; on a GPU machine the same pin resolves to the CUDA build.
TORCH  ?= torch==2.13.0
DEMO_OUT ?= runs/demo

.PHONY: setup demo test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	touch $(STAMP)

demo: setup
	$(VENV)/bin/taylor-tune prune --model tiny-llama --method taylor --sparsity 0.2 \
	    --seq-len 64 --num-samples 128 --calibration sample --seed 0 --output $(DEMO_OUT)
	@echo "demo outputs in $(DEMO_OUT)/: pruning_summary.json importance.safetensors model/"

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) bench/bench_importance.py --json bench/out/importance.json

clean:
	rm -rf $(VENV) runs bench/out
