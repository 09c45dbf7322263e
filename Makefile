# Two entry points: `make test` and `make demo`. Both create (once) and reuse .venv in the repo.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# the demo shards hold about 150 steps (153 with Python 3.11's standard library); fit_to_data ends the
# schedule with the data where another Python's sources give fewer
DEMO_STEPS ?= 150

.PHONY: test demo install clean gpu-check gpu-bundle

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
	tools/private_netns.sh $(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder --durations 25 tests

# The pipeline end to end on the embedded default (a private local Ray per job): tokenizer, shards, training,
# then what recurrence buys: loss by test-time depth, generation at a fixed depth and with an adaptive exit,
# and the Hugging Face export; last, a chat fine-tune of that model on questions and answers made from the
# standard library's docstrings, exported and asked a question in the chat template.
DEMO_CKPT := out/train_tiny_cpu
DEMO_TOK := out/data_demo/tokenizer
DEMO_PROMPT := def main(
DEMO_CHAT_SYSTEM := You are Huginn, a helpful assistant that knows the Python standard library.
DEMO_CHAT_PROMPT := What does `json.dumps` do?
demo: $(STAMP)
	$(PY) jobs/train_tokenizer.py --config configs/data/demo.yaml
	$(PY) jobs/prepare_data.py --config configs/data/demo.yaml
	$(PY) jobs/train.py --config configs/train/tiny_cpu.yaml max_steps=$(DEMO_STEPS) schedule.fit_to_data=true
	$(PY) jobs/evaluate.py --checkpoint $(DEMO_CKPT) --data-dir out/data_demo/shards --out out/demo/eval \
		--depths 1,2,4,8,16,32 --max-rows 8
	$(PY) jobs/generate.py --checkpoint $(DEMO_CKPT) --tokenizer $(DEMO_TOK) --prompt "$(DEMO_PROMPT)" \
		--num-steps 16 --max-new-tokens 24
	$(PY) jobs/generate.py --checkpoint $(DEMO_CKPT) --tokenizer $(DEMO_TOK) --prompt "$(DEMO_PROMPT)" \
		--num-steps 16 --max-new-tokens 24 --exit-criterion kl --exit-threshold 1e-3 --cache ring:8
	$(PY) -m huginn_ray.model.export --checkpoint $(DEMO_CKPT) --out out/demo/hf --tokenizer $(DEMO_TOK)
	$(PY) -m huginn_ray.data.demo_chat out/demo_chat/conversations
	$(PY) jobs/prepare_data.py --config configs/data/demo_chat.yaml
	$(PY) jobs/train.py --config configs/train/finetune_demo_chat.yaml
	$(PY) -m huginn_ray.model.export --checkpoint out/finetune_demo_chat --out out/demo/hf_chat --tokenizer $(DEMO_TOK)
	$(PY) jobs/generate.py --checkpoint out/demo/hf_chat --chat --system "$(DEMO_CHAT_SYSTEM)" \
		--prompt '$(DEMO_CHAT_PROMPT)' --num-steps 16 --max-new-tokens 40
	@echo "[demo] depth-scaling plot: out/demo/eval/depth_scaling.png (table: out/demo/eval/depth_scaling.csv)"
	@echo "[demo] Hugging Face export: out/demo/hf (AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True))"
	@echo "[demo] chat fine-tune: out/demo/hf_chat (its tokenizer_config.json holds the chat template)"
	@echo "[demo] MLflow UI: $(PY) -m mlflow ui --backend-store-uri sqlite:///$(CURDIR)/$(DEMO_CKPT)/mlflow/mlflow.db --port 5000"

# The GPU path end to end on the device present, a few minutes (bench/gpu_check.py; figures go to BENCHMARKS.md).
# It needs torch, numpy, pyarrow, safetensors and pyyaml only, so a machine without this venv (a lent GPU machine
# with no Ray or MLflow) runs it with its own python3.
GPU_CHECK_PY := $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	$(GPU_CHECK_PY) bench/gpu_check.py --out out/gpu_check.json

# The Ray paths on a GPU machine without Ray or MLflow: build the wheels here (a few minutes, 45 MiB in
# .device_bundle/), carry that folder, and run `python3 bench/gpu_e2e.py OUT` there (its docstring).
gpu-bundle:
	python3 tools/device_bundle.py

clean:
	rm -rf $(VENV)
