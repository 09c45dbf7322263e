"""lm-eval's `local-completions` model against a running jobs/serve.py: the GSM8k recipe through the server.

    lm = server_generation_lm(hf_dir, Server("http://127.0.0.1:8000", num_concurrent=8), seed=0)
    lm.depth = 8                          # every request asks num_steps=8 (and the server's exit criterion)
    lm_eval.simple_evaluate(model=lm, ...)

lm-eval builds the prompts on the driver with the export's tokenizer and chat template, as the Ray Data path
(batch_inference.RayGenerationLM) does, cuts them from the left to `block_size - max_gen_toks` tokens as HFLM
does, and sends each as token ids to the server's /v1/completions, `num_concurrent` at once: the server's engine
batches them, each token exiting the recurrence on its own (continuous depth batching). The fields the recipe
needs go with every request: `num_steps` (the depth), `exit_criterion` and `exit_threshold`, `stop` (the task's
`until`, the tokenizer's EOS text and `<|end_turn|>`, where the export's generation config stops too), `seed`
(`seed + the request's index`, the Ray Data path's per-request seed: the server draws a request's initial latent
noise from its own generator seeded so, the Ray Data path from torch's after `torch.manual_seed` with it), and
`return_token_ids`. A reply's text is its token ids decoded without special tokens and cut at the first `until`
string, as HFLM makes it. So a request's answer does not depend on `num_concurrent` or on what else the server
runs. It is not token for token the Ray Data path's: the export's modeling code draws the initial latent noise with
torch's `nn.init.trunc_normal_` (normal draws with rejection since torch 2.6), the server's RecurrentGPT by the
inverse CDF (huginn_ray.model.noise, the reference's sampling), so the same seed gives other noise there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

END_TURN_TEXT = "<|end_turn|>"
"""A chat reply ends its turn here; the export's generation config stops at it (huginn_ray.model.export)."""


@dataclass(frozen=True)
class Server:
    """A running jobs/serve.py to evaluate through."""

    url: str
    """Its base URL, e.g. http://127.0.0.1:8000 (the API is under /v1)."""
    num_concurrent: int = 8
    """Requests in flight at once (lm-eval's num_concurrent): what the server's engine can batch."""
    api_key: str | None = None
    """The server's API key (`Authorization: Bearer`), when it asks one."""
    exit_criterion: str | None = None
    """Each request's exit criterion (None: the server's default, a fixed depth)."""
    exit_threshold: float | None = None
    """Each request's exit threshold (None: the criterion's default)."""

    def __post_init__(self):
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--server must be an http(s) URL such as http://127.0.0.1:8000, got {self.url!r}")
        if self.num_concurrent < 1:
            raise ValueError(f"num_concurrent must be >= 1, got {self.num_concurrent}")

    def described(self) -> dict:
        """What the report records (never the key)."""
        return {"server": self.url, "num_concurrent": self.num_concurrent, "exit_criterion": self.exit_criterion,
                "exit_threshold": self.exit_threshold}


def server_generation_lm(hf_dir: str | Path, server: Server, seed: int = 0):
    """The lm-eval model that generates through `server` (imports lm-eval only when called)."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from huginn_ray.model.config import ModelConfig

    block_size = ModelConfig.from_json(Path(hf_dir) / "config.json").block_size

    class ServerGenerationLM(LocalCompletionsAPI):
        """local-completions with the recipe's fields on every request and the Ray Data path's seeds and text;
        `depths_run[depth]`: the core iterations per token the server reported for that depth's requests."""

        def __init__(self):
            super().__init__(base_url=server.url.rstrip("/") + "/v1/completions", model="huginn",
                             tokenizer=str(hf_dir), tokenizer_backend="huggingface", tokenized_requests=True,
                             num_concurrent=server.num_concurrent, max_length=block_size + 1,  # lm-eval keeps 1 back
                             max_retries=1, header={"Authorization": f"Bearer {server.api_key or ''}"})
            self.depth, self.seed_base = 0, seed
            self.depths_run: dict[int, set[int]] = {}
            self.index: dict[tuple[int, ...], int] = {}
            """A request's prompt ids (as sent) -> its index among the distinct requests, as the Ray Data path
            numbers them."""

        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            keys = [(context, json.dumps(gen_kwargs, sort_keys=True)) for context, gen_kwargs in
                    (request.args for request in requests)]
            self.index = {}
            for index, (context, gen_kwargs) in enumerate(dict.fromkeys(keys)):
                ids = self.tok_encode(context)[-(self.max_length - self._max_gen(json.loads(gen_kwargs))):]
                self.index.setdefault(tuple(ids), index)
            texts = super().generate_until(requests, disable_tqdm)
            return [self._cut(text, request.args[1]) for text, request in zip(texts, requests, strict=True)]

        def _max_gen(self, gen_kwargs: dict) -> int:
            return gen_kwargs.get("max_gen_toks", self._max_gen_toks)

        def _cut(self, text: str, gen_kwargs: dict) -> str:
            """The text before the first `until` string, as HFLM cuts its replies."""
            until = gen_kwargs.get("until") or []
            for term in [until] if isinstance(until, str) else until:
                text = text.split(term)[0] if term else text
            return text

        def _create_payload(self, messages, generate=False, gen_kwargs=None, seed=0, eos=None, **kwargs) -> dict:
            payload = super()._create_payload(messages, generate=generate, gen_kwargs=gen_kwargs, seed=seed, eos=eos,
                                              **kwargs)
            if not generate:
                raise ValueError("the evaluation through the server runs generation tasks (the GSM8k recipe) only")
            [prompt] = messages  # batch size 1: each request on its own, batched by the server's engine
            payload["stop"] = [*payload["stop"], END_TURN_TEXT]
            payload.update(seed=self.seed_base + self.index[tuple(prompt)], num_steps=self.depth, return_token_ids=True)
            payload.update({name: value for name, value in (("exit_criterion", server.exit_criterion),
                                                            ("exit_threshold", server.exit_threshold))
                            if value is not None})
            return payload

        def parse_generations(self, outputs, **kwargs) -> list[str]:
            texts = []
            for output in outputs if isinstance(outputs, list) else [outputs]:
                [choice] = output["choices"]
                self.depths_run.setdefault(self.depth, set()).update(choice["core_iterations"])
                texts.append(self.tokenizer.decode(choice["token_ids"], skip_special_tokens=True))
            return texts

    return ServerGenerationLM()
