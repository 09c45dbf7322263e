"""Running the decode step: eagerly (the reference), compiled by torch.compile, and on CUDA as one captured
`torch.cuda.CUDAGraph` per step kind, replayed.

Every tensor a step reads or writes lives in the slots' persistent buffers (huginn_ray.generation.slots), and a
step's shapes depend only on its `StepKind` and the buffers' sizes, so each kind is one static graph:

- `compile`: `decode_step` under `torch.compile(fullgraph=True, dynamic=False)`; TorchDynamo guards on the kind
  and the buffers' shapes, so each kind (and each growth of the buffers) is compiled once, the first time it
  runs, and later steps of that kind run the compiled code. Inductor fuses the step's elementwise work (the
  masks, the `torch.where`s, the criteria, the norms) into a few loops and removes the Python dispatch per op:
  for raven-tiny on the CPU the compiled server served 1.31-1.61x the eager one's tokens/s (BENCHMARKS.md,
  "Serving").
- `cuda_graphs`: the first step of a kind runs on a side stream (the real step, and the warm-up capture asks
  for; with `compile`, also its compilation), then the kind is captured (capture records and runs nothing); the
  next steps of that kind replay it. A growth of the buffers (more positions, core planes or stop ids:
  `SlotCache.version`) drops the graphs captured over the old ones. Not yet run on a GPU: the tests run the eager
  and the compiled paths on the CPU, which are the same function.
"""

from __future__ import annotations

import torch

from huginn_ray.generation.decode_step import StepKind, decode_step
from huginn_ray.generation.slots import Slots
from huginn_ray.model.model import RecurrentGPT

COMPILED_KINDS = 256
"""Compiled versions of the step one process keeps (TorchDynamo's recompile limit while a compiled step runs;
its default, 8, would send a server with more kinds than that back to eager steps): a kind is a column bucket,
finishing or not, and the criteria and sampling modes in flight."""


class StepRunner:
    """`run(kind)`: one decode step over `slots`, eager, compiled (`compile`) and/or replayed (`cuda_graphs`)."""

    def __init__(self, model: RecurrentGPT, slots: Slots, cuda_graphs: bool, compile: bool = False):
        self.model, self.slots, self.cuda_graphs = model, slots, cuda_graphs
        self.graphs: dict[StepKind, torch.cuda.CUDAGraph] = {}
        self.version = slots.cache.version
        self.memory = torch.cuda.graph_pool_handle() if cuda_graphs else None
        """One memory pool shared by every captured kind (they never replay at once)."""
        self.compiled_step = torch.compile(decode_step, fullgraph=True, dynamic=False) if compile else None

    def step(self, kind: StepKind) -> None:
        """The step itself, compiled or eager."""
        if self.compiled_step is None:
            decode_step(self.model, self.slots, kind)
            return
        with torch._dynamo.config.patch(recompile_limit=COMPILED_KINDS):  # torch's own config module (2.13)
            self.compiled_step(self.model, self.slots, kind)

    def run(self, kind: StepKind) -> None:
        if not self.cuda_graphs:
            self.step(kind)
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
            self.step(kind)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.memory):
            self.step(kind)
        self.graphs[kind] = graph
