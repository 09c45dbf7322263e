"""The per-rank costs of the control plane do not grow with the world size: bench/scale_sim.py plays one rank of a
16-, a 64- and a 512-rank run of the Frontier configuration as written (two, eight and 64 nodes of 8) through the
worker's startup, two background saves through start_save and dcp.async_save and the run's last (synchronous) save,
a resume, a whole step and a poll of the hang watch, over a counting fake process group, store and file system:
every item declared flat below has its exact value at every W, a later save's plan items on rank 0 are none at
every W (DCP's save-plan caching), and the bytes a rank reads at resume and at init_from are 1/W of the state and of
the parameters (the replica-spread reads). The 131k configuration (context_parallel 8) is played at W = 64 and 512
only (the CI budget): its flat items have their exact values at both."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import scale_sim  # noqa: E402

WORLD_SIZES = (16, 64, 512)

WARMUP_STAGES = 9
"""hello + 8 all-reduce stages (warmup_allreduce)."""

FLAT = {
    # register_node twice (the loop's and the warm-up's), then per stage: its own key, the counter, the wait and
    # the "all in" key (the simulated rank completes every count)
    "store_ops_startup": 2 + 4 * WARMUP_STAGES,
    "process_groups_created_startup": 3,  # the mesh's two groups and the background save's, nothing else
    "collectives_startup": 19,
    "peak_model_bytes_startup": 5_351_699_784,
    "data_read_amplification": 1.0,  # no more ranks than the 4,096 shards: every row read is trained on
    "data_reads_per_batch_row": 1.0,
    "fs_metadata_ops_init_from": 9,
    "collectives_per_step": 49,
    "store_ops_per_step": 0,  # a step talks to the store not at all: steady state is the hang watch's polls
    "store_ops_per_hang_watch_poll": 1,  # the check of its signal key
    "dcp_plan_items_rank0_later_save": 0,  # DCP's plan cache: no rank sends an unchanged plan
    "bytes_staged_save": 5_351_699_784,  # the background save's host copy: this rank's part of the state
    "collectives_save": 10,  # DCP's on the background group, finish_save's on the default group
    "fs_metadata_ops_save": 10,
    "collectives_save_final": 10,
    "fs_metadata_ops_save_final": 10,
    "fs_metadata_ops_resume_checks": 18,
    "fs_metadata_ops_resume": 22,
    "collectives_resume": 89,
}
"""item -> its value at every world size."""

CP_WORLD_SIZES = (64, 512)
"""Not 16 (the CI budget): two cp groups there train 256 rows each, and the step alone takes 14 s."""

FLAT_CP = {
    **{item: value for item, value in FLAT.items() if item != "fs_metadata_ops_resume"},  # cp: its spans lie in 1
    # to 3 files (21 or 22; asserted below)
    "process_groups_created_startup": 4,  # and the cp group
    "collectives_startup": 20,  # warm_mesh's all-reduce in the cp group too
    "peak_model_bytes_startup": 5_400_458_568,  # the RoPE buffer of 131,072 positions
    "data_reads_per_batch_row": 8.0,  # every rank of a cp group of 8 reads the group's row whole
    "collectives_per_step": 241,  # the attention's K/V all-gathers and their reduce-scatters over the cp group
    "bytes_staged_save": 5_400_458_568,
}
"""The 131k configuration's flat items: item -> its value at W = 64 and 512."""

NOT_GROWING = {"bytes_written_save", "bytes_written_save_most_of_a_rank"}
"""At a larger world size at most what they are at a smaller (DCP spreads the replicated pieces' writes)."""

GROWING_BY_DESIGN = {
    "collective_bytes_startup": (8 + 100, "the node-layout check's all-gather of every rank's placement (loop."
                                 "start_worker): its length and about 100 bytes of JSON per rank, beside the "
                                 "warm-up's 576 MiB"),
    "collective_bytes_save": (30_000, "DCP's write step gathers every rank's write results on rank 0 at every save "
                              "(plan caching does not cover them), each padded by torch's gather_object to rank 0's "
                              "size: about 28 KB a rank"),
    "dcp_plan_items_rank0_first_save": (106, "the first save's plan exchange: every rank's local plan, about 106 "
                                        "items each, on rank 0"),
    "collective_bytes_resume": (1, "the replica-spread read's all-gathers deliver the part (state / S) and the "
                                "values every rank holds whole, in equal chunks: the last rank's span, shorter by "
                                "fewer than W bytes (R in its replica group), is padded"),
}
"""item -> (at most this much per added rank, why)."""

BACKGROUND_GROUP = "gloo_connections_background_group_rank0"
"""W - 1: rank 0's connections in the background save's gloo group (modelled)."""

STORE_SERVER = ("store_requests_rank0_startup", "store_ops_startup")
"""Rank 0's store server answers W times a rank's requests."""

STEADY_STORE_SERVER = ("store_requests_rank0_per_s_steady", "store_ops_per_hang_watch_poll", 1.0)
"""In steady state rank 0's store server answers W times a rank's requests per hang-watch poll, one poll a second
(the Frontier configuration's pg_timeout_s of 900 s gives the watch's 1 s)."""

READ_SHARE = {
    "bytes_read_resume": "state_bytes",
    "bytes_read_init_from": "parameter_bytes",
}
"""item -> what the file system serves once over all W ranks: each rank reads at most 1.1 x that / W."""


@pytest.fixture(scope="module")
def simulated():
    return scale_sim.simulate(list(WORLD_SIZES))


@pytest.fixture(scope="module")
def simulated_cp():
    return scale_sim.simulate(list(CP_WORLD_SIZES), "frontier_nebel_131k")


def test_every_item_is_declared_once(simulated):
    declared = [*FLAT, *NOT_GROWING, *GROWING_BY_DESIGN, BACKGROUND_GROUP, STORE_SERVER[0], STEADY_STORE_SERVER[0],
                *READ_SHARE]
    assert sorted(declared) == sorted(simulated["per_rank"]) and len(set(declared)) == len(declared)


def test_flat_items_have_their_value_at_every_world_size(simulated):
    per_rank = simulated["per_rank"]
    assert simulated["world_sizes"] == list(WORLD_SIZES)
    wrong = {item: per_rank[item] for item, value in FLAT.items() if per_rank[item] != [value] * len(WORLD_SIZES)}
    assert not wrong, f"per-rank items (values at W = {WORLD_SIZES}) other than {FLAT}: {wrong}"


def test_context_parallel_flat_items_have_their_value_at_every_world_size(simulated_cp):
    """The 131k configuration (cp groups of 8 inside the node's shard group): its startup with the cp group, its
    saves, a whole step with the attention's collectives over the cp group, its reads and its store requests."""
    per_rank = simulated_cp["per_rank"]
    assert simulated_cp["config"] == "frontier_nebel_131k.yaml" and simulated_cp["world_sizes"] == list(CP_WORLD_SIZES)
    wrong = {item: per_rank[item] for item, value in FLAT_CP.items()
             if per_rank[item] != [value] * len(CP_WORLD_SIZES)}
    assert not wrong, f"per-rank items (values at W = {CP_WORLD_SIZES}) other than {FLAT_CP}: {wrong}"
    assert per_rank[BACKGROUND_GROUP] == [w - 1 for w in CP_WORLD_SIZES]
    assert per_rank["dcp_plan_items_rank0_first_save"][0] > 0 == per_rank["dcp_plan_items_rank0_later_save"][-1]
    assert all(2 <= opened - checked <= 4 for opened, checked in zip(per_rank["fs_metadata_ops_resume"],
                                                                   per_rank["fs_metadata_ops_resume_checks"]))


def test_a_later_save_sends_rank_zero_no_plan_items(simulated):
    """The first save's plan exchange grows with W on rank 0; a later one's does not (it is empty at every W)."""
    first, later = (simulated["per_rank"][item] for item in ("dcp_plan_items_rank0_first_save",
                                                             "dcp_plan_items_rank0_later_save"))
    assert first == sorted(first) and first[0] > 0 and later == [0] * len(WORLD_SIZES), (first, later)


def test_growing_items_grow_as_designed(simulated):
    per_rank = simulated["per_rank"]
    for item in NOT_GROWING:
        assert per_rank[item] == sorted(per_rank[item], reverse=True), (item, per_rank[item])
    for item, (per_added_rank, _) in GROWING_BY_DESIGN.items():
        for (w0, v0), (w1, v1) in zip(zip(WORLD_SIZES, per_rank[item]), zip(WORLD_SIZES[1:], per_rank[item][1:])):
            assert 0 <= v1 - v0 <= per_added_rank * (w1 - w0), (item, per_rank[item])
    assert per_rank[BACKGROUND_GROUP] == [w - 1 for w in WORLD_SIZES]
    server, own = (per_rank[item] for item in STORE_SERVER)
    assert server == [w * n for w, n in zip(WORLD_SIZES, own)], (server, own)
    steady, per_poll = (per_rank[item] for item in STEADY_STORE_SERVER[:2])
    assert steady == [w * n / STEADY_STORE_SERVER[2] for w, n in zip(WORLD_SIZES, per_poll)], (steady, per_poll)
    # the file system serves the state (resume) and the parameters (init_from) once: 1 / W each, and a little
    for item, whole in READ_SHARE.items():
        for world_size, value in zip(WORLD_SIZES, per_rank[item]):
            share = simulated["sizes"][whole] / world_size
            assert 0.9 * share <= value <= 1.1 * share, (item, world_size, value, share)


def test_resume_opens_a_few_files_at_every_world_size(simulated):
    """The replica-spread read opens the .metadata and the few files of its spans, whatever W."""
    files = simulated["per_rank"]["fs_metadata_ops_resume"]
    checks = simulated["per_rank"]["fs_metadata_ops_resume_checks"]
    assert all(2 <= opened - checked <= 4 for opened, checked in zip(files, checks)), (files, checks)
