"""EleutherAI lm-evaluation-harness on an exported checkpoint (pip install -e .[eval]).

The export (huginn_ray.model.export) is loaded with transformers' AutoModelForCausalLM and handed to lm-eval's
HFLM class; a forward pre-hook gives every forward of the model the recurrence depth, so every loglikelihood and
generate_until request runs that many core iterations (what the authors' `mean_recurrence=32` model argument
does). Tasks come from lm-eval's registry or from YAML files under `include_path`. A `HuginnLM` loads the model
once and can be evaluated at several depths (the GSM8k depth sweep).
"""

from __future__ import annotations

from pathlib import Path

from huginn_ray.model.inference import DTYPES


class HuginnLM:
    """The export in lm-eval's HFLM; every forward runs `depth` core iterations; `seen` records the depths run."""

    def __init__(self, hf_dir: str | Path, depth: int, batch_size: int = 1, device: str = "cpu",
                 dtype: str = "float32"):
        try:
            from lm_eval.models.huggingface import HFLM
        except ImportError:
            raise ValueError("lm-eval is not installed: pip install -e '.[eval]'") from None
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(str(hf_dir), trust_remote_code=True,
                                                     dtype=getattr(torch, dtype)).eval().to(device)
        self.depth, self.seen = depth, set()
        # HFLM's loglikelihood calls and generate's steps all call the model: each call passes through the hook
        model.register_forward_pre_hook(self._at_depth, with_kwargs=True)
        self.block_size = model.config.block_size
        tokenizer = AutoTokenizer.from_pretrained(str(hf_dir), trust_remote_code=True)  # our own export
        self.lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=device,
                       max_length=self.block_size)

    def _at_depth(self, module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A forward's arguments, `num_steps` set to the current depth unless the caller gave one; records it."""
        kwargs.setdefault("num_steps", self.depth)
        self.seen.add(kwargs["num_steps"])
        return args, kwargs

    def evaluate(self, tasks: list[str], include_path: str | Path | None = None, limit: int | None = None,
                 **settings) -> dict:
        """lm_eval.simple_evaluate at the current depth; `settings` go to it unchanged (system_instruction,
        apply_chat_template, fewshot_as_multiturn, gen_kwargs, ...)."""
        self.seen.clear()
        return run_tasks(self.lm, self.depth, lambda: self.seen, tasks, include_path, limit, **settings)


def run_tasks(lm, depth: int, forward_depths, tasks: list[str], include_path: str | Path | None, limit: int | None,
              **settings) -> dict:
    """lm_eval.simple_evaluate of `tasks` on the lm-eval model `lm` that runs `depth` core iterations, and the
    report this project keeps: the results, what lm-eval actually ran (task configs after overrides, shots, each
    task's first prompt), the model's responses in lm-eval's sample order, and `forward_depths()`, the depths the model's forwards ran (read after the run)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    task_manager = TaskManager(include_path=str(include_path)) if include_path else TaskManager()
    results = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=task_manager, limit=limit,
                                      log_samples=True, **settings)
    prompts = {task: samples[0]["arguments"][0][0] for task, samples in results["samples"].items() if samples}
    responses = {task: [sample["resps"][0][0] for sample in {s["doc_id"]: s for s in samples}.values()]
                 for task, samples in results["samples"].items()}  # lm-eval lists a document once per filter
    return {"results": results["results"], "num_steps": depth, "tasks": tasks,
            "forward_num_steps": sorted(forward_depths()), "n_shot": results["n-shot"], "configs": results["configs"],
            "first_prompts": prompts, "responses": responses}


def evaluate_tasks(hf_dir: str | Path, tasks: list[str], num_steps: int, include_path: str | None = None,
                   limit: int | None = None, batch_size: int = 1, device: str = "cpu", dtype: str = "float32") -> dict:
    return HuginnLM(hf_dir, num_steps, batch_size, device, dtype).evaluate(tasks, include_path, limit)
