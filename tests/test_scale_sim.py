"""The per-rank costs of the control plane do not grow with the world size: bench/scale_sim.py plays one rank of an
8-, a 16- and a 64-rank run of the Frontier configuration (one, two and eight nodes of 8: the last two have shard
groups to exchange between; a one-node world has none) over a counting fake process group, store and file system:
every item declared flat below is equal at 16 and 64, resume's file operations at most 1.5 x those of the one-node
world, and the bytes a rank reads at resume and at init_from are 1/W of the state and of the parameters (the
replica-spread reads)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import scale_sim  # noqa: E402

ONE_NODE = 8
WORLD_SIZES = (16, 64)

FLAT = {
    "store_ops_startup", "process_groups_created_startup", "collectives_startup", "fs_metadata_ops_init_from",
    "collectives_save", "collective_bytes_save", "fs_metadata_ops_save", "fs_metadata_ops_resume_checks",
    "fs_metadata_ops_resume", "collectives_resume", "collectives_per_step", "peak_model_bytes_startup",
}
"""Equal at every world size."""

NOT_GROWING = {"bytes_written_save"}
"""At the larger world size at most what they are at the smaller (DCP spreads the replicated pieces' writes)."""

GROWING_BY_DESIGN = {
    "collective_bytes_startup": (8 + 100, "the node-layout check's all-gather of every rank's placement (loop._train): "
                                 "its length and about 100 bytes of JSON per rank, beside the warm-up's 576 MiB"),
    "collective_bytes_resume": (1, "the replica-spread read's all-gathers deliver the part (state / S) and the "
                                "values every rank holds whole, in equal chunks: the last rank's span, shorter by "
                                "fewer than W bytes (R in its replica group), is padded"),
}
"""item -> (at most this many bytes per added rank, why)."""

READ_SHARE = {
    "bytes_read_resume": "state_bytes",
    "bytes_read_init_from": "parameter_bytes",
}
"""item -> what the file system serves once over all W ranks: each rank reads at most 1.1 x that / W."""

FILES_PER_RESUME = "fs_metadata_ops_resume"
"""Resume's file operations: its checks, the .metadata, and the files of the rank's contiguous span of its
replica group's bytes and of the values every rank holds whole (a few, at every W): flat, and at most 1.5 x their
count in a one-node world (where one rank reads its whole part)."""

WARMUP_STAGES = 9
"""hello + 8 all-reduce stages (warmup_allreduce)."""


@pytest.fixture(scope="module")
def simulated_with_one_node():
    return scale_sim.simulate([ONE_NODE, *WORLD_SIZES])


@pytest.fixture(scope="module")
def simulated(simulated_with_one_node):
    """The figures at WORLD_SIZES."""
    return {**simulated_with_one_node, "world_sizes": simulated_with_one_node["world_sizes"][1:],
            "per_rank": {item: values[1:] for item, values in simulated_with_one_node["per_rank"].items()}}


def test_every_item_is_declared_once(simulated):
    declared = [*FLAT, *NOT_GROWING, *GROWING_BY_DESIGN, *READ_SHARE]
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
    # register_node twice (the loop's and the warm-up's), then per stage: its own key, the counter, the wait and
    # the "all in" key (the simulated rank completes every count)
    assert per_rank["store_ops_startup"] == [2 + 4 * WARMUP_STAGES] * 2
    # a rank creates its two mesh groups and nothing else; the save agrees in one all-reduce
    assert per_rank["process_groups_created_startup"] == [2, 2]
    assert per_rank["collectives_save"] == [1, 1]


def test_resume_opens_a_few_files_at_every_world_size(simulated_with_one_node):
    """The replica-spread read opens the .metadata and the few files of its spans, whatever W: no more than 1.5 x
    what one rank of a one-node world opens to read its whole part."""
    files = simulated_with_one_node["per_rank"][FILES_PER_RESUME]
    checks = simulated_with_one_node["per_rank"]["fs_metadata_ops_resume_checks"]
    assert files[1] == files[2] <= 1.5 * files[0], files
    assert all(2 <= opened - checked <= 4 for opened, checked in zip(files, checks)), (files, checks)
