"""Model FLOPs of a training step, for MFU.

Counts the matrix multiplications the way `torch.utils.flop_counter.FlopCounterMode` does (2 FLOPs per
multiply-add; attention scores over the full T x T square, as SDPA's kernels are counted; backward = 2x
forward for every part that gets gradients). Work that is not in the model's math is left out: the
recomputation of activation checkpointing and of the chunked loss's head matmul in backward, and the backward
of the no-grad iterations, which never runs.
"""

from __future__ import annotations

from huginn_ray.model.config import ModelConfig


def training_flops_per_token(config: ModelConfig, num_steps: tuple[int, int], seq_len: int) -> float:
    """Forward + backward FLOPs per token of one training step at depth (n no-grad, k grad) iterations."""
    n, k = num_steps
    D, I = config.n_embd, config.intermediate_size
    block = 2 * (3 * D * D + D * D + 2 * D * I + I * D) + 4 * seq_len * D  # linears + QK^T and AV
    adapter = 2 * (2 * D) * D
    head = 2 * D * config.padded_vocab_size
    core_iteration = adapter + config.n_layers_in_recurrent_block * block
    once = (config.n_layers_in_prelude + config.n_layers_in_coda) * block + head

    forward = once + (n + k) * core_iteration
    backward = 2 * (once + k * core_iteration)
    return float(forward + backward)



def inference_flops_per_token(config: ModelConfig, core_iterations: float, context_len: int,
                              coda_head_evals: float = 1.0) -> float:
    """Forward FLOPs of one token at inference: prelude once, `core_iterations` core iterations, and the coda +
    head `coda_head_evals` times (1 for a plain forward; more when an exit criterion reads the logits at its
    checks). Attention is counted over the `context_len` positions the token attends to."""
    D, I = config.n_embd, config.intermediate_size
    block = 2 * (3 * D * D + D * D + 2 * D * I + I * D) + 4 * context_len * D
    core_iteration = 2 * (2 * D) * D + config.n_layers_in_recurrent_block * block
    coda_head = config.n_layers_in_coda * block + 2 * D * config.padded_vocab_size
    return float(config.n_layers_in_prelude * block + core_iterations * core_iteration + coda_head_evals * coda_head)
