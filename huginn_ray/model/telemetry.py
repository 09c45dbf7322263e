"""Statistics of the latent state that show how the recurrence behaved in a forward (training logs them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


@torch.no_grad()
def latent_telemetry(embedded: Tensor, previous_state: Tensor, latent: Tensor, last_hidden: Tensor,
                     num_steps: tuple[int, int]) -> dict[str, Tensor]:
    """How the recurrence behaved this step: norms of the latent state, its change in the last iteration,
    its distance from the input embedding e, and how similar token states have become (collapse shows as
    correlation near 1). Scalars on the model's device, so that the caller reads them with the rest of its
    metrics (training: once per log interval)."""
    def mean_token_norm(x: Tensor) -> Tensor:
        return x.float().norm(dim=-1).mean()

    def token_correlation(x: Tensor) -> Tensor:
        tokens = x[0].float()
        tokens = tokens - tokens.mean(dim=0, keepdim=True)
        tokens = F.normalize(tokens, dim=-1)
        length = tokens.shape[0]
        return (tokens @ tokens.T).mean() - 1.0 / length

    residual = mean_token_norm(latent - previous_state)
    state_norm = mean_token_norm(latent)
    return {
        "recurrent_state_norm": state_norm,
        "last_hidden_norm": mean_token_norm(last_hidden),
        "recurrent_residual": residual,
        "rel_residual": residual / state_norm.clamp(min=1e-12),
        "recurrent_diff": mean_token_norm(latent - embedded),
        "recurrent_state_token_corr": token_correlation(latent),
        "last_hidden_token_corr": token_correlation(last_hidden),
        "num_steps_no_grad": torch.tensor(float(num_steps[0]), device=latent.device),
        "num_steps_with_grad": torch.tensor(float(num_steps[1]), device=latent.device),
    }
