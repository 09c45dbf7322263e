"""A hung collective leaves every rank's flight-recorder dump and one console line naming the rank that did not
arrive (huginn_ray/train/hang_watch.py; real gloo process groups, torch's flight recorder).

Three ranks enter an all-reduce and a broadcast; then rank 1 sleeps past the process-group timeout while ranks 0
and 2 enter the next all-reduce. The watch of a waiting rank reports at half the timeout, before the all-reduce
raises.
"""

from __future__ import annotations

import os
import pickle
import re
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist

from huginn_ray.train import hang_watch
from huginn_ray.train.warmup import register_node
from test_train_grad_sync import spawn

TIMEOUT_S = 10  # the watch reports at half of it: room for a loaded machine (two test workers on 2 cores)


def one_rank_sleeps_past_the_timeout(rank, world_size):
    register_node()
    run_dir = Path(os.environ["HANG_WATCH_TEST_RUN_DIR"])
    with hang_watch.watching(run_dir, TIMEOUT_S):
        tensor = torch.ones(3)
        dist.all_reduce(tensor)
        dist.broadcast(tensor, 0)
        if rank == 1:
            time.sleep(TIMEOUT_S + 1)  # never joins the third collective
            return {"slept": True}
        try:
            dist.all_reduce(tensor)
        except Exception as err:  # gloo's timeout
            return {"error": type(err).__name__, "message": str(err)}
    return {"message": "all-reduce returned"}


def test_a_hung_collective_leaves_a_dump_per_rank_and_names_the_rank_that_did_not_arrive(tmp_path, monkeypatch,
                                                                                          capfd):
    run_dir = tmp_path / "run"
    for name, value in {**hang_watch.flight_recorder_env(run_dir), "HANG_WATCH_TEST_RUN_DIR": str(run_dir)}.items():
        monkeypatch.setenv(name, value)  # what the launcher gives every Ray Train worker
    results = spawn(one_rank_sleeps_past_the_timeout, 3, tmp_path, timeout_s=TIMEOUT_S)
    assert [("error" in r) for r in results] == [True, False, True], results

    console = capfd.readouterr()
    lines = [line for line in console.out.splitlines() if "hang watch" in line]
    assert len(lines) == 1, (console.out, console.err)
    host = socket.gethostname()
    assert re.search(r"rank [02] has waited \d+\.\d s in gloo:all_reduce #3 of process group 0 \(ranks \[0, 1, 2\], "
                     r"pg_timeout_s=10\)", lines[0]), lines[0]
    assert f"did not arrive: rank 1 (node {host}, last entered gloo:broadcast #2); did not answer: none" in lines[0]

    dumps = hang_watch.dump_dir(run_dir)
    assert lines[0].endswith(f"every rank's flight recorder in {dumps}/rank_<rank>"), lines[0]
    assert sorted(p.name for p in dumps.iterdir()) == ["rank_0", "rank_1", "rank_2"]
    for rank in range(3):
        entries = pickle.loads((dumps / f"rank_{rank}").read_bytes())["entries"]
        assert [(e["collective_seq_id"], e["profiling_name"]) for e in entries] == \
            [(1, "gloo:all_reduce"), (2, "gloo:broadcast")] + ([] if rank == 1 else [(3, "gloo:all_reduce")])
