"""EleutherAI lm-evaluation-harness on an exported checkpoint (pip install -e .[eval]).

The export (huginn_ray.model.export) is loaded with transformers' AutoModelForCausalLM and handed to lm-eval's
HFLM class; `num_steps` is bound to the model's forward, so every loglikelihood and generate_until request runs
that many core iterations. Tasks come from lm-eval's registry or from YAML files under `include_path`.
"""

from __future__ import annotations

from pathlib import Path


def evaluate_tasks(hf_dir: str | Path, tasks: list[str], num_steps: int, include_path: str | None = None,
                   limit: int | None = None, batch_size: int = 1, device: str = "cpu") -> dict:
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise ValueError("lm-eval is not installed: pip install -e '.[eval]'") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), trust_remote_code=True).eval().to(device)
    forward, seen = model.forward, set()

    def forward_at_depth(*args, **kwargs):
        kwargs.setdefault("num_steps", num_steps)
        seen.add(kwargs["num_steps"])
        return forward(*args, **kwargs)

    model.forward = forward_at_depth  # what HFLM's loglikelihood and generate calls both reach
    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=device,
              max_length=model.config.block_size)
    task_manager = TaskManager(include_path=include_path) if include_path else TaskManager()
    results = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=task_manager, limit=limit,
                                      log_samples=False)
    return {"results": results["results"], "num_steps": num_steps, "tasks": tasks,
            "forward_num_steps": sorted(seen)}
