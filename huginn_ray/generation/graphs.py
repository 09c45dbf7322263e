"""Running the decode step: eagerly (the reference, and the CPU's way), or on CUDA as one captured
`torch.cuda.CUDAGraph` per step kind, replayed.

Every tensor a step reads or writes lives in the slots' persistent buffers (huginn_ray.generation.slots), so a
graph captured once for a `StepKind` replays any later step of that kind. The first step of a kind runs eagerly
on a side stream (the real step, and the warm-up capture asks for), then the kind is captured (capture records
and runs nothing); the next steps of that kind replay it. A growth of the buffers (more positions, core planes or
stop ids: `SlotCache.version`) drops the graphs captured over the old ones. Not yet run on a GPU: the tests run
the eager path, which is the same function.
"""

from __future__ import annotations

import torch

from huginn_ray.generation.decode_step import StepKind, decode_step
from huginn_ray.generation.slots import Slots
from huginn_ray.model.model import RecurrentGPT


class StepRunner:
    """`run(kind)`: one decode step over `slots`, eager or replayed (`cuda_graphs`)."""

    def __init__(self, model: RecurrentGPT, slots: Slots, cuda_graphs: bool):
        self.model, self.slots, self.cuda_graphs = model, slots, cuda_graphs
        self.graphs: dict[StepKind, torch.cuda.CUDAGraph] = {}
        self.version = slots.cache.version
        self.memory = torch.cuda.graph_pool_handle() if cuda_graphs else None
        """One memory pool shared by every captured kind (they never replay at once)."""

    def run(self, kind: StepKind) -> None:
        if not self.cuda_graphs:
            decode_step(self.model, self.slots, kind)
            return
        if self.slots.cache.version != self.version:
            self.graphs.clear()
            self.version = self.slots.cache.version
        graph = self.graphs.get(kind)
        if graph is not None:
            graph.replay()
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            decode_step(self.model, self.slots, kind)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.memory):
            decode_step(self.model, self.slots, kind)
        self.graphs[kind] = graph
