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
	@echo "installed: $(BIN)/tngram"
	@echo "  (put tngram on your PATH in this shell:  . $(BIN)/activate)"

demo: $(STAMP)
	$(BIN)/tngram compare --preset cpu --out runs/compare-cpu
	@echo "  (first put tngram on your PATH in this shell:  . $(BIN)/activate)"

# ... and the `hf`, `lmeval`, `quantized` and `trl` extras (transformers, lm-eval, bitsandbytes,
# trl) so the tngram.hf tests, lm-evaluation-harness on an exported run, a quantized base and
# TRL's SFTTrainer included, run in CI. The hf extra is a transformers
# range: the suite runs at its newest release, then the tngram.hf tests run again at its lowest
# (installed alone into $(TFLOW) and put first on PYTHONPATH; both share their other deps).
TF_NEWEST ?= 5.24.0
TF_LOWEST ?= 5.20.0
TFLOW   := $(VENV)/transformers-$(TF_LOWEST)
LSTAMP  := $(TFLOW)/.installed
HF_TESTS = $(wildcard tests/test_hf_*.py)

$(HSTAMP): $(STAMP) pyproject.toml
	$(BIN)/pip install -q -e ".[dev,hf,lmeval,quantized,trl]" "transformers==$(TF_NEWEST)"
	touch $(HSTAMP)

$(LSTAMP): $(HSTAMP)
	rm -rf $(TFLOW)
	$(BIN)/pip install -q --no-deps --target $(TFLOW) "transformers==$(TF_LOWEST)"
	touch $(LSTAMP)

# ... and the optional loggers, so --logger tensorboard|wandb (offline) are tested.
$(XSTAMP): $(STAMP) pyproject.toml
	$(BIN)/pip install -q -e ".[dev,tensorboard,wandb]"
	touch $(XSTAMP)

test: $(KSTAMP) $(HSTAMP) $(XSTAMP) $(LSTAMP)
	$(BIN)/python -m pytest tests research/tests
	PYTHONPATH=$(TFLOW) TNGRAM_EXPECT_TRANSFORMERS=$(TF_LOWEST) $(BIN)/python -m pytest -q $(HF_TESTS)

bench: $(STAMP)
	$(BIN)/python -m research bench modules

clean:
	rm -rf $(VENV)
