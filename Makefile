# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The CPU wheel of torch 2.13.0 lies on local disk; installing it first keeps
# any dependency from pulling a multi-GB CUDA build.
TORCH  := torch==2.13.0

.PHONY: test demo install clean

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): $(PY) setup.py
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[dev]" $(TORCH)
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

demo: $(STAMP)
	$(VENV)/bin/hybridflow train configs/demo.yaml

clean:
	rm -rf $(VENV) build *.egg-info
