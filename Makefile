# Two commands for a fresh machine:  make demo  |  make test
# Both create .venv, install tngram with torch pinned to the local CPU wheel, then run.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
TORCH   ?= torch==2.13.0
STAMP   := $(VENV)/.installed
KSTAMP  := $(VENV)/.installed-triton
HSTAMP  := $(VENV)/.installed-hf
XSTAMP  := $(VENV)/.installed-loggers

.PHONY: demo test install clean bench

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)" numpy
	$(BIN)/pip install -q -e ".[dev,report]"
	touch $(STAMP)

# `make test` also installs triton (CPU-usable wheel, ~15 s) so the Triton kernels are checked
# under the interpreter; where no wheel exists those tests skip and say so.
$(KSTAMP): $(STAMP)
	$(BIN)/pip install -q triton || echo "triton not installable here: the Triton interpreter tests will skip"
	touch $(KSTAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/tngram compare --preset cpu --out runs/compare-cpu
	@echo "  (first put tngram on your PATH in this shell:  . $(BIN)/activate)"

# ... and the `hf` and `lmeval` extras (transformers, lm-eval; pinned) so the tngram.hf tests,
# lm-evaluation-harness on an exported run included, run in CI.
$(HSTAMP): $(STAMP) pyproject.toml
	$(BIN)/pip install -q -e ".[dev,hf,lmeval]"
	touch $(HSTAMP)

# ... and the optional loggers, so --logger tensorboard|wandb (offline) are tested.
$(XSTAMP): $(STAMP) pyproject.toml
	$(BIN)/pip install -q -e ".[dev,tensorboard,wandb]"
	touch $(XSTAMP)

test: $(KSTAMP) $(HSTAMP) $(XSTAMP)
	$(BIN)/python -m pytest tests

bench: $(STAMP)
	$(BIN)/tngram bench modules

clean:
	rm -rf $(VENV)
