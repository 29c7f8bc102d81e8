# make demo  — end-to-end pipeline on the bundled data (local ephemeral Prefect, no server to start)
# make test  — the test suite
# make serve — local Prefect server + workers (pools cpu, gpu) + the deployments of deployments/prefect.yaml
# make stop  — stop what make serve started
# All create .venv and install what they need on first use.

PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed
export DO_NOT_TRACK = 1
export PREFECT_SERVER_ANALYTICS_ENABLED = false
export HF_HUB_OFFLINE = 1
export TRANSFORMERS_OFFLINE = 1

.PHONY: install demo test bench clean serve stop

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU torch first: an unpinned torch can pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/embedpipe run --config deployments/configs/demo.yaml

test: $(STAMP)
	$(VENV)/bin/pytest -q

serve: $(STAMP)
	$(PY) deployments/local.py serve

stop:
	@test -x $(PY) && $(PY) deployments/local.py stop || echo "nothing running"

clean:
	rm -rf runs .pytest_cache

bench: $(STAMP)
	$(PY) -m pip install -q -e ".[dev,bench]"
	$(PY) tests/benchmarks/bench_mine.py
	$(PY) tests/benchmarks/bench_train.py
