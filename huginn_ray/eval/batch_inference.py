"""Evaluation as Ray Data batch inference: a dataset of requests or rows -> `map_batches` over an actor pool of
model replicas (one per GPU, or CPU actors; each loads the model once) -> scoring on the driver.

    depth scaling:  validation rows (key, input_ids) -> DepthLossReplica -> per-row loss sums at every depth
    GSM8k recipe:   lm-eval builds the prompts and scores the answers; RayGenerationLM, the model it is handed,
                    sends every generation request, at every depth of a sweep at once, through GenerationReplica

The results do not depend on the number of replicas or on which replica serves what: a row's initial latent
state is keyed by the row (shard x 2^32 + row, training's validation keying, `RecurrentGPT.keyed_initial_state`),
a generation request is generated alone with its own seed (`seed + its index`), and the batches are the
dataset's blocks, which the data fixes, not the replicas. Cost: the model is loaded once per replica; the driver
holds the validation rows it reads (depth scaling) or the requests' texts (GSM8k).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from huginn_ray.eval.validation_rows import read_validation_rows


@dataclass(frozen=True)
class Replicas:
    """The actor pool that runs a model: how many, where, in what precision."""

    count: int
    """Model replicas (actors), each loading the model once."""
    device: str
    """`cpu` or `cuda` (each replica then gets one GPU of its own from Ray)."""
    dtype: str
    """`float32` or `bfloat16`: the weights' dtype (huginn_ray.model.inference)."""
    threads: int = 1
    """CPU threads (and Ray CPUs) per replica; fixed, so that results do not depend on the machine's load."""

    def __post_init__(self):
        if self.count < 1:
            raise ValueError(f"replicas must be >= 1, got {self.count}")

    def map_batches_options(self) -> dict:
        import ray

        return {"compute": ray.data.ActorPoolStrategy(size=self.count), "num_cpus": self.threads,
                "num_gpus": 1 if torch.device(self.device).type == "cuda" else 0}

    def placement(self):
        from huginn_ray.model.inference import inference_placement

        torch.set_num_threads(self.threads)
        return inference_placement("cuda" if torch.device(self.device).type == "cuda" else "cpu", self.dtype)


# ---------------------------------------------------------------------------------------------------------
# depth scaling
# ---------------------------------------------------------------------------------------------------------
class DepthLossReplica:
    """One model replica: for a batch of validation rows, each row's summed next-token loss and label count at
    every depth (pad labels ignored, as in training's validation)."""

    def __init__(self, model_dir: str, depths: list[int], replicas: Replicas, seed: int, pad_id: int, eos_id: int):
        from huginn_ray.model.inference import load_for_inference
        from huginn_ray.model_cache import local_model_dir

        self.placement = replicas.placement()
        self.model, _ = load_for_inference(local_model_dir(model_dir), self.placement)  # a bucket: this node's copy
        self.depths, self.seed, self.pad_id, self.eos_id = depths, seed, pad_id, eos_id

    @torch.no_grad()
    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        device = self.placement.device
        rows = torch.from_numpy(np.stack(batch["input_ids"]).astype(np.int64)).to(device)
        keys = torch.from_numpy(batch["key"].astype(np.int64))
        inputs, labels = rows[:, :-1].clone(), rows[:, 1:]
        inputs[inputs == self.pad_id] = self.eos_id
        states = self.model.keyed_initial_state(keys, inputs.shape[1], self.seed, device).to(self.placement.dtype)
        sums = np.zeros((len(keys), len(self.depths)), dtype=np.float64)
        for i, depth in enumerate(self.depths):
            logits = self.model(inputs, num_steps=(depth, 0), input_states=states).logits
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=self.pad_id, reduction="none")
            sums[:, i] = loss.view(len(keys), -1).double().sum(dim=1).cpu().numpy()
        return {"key": batch["key"], "loss_sums": sums, "tokens": (labels != self.pad_id).sum(dim=1).cpu().numpy()}


def depth_losses(model_dir: str | Path, shards: list[str], depths: list[int], replicas: Replicas, *,
                 max_rows: int | None, batch_size: int, seed: int, pad_id: int, eos_id: int) -> list[tuple[float, int]]:
    """(summed loss, label count) at each depth over the validation rows, on the connected Ray cluster."""
    import pyarrow as pa
    import ray
    from ray.data.extensions import ArrowTensorArray

    keys, rows = read_validation_rows(shards, max_rows)
    # blocks of exactly batch_size rows (the last one shorter), batched by batch_size: every batch is one block,
    # fixed by the data (Ray Data refuses batch_size=None, "a block a batch", for an actor that takes a GPU)
    blocks = [pa.table({"key": keys[i : i + batch_size],
                        "input_ids": ArrowTensorArray.from_numpy(rows[i : i + batch_size])})
              for i in range(0, len(keys), batch_size)]
    results = ray.data.from_blocks(blocks).map_batches(
        DepthLossReplica, fn_constructor_kwargs=dict(model_dir=str(model_dir), depths=depths, replicas=replicas,
                                                     seed=seed, pad_id=pad_id, eos_id=eos_id),
        batch_size=batch_size, **replicas.map_batches_options()).take_all()
    results.sort(key=lambda r: r["key"])  # sums in one order, whatever replica returned what first
    tokens = sum(int(r["tokens"]) for r in results)
    return [(float(sum(r["loss_sums"][i] for r in results)), tokens) for i in range(len(depths))]


# ---------------------------------------------------------------------------------------------------------
# generation (lm-eval generate_until tasks: the GSM8k recipe)
# ---------------------------------------------------------------------------------------------------------
class GenerationReplica:
    """One replica of the Hugging Face export in lm-eval's HFLM (huginn_ray.eval.lm_eval.HuginnLM); generates each
    request of a batch alone, at the request's depth, after seeding torch with `seed + index`."""

    def __init__(self, hf_dir: str, replicas: Replicas, seed: int):
        from huginn_ray.eval.lm_eval import HuginnLM

        placement = replicas.placement()
        self.lm = HuginnLM(hf_dir, 1, batch_size=1, device=str(placement.device), dtype=placement.dtype_name)
        self.seed = seed

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from lm_eval.api.instance import Instance

        texts, depths_run = [], []
        for index, depth, context, gen_kwargs in zip(batch["index"], batch["depth"], batch["context"],
                                                     batch["gen_kwargs"]):
            self.lm.depth = int(depth)
            self.lm.seen.clear()
            torch.manual_seed(self.seed + int(index))
            request = Instance("generate_until", {}, (str(context), json.loads(gen_kwargs)), 0)
            texts.append(self.lm.lm.generate_until([request], disable_tqdm=True)[0])
            depths_run.append(json.dumps(sorted(self.lm.seen)))
        return {"index": batch["index"], "depth": batch["depth"], "text": np.array(texts, dtype=object),
                "depths_run": np.array(depths_run, dtype=object)}


def ray_generation_lm(hf_dir: str | Path, depths: list[int], replicas: Replicas, seed: int = 0):
    """The lm-eval model that generates on `replicas` (imports lm-eval only when called)."""
    from lm_eval.api.model import TemplateLM
    from lm_eval.models.huggingface import HFLM

    class RayGenerationLM(TemplateLM):
        """lm-eval's model on the driver: prompts are built with the export's tokenizer and chat template (HFLM's
        own code), and `generate_until` sends the requests through Ray Data to GenerationReplica actors, for every
        depth of `depths` in one pipeline; later depths are then answered from what that run generated. Only
        generation tasks: loglikelihood requests are refused."""

        apply_chat_template = HFLM.apply_chat_template
        tokenizer_name = HFLM.tokenizer_name

        def __init__(self):
            super().__init__()
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(str(hf_dir), trust_remote_code=True)
            self.chat_template_args = {}
            self.depth = depths[0]
            self.generated: dict[int, dict[tuple[str, str], str]] = {d: {} for d in depths}
            self.depths_run: dict[int, set[int]] = {d: set() for d in depths}

        @property
        def eot_token_id(self) -> int:
            return self.tokenizer.eos_token_id

        def tok_encode(self, string: str, **kwargs) -> list[int]:
            return self.tokenizer.encode(string, add_special_tokens=False)

        def _loglikelihood_tokens(self, requests, **kwargs):
            raise ValueError("the Ray Data evaluation serves generation tasks (the GSM8k recipe); loglikelihood "
                             "tasks run with jobs/evaluate.py --lm-eval")

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            return self._loglikelihood_tokens(requests)

        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            import ray

            keys = [(context, json.dumps(gen_kwargs, sort_keys=True)) for context, gen_kwargs in
                    (request.args for request in requests)]
            order = list(dict.fromkeys(keys))
            todo = [{"index": index, "depth": depth, "context": key[0], "gen_kwargs": key[1]}
                    for depth in depths for index, key in enumerate(order) if key not in self.generated[depth]]
            if todo:
                results = ray.data.from_items(todo, override_num_blocks=len(todo)).map_batches(
                    GenerationReplica, fn_constructor_kwargs=dict(hf_dir=str(hf_dir), replicas=replicas, seed=seed),
                    batch_size=1, **replicas.map_batches_options()).take_all()  # one request a batch: even spread
                for result in results:
                    depth = int(result["depth"])
                    self.generated[depth][order[int(result["index"])]] = str(result["text"])
                    self.depths_run[depth].update(json.loads(result["depths_run"]))
            return [self.generated[self.depth][key] for key in keys]

    return RayGenerationLM()
