# Two entry points: `make test` and `make demo`. Both create (once) and reuse .venv in the repo.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo install clean

install: $(STAMP)

# torch first: with a CPU-only machine, `pip install torch==2.13.0` takes the local CPU wheel;
# a torch already importable in the venv (a ROCm or CUDA build on a cluster) is kept as it is.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

test: $(STAMP)
	tools/ensure_sshd.sh
	tools/private_netns.sh $(PY) -m pytest tests

demo: $(STAMP)
	$(PY) jobs/demo.py

clean:
	rm -rf $(VENV)
