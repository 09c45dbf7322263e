"""The paper's GSM8k evaluation recipe, pinned, on a local copy of the test split; and its depth sweep.

What the Huginn-0125 authors ran for "GSM8k CoT w/ sys. prompt" (README of seal-rg/recurrent-pretraining,
"Reproducing Benchmark Scores"):

    lm_eval --model hf --model_args pretrained=tomg-group-umd/huginn-0125,trust_remote_code=True,
        dtype=bfloat16,mean_recurrence=32 --tasks gsm8k_cot --batch_size=auto --apply_chat_template=True
        --fewshot_as_multiturn --system_instruction="You are a helpful assistant that can assist users with
        mathematical reasoning."

`GSM8K_RECIPE` holds these settings; the task itself (8-shot chain of thought with fixed exemplars, the "Q: ...
A:" prompt, greedy decoding, the strict-match and flexible-extract answer extraction) is lm-eval's `gsm8k_cot`
v3.0, pinned in configs/eval/gsm8k_cot_huginn.yaml with the data read from a local JSONL file (offline). The
chat template is the export's (huginn_ray.data.chat.CHAT_TEMPLATE, the released one): with
`fewshot_as_multiturn` every exemplar is a user turn and a Huginn turn after the system prompt.

The depth sweep evaluates the same recipe at several recurrence depths (default 4, 8, 16, 32, 64: accuracy
against test-time compute, as in the paper's figures) as one Ray Data pipeline over an actor pool of model
replicas (huginn_ray.eval.batch_inference): every request at every depth is generated alone, seeded by its
index, so the results do not depend on the replica count. Or through a running jobs/serve.py
(huginn_ray.eval.server_lm): the same requests and seeds, sent `num_concurrent` at once to its continuous depth
batching engine, where a request may also exit the recurrence early (the initial noise a seed gives differs from
the export's: server_lm.py).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from huginn_ray.eval.batch_inference import Replicas, ray_generation_lm
from huginn_ray.eval.server_lm import Server, server_generation_lm

TASK_YAML = Path(__file__).resolve().parents[2] / "configs" / "eval" / "gsm8k_cot_huginn.yaml"
SAMPLE_DATA = TASK_YAML.parent / "gsm8k_test_sample.jsonl"
SWEEP_COLUMNS = ["depth", "strict_match", "flexible_extract", "samples"]


@dataclass(frozen=True)
class GSM8kRecipe:
    task: str = "gsm8k_cot_huginn"
    """lm-eval's gsm8k_cot (v3.0) with local data: configs/eval/gsm8k_cot_huginn.yaml."""
    num_steps: int = 32
    """Core iterations of every forward: the authors' `mean_recurrence=32`."""
    system_instruction: str = "You are a helpful assistant that can assist users with mathematical reasoning."
    """The authors' `--system_instruction` (also DEFAULT_SYS_PROMPT of their finetuning_simple_example.py)."""
    apply_chat_template: bool = True
    """The authors' `--apply_chat_template=True`: the tokenizer's chat template (the released one)."""
    fewshot_as_multiturn: bool = True
    """The authors' `--fewshot_as_multiturn`: each exemplar a user turn plus a Huginn turn."""
    num_fewshot: int = 8
    """gsm8k_cot's own setting (the task YAML); the authors pass none."""
    max_gen_toks: int = 256
    """Not set by the task or the authors: lm-eval's default for generate_until, pinned in the task YAML."""
    dtype: str = "bfloat16"
    """The authors' `dtype=bfloat16`; jobs/evaluate.py takes `dtype=` (float32 by default on CPU)."""
    sweep_depths: tuple[int, ...] = (4, 8, 16, 32, 64)
    """Depths of the sweep: accuracy against test-time recurrence."""


GSM8K_RECIPE = GSM8kRecipe()


@dataclass
class SweepRow:
    depth: int
    strict_match: float
    flexible_extract: float
    samples: int


def check_task_data(path: str | Path) -> int:
    """Number of problems in a local GSM8k JSONL file; refuses a missing file or a line without question/answer."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"GSM8k data file not found: {path} (a JSONL copy of openai/gsm8k's `main` test split)")
    count = 0
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not JSON ({err})") from None
        if not isinstance(row, dict) or not isinstance(row.get("question"), str) or "####" not in str(row.get("answer")):
            raise ValueError(f"{path}:{number}: needs a string 'question' and an 'answer' ending in '#### <number>'")
        count += 1
    if not count:
        raise ValueError(f"{path}: no problems")
    return count


def write_task(data: str | Path, task_dir: str | Path) -> Path:
    """The pinned task YAML with `data` as its test split, written into task_dir (lm-eval's include_path)."""
    task = yaml.safe_load(TASK_YAML.read_text())
    task["dataset_kwargs"]["data_files"]["test"] = str(Path(data).resolve())
    task_dir = Path(task_dir)
    task_dir.mkdir(parents=True, exist_ok=True)
    (task_dir / f"{GSM8K_RECIPE.task}.yaml").write_text(yaml.safe_dump(task, sort_keys=False))
    return task_dir


def evaluate_gsm8k(hf_dir: str | Path, data: str | Path, task_dir: str | Path, depths: list[int],
                   generator: Replicas | Server, limit: int | None = None, max_gen_toks: int | None = None,
                   seed: int = 0) -> dict:
    """The recipe at each depth, generated either as Ray Data batch inference on `Replicas` (every depth's
    generations in one pipeline, the model loaded once per replica; huginn_ray.eval.batch_inference) on the
    connected Ray cluster, or through a running `Server` (huginn_ray.eval.server_lm; `hf_dir` is then the served
    model's export, for its tokenizer and chat template). Returns {"settings", "depths": {depth: lm-eval
    report}}; `max_gen_toks` overrides the pinned 256 (for models whose block_size cannot hold it) and is
    recorded."""
    from huginn_ray.eval.lm_eval import run_tasks
    from huginn_ray.model.config import ModelConfig

    samples = check_task_data(data)
    recipe = GSM8K_RECIPE
    generation = max_gen_toks or recipe.max_gen_toks
    block_size = ModelConfig.from_json(Path(hf_dir) / "config.json").block_size
    if generation >= block_size:
        raise ValueError(f"max_gen_toks {generation} must be below the model's block_size {block_size} (the "
                         f"prompt gets the rest): pass max_gen_toks=N")
    include = write_task(data, task_dir)
    settings = {"system_instruction": recipe.system_instruction, "apply_chat_template": recipe.apply_chat_template,
                "fewshot_as_multiturn": recipe.fewshot_as_multiturn}
    if max_gen_toks is not None:
        settings["gen_kwargs"] = {"max_gen_toks": max_gen_toks}
    if isinstance(generator, Server):
        lm, where = server_generation_lm(hf_dir, generator, seed), generator.described()
    else:
        lm = ray_generation_lm(hf_dir, depths, generator, seed)
        where = {"dtype": generator.dtype, "device": generator.device, "replicas": generator.count}
    reports = {}
    for depth in depths:
        lm.depth = depth
        reports[depth] = run_tasks(lm, depth, lambda: lm.depths_run.get(depth, ()), [recipe.task], include, limit,
                                   **settings)
    return {"settings": {**asdict(recipe), "task_yaml": str(TASK_YAML), "data": str(data),
                         "samples": min(samples, limit or samples), "max_gen_toks": generation, **where,
                         "seed": seed, "depths": depths},
            "depths": reports}


def sweep_rows(report: dict) -> list[SweepRow]:
    rows = []
    for depth, result in report["depths"].items():
        metrics = result["results"][GSM8K_RECIPE.task]
        rows.append(SweepRow(int(depth), metrics["exact_match,strict-match"], metrics["exact_match,flexible-extract"],
                             report["settings"]["samples"]))
    return rows


def write_sweep_csv(rows: list[SweepRow], path: str | Path) -> Path:
    from huginn_ray.eval.depth_scaling import write_csv

    return write_csv(rows, path, SWEEP_COLUMNS)


def plot_sweep(rows: list[SweepRow], path: str | Path, train_depth: int, title: str) -> Path:
    """Accuracy (both answer extractions) against recurrence depth on a log-2 axis, the training depth marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depths = [r.depth for r in rows]
    fig, ax = plt.subplots(figsize=(5.5, 4))
    ax.plot(depths, [100 * r.flexible_extract for r in rows], "o-", label="flexible-extract")
    ax.plot(depths, [100 * r.strict_match for r in rows], "s--", label="strict-match")
    ax.set_xscale("log", base=2)
    ax.set_xticks(depths, [str(d) for d in depths])
    ax.axvline(train_depth, color="gray", linestyle=":", label=f"training mean depth {train_depth}")
    ax.set_xlabel("core iterations at test time")
    ax.set_ylabel("GSM8k CoT accuracy (%)")
    ax.set_ylim(0, max(10.0, 110 * max(max(r.strict_match, r.flexible_extract) for r in rows)))
    ax.set_title(f"{title} ({rows[0].samples} problems)" if rows else title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
