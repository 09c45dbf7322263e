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

# The pipeline end to end on the embedded default (a private local Ray per job): tokenizer, shards, training.
demo: $(STAMP)
	$(PY) jobs/train_tokenizer.py --config configs/data/demo.yaml
	$(PY) jobs/prepare_data.py --config configs/data/demo.yaml
	$(PY) jobs/train.py --config configs/train/tiny_cpu.yaml

clean:
	rm -rf $(VENV)
