# Two commands on a fresh machine: `make demo` and `make test`.
# torch is pinned here (this machine has a local CPU wheel of 2.13.0; an unpinned torch pulls GBs of CUDA
# packages). The package itself only asks for torch>=2.4 so GPU users keep their own build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
DEMO_OUT ?= demo-out

.PHONY: demo test bench clean

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/quant demo $(DEMO_OUT)

# pytest exits 5 when it collects no tests; that is not a failure of the suite.
test: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 --dist loadgroup; rc=$$?; if [ $$rc -eq 5 ]; then exit 0; else exit $$rc; fi

bench: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) scripts/bench_numerics.py
	$(PY) scripts/bench_verify.py
	$(PY) scripts/bench_quantize.py

clean:
	rm -rf $(VENV) $(DEMO_OUT) .pytest_cache
