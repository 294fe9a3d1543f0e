# Set-up and the two main jobs. `make demo` and `make test` each create .venv when needed.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU build of PyTorch; on a GPU machine install the CUDA build of torch>=2.9 first instead.
TORCH ?= torch==2.13.0

.PHONY: demo test test-fast install bench clean

install: $(VENV)/.installed

# pip runs quietly; these lines say what the minute of silence is.
$(VENV)/.installed: pyproject.toml
	@echo "creating $(VENV)"
	$(PYTHON) -m venv $(VENV)
	@echo "installing PyTorch ($(TORCH), the CPU build; the largest download, so the longest step)"
	$(BIN)/pip install --quiet "$(TORCH)"
	@echo "installing isoloco and its dependencies (transformers, tokenizers, the embedded corpus, test tools, torchft, torchtitan)"
	$(BIN)/pip install --quiet -e ".[dev,torchft,torchtitan]"
	touch $@

# The quick preset's final validation loss on the CPUs docs/training.md names: a CPU's kernels move
# the last digits, so `make demo` says whether its run landed within that spread.
DEMO_SPREAD := 4.4403 4.4403
DEMO_OUT := runs/isoloco-$(shell date +%Y%m%d-%H%M%S)

define DEMO_CHECK
import json, sys
loss = round(json.load(open(sys.argv[1]))["final_val_loss"], 4)
low, high = map(float, sys.argv[2:])
where = "within" if low <= loss <= high else "outside"
print(f"{loss:.4f} is {where} the spread docs/training.md gives across CPUs ({low:.4f} to {high:.4f})"
      + ("" if where == "within" else ": another CPU, thread count or package version can move the last "
         "digits; a difference beyond those suggests a problem"))
endef
export DEMO_CHECK

demo: install
	$(BIN)/isoloco train --out $(DEMO_OUT)
	@$(BIN)/python -c "$$DEMO_CHECK" $(DEMO_OUT)/summary.json $(DEMO_SPREAD)

# One thread per process: several tests start 2-4 training processes at once on 2 cores.
# TEST_WORKERS pytest processes (pytest-xdist) share the files out whole, so a module's
# fixtures (training runs several tests read) are built once; 0 runs them in this process.
TEST_WORKERS ?= 2
test: install
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The quick subset while editing: no test that starts processes or trains for seconds.
test-fast: install
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m "not multiprocess and not slow"

# The short benchmark tables; docs/benchmarks.md has the full ones and how they were made.
bench: install
	$(BIN)/python -m isoloco.bench --quick --threads 1

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
