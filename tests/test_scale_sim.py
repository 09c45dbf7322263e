"""The per-rank costs of the control plane do not grow with the world size: bench/scale_sim.py plays one rank of a
16- and of a 64-rank run of the Frontier configuration (two and eight nodes of 8: both have shard groups to
exchange between; a one-node world has none) over a counting fake process group, store and file system: every
item declared flat below is equal at both sizes, and the bytes a rank reads at resume and at init_from are 1/W of
the state and of the parameters (the replica-spread read)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import scale_sim  # noqa: E402

WORLD_SIZES = (16, 64)

FLAT = {
    "store_ops_startup", "process_groups_created_startup", "collectives_startup", "fs_metadata_ops_init_from",
    "collectives_save", "collective_bytes_save", "fs_metadata_ops_save", "fs_metadata_ops_resume_checks",
    "collectives_resume", "collectives_per_step", "peak_model_bytes_startup",
}
"""Equal at every world size."""

NOT_GROWING = {"bytes_written_save"}
"""At the larger world size at most what they are at the smaller (DCP spreads the replicated pieces' writes)."""

GROWING_BY_DESIGN = {
    "collective_bytes_startup": (8 + 100, "the node-layout check's all-gather of every rank's placement (loop._train): "
                                 "its length and about 100 bytes of JSON per rank, beside the warm-up's 576 MiB"),
    "collective_bytes_resume": (512 * 1024, "the replica-spread read's all-gathers: each split part is gathered in "
                                "R = W / S equal blocks of ceil(rows / R) rows, up to R - 1 rows of padding per "
                                "tensor, beside the part itself (state / S)"),
}
"""item -> (at most this many bytes per added rank, why)."""

READ_SHARE = {
    "bytes_read_resume": "state_bytes",
    "bytes_read_init_from": "parameter_bytes",
}
"""item -> what the file system serves once over all W ranks: each rank reads at most 1.1 x that / W."""

FILES_PER_RESUME = "fs_metadata_ops_resume"
"""Resume's file operations: its checks (flat) plus the files the replica-spread read opens: the .metadata and the
file of each piece holding rows it reads, at most one per tensor of the state (the save's layout). They grow with
the number of ranks that wrote the shard group's pieces until each tensor's piece is in a file of its own, then
stay: bounded by the state's tensor count, not flat yet (the train README, "Cost at scale")."""

WARMUP_STAGES = 9
"""hello + 8 all-reduce stages (warmup_allreduce)."""


@pytest.fixture(scope="module")
def simulated():
    return scale_sim.simulate(list(WORLD_SIZES))


def test_every_item_is_declared_once(simulated):
    declared = [*FLAT, *NOT_GROWING, *GROWING_BY_DESIGN, *READ_SHARE, FILES_PER_RESUME]
    assert sorted(declared) == sorted(simulated["per_rank"]) and len(set(declared)) == len(declared)


def test_control_plane_costs_are_flat_in_the_world_size(simulated):
    per_rank = simulated["per_rank"]
    assert simulated["world_sizes"] == list(WORLD_SIZES)
    grown = {item: per_rank[item] for item in FLAT if per_rank[item][0] != per_rank[item][1]}
    assert not grown, f"per-rank costs that grow with W (values at W = {WORLD_SIZES}): {grown}"
    for item in NOT_GROWING:
        assert per_rank[item][1] <= per_rank[item][0], (item, per_rank[item])
    added_ranks = WORLD_SIZES[1] - WORLD_SIZES[0]
    for item, (per_added_rank, _) in GROWING_BY_DESIGN.items():
        assert 0 <= per_rank[item][1] - per_rank[item][0] <= per_added_rank * added_ranks, (item, per_rank[item])
    # the file system serves the state (resume) and the parameters (init_from) once: 1 / W each, and a little
    for item, whole in READ_SHARE.items():
        for world_size, value in zip(WORLD_SIZES, per_rank[item]):
            share = simulated["sizes"][whole] / world_size
            assert 0.9 * share <= value <= 1.1 * share, (item, world_size, value, share)
    opened = [files - checks for files, checks in zip(per_rank[FILES_PER_RESUME],
                                                      per_rank["fs_metadata_ops_resume_checks"])]
    assert all(2 <= files <= 1 + simulated["sizes"]["state_tensors"] for files in opened), opened
    # register_node twice (the loop's and the warm-up's), then per stage: its own key, the counter, the wait and
    # the "all in" key (the simulated rank completes every count)
    assert per_rank["store_ops_startup"] == [2 + 4 * WARMUP_STAGES] * 2
    # a rank creates its two mesh groups and nothing else; the save agrees in one all-reduce
    assert per_rank["process_groups_created_startup"] == [2, 2]
    assert per_rank["collectives_save"] == [1, 1]
