"""The random initial weights of a model whose parameters are FSDP2-sharded: each rank draws every parameter whole,
in the order and with the random numbers of the unsharded model, and keeps its own rows."""

from __future__ import annotations

import torch
from torch import Tensor

from huginn_ray.model.model import RecurrentGPT
from huginn_ray.train.replica_read import local_rows


@torch.no_grad()
def initialise_sharded(model: RecurrentGPT) -> RecurrentGPT:
    """`model.initialise` into allocated storage, whole or this rank's FSDP2 shards: the values are bitwise those of
    the whole-model init on every layout. A sharded parameter is drawn whole into one scratch buffer (the size of
    the largest sharded parameter, reused) and this rank keeps its rows: a rank holds its shards plus one
    parameter, never the whole model."""
    from torch.distributed.tensor import DTensor

    sharded = [p for p in model.parameters() if isinstance(p, DTensor)]
    scratch = {p.dtype: torch.empty(max(q.numel() for q in sharded if q.dtype == p.dtype), dtype=p.dtype,
                                    device=p.to_local().device) for p in sharded}

    def draw(param: Tensor, init) -> None:
        target, rows = local_rows(param)
        if rows is None:
            init(target)
            return
        whole = scratch[param.dtype][: param.numel()].view(param.shape)
        init(whole)
        target.copy_(whole[rows])

    return model.initialise(draw)
