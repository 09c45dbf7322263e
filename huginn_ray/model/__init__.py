"""The Huginn recurrent-depth model: config, module, depth sampler, FLOPs, and HF-layout save/load."""

from huginn_ray.model.cache import KVCache
from huginn_ray.model.config import MODEL_REGISTRY, ModelConfig
from huginn_ray.model.flops import training_flops_per_token
from huginn_ray.model.loss import chunked_cross_entropy
from huginn_ray.model.model import ModelOutput, RecurrentGPT, sample_recurrence
from huginn_ray.model.pretrained import load_pretrained, save_pretrained

__all__ = [
    "MODEL_REGISTRY", "KVCache", "ModelConfig", "ModelOutput", "RecurrentGPT", "load_pretrained",
    "chunked_cross_entropy", "sample_recurrence", "save_pretrained", "training_flops_per_token",
]
