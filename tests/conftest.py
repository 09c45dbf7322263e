"""Test-suite rules that hold for every module.

MUST_RUN lists, in one place, the tests that may skip on a developer's machine (no namespace, no sshd, ...) but
must never skip in CI: under CI=true a skip of any of them is reported as a failure, with the skip's reason.
An entry is a test file (every test in it) or a file::test id; an entry that matches no collected test of a
collected file is an error, so the list cannot silently go stale when a test is renamed.

`make test` runs two pytest-xdist workers with `--dist loadfile`: each test file runs whole on one worker, so its
module fixtures (a Ray head, a simulation, a spawn of ranks) are built once. Files on the two workers run side by
side: the Ray heads that jobs are submitted to, and the MLflow servers, take free ports (tests/isolation.py).
SLOW_FIRST puts the files that take longest first (with `--no-loadscope-reorder` xdist hands files out in this
order): a long file that started last would finish alone while the other worker sat idle.
"""

from __future__ import annotations

import os

import pytest

MUST_RUN = (
    "tests/test_train_ray.py",
    "tests/test_train_multinode.py",
    "tests/test_train_tracking.py::test_metrics_survive_an_mlflow_server_restart",
    "tests/test_data_job_submit.py::test_prepare_data_under_ray_job_submit",
    "tests/test_cluster_env.py::test_frontier_environment_reaches_ray_train_workers",
    "tests/test_cluster_sbatch.py::test_frontier_sbatch_brings_up_the_cluster_and_submits_the_job",
    "tests/test_cluster_launcher.py::test_ray_up_exec_job_submit_down",
    "tests/test_data_tokenizer.py::test_transformers_loads_it_with_the_same_ids",
    "tests/test_private_netns.py::test_inside_the_namespace_the_marker_names_its_namespaces",
    "tests/test_serve.py",
    "tests/test_storage.py",
)


SLOW_FIRST = (
    "tests/test_train_ray.py",
    "tests/test_eval_gsm8k.py",
    "tests/test_train_multinode.py",
    "tests/test_train_parallel.py",
    "tests/test_serve.py",
    "tests/test_data_pipeline.py",
    "tests/test_cluster_launcher.py",
    "tests/test_scale_sim.py",
    "tests/test_data_hub_download.py",
    "tests/test_train_tracking.py",
)
"""The files that take longest in `make test` (its `--durations` on a fresh clone), longest first."""


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1")


def must_run(nodeid: str) -> bool:
    base = nodeid.split("[", 1)[0]  # without the parameters
    return any(base == entry or base.startswith(entry + "::") for entry in MUST_RUN)


@pytest.hookimpl(tryfirst=True)  # before -k/-m deselection, which would make entries look stale
def pytest_collection_modifyitems(session, config, items):
    files = {item.nodeid.split("::", 1)[0] for item in items}
    bases = [item.nodeid.split("[", 1)[0] for item in items]
    stale = [entry for entry in MUST_RUN if entry.split("::", 1)[0] in files
             and not any(base == entry or base.startswith(entry + "::") for base in bases)]
    if stale:
        raise pytest.UsageError(f"tests/conftest.py MUST_RUN names tests that do not exist: {stale}")
    rank = {name: index for index, name in enumerate(SLOW_FIRST)}  # SLOW_FIRST's files first, the rest as collected
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(SLOW_FIRST)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and in_ci() and must_run(item.nodeid):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} must not skip under CI=true (tests/conftest.py MUST_RUN), "
                           f"but skipped: {reason}")


@pytest.fixture
def single_rank_group():
    """A gloo process group of this process alone (the loop's collectives run; nothing to exchange with)."""
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    yield
    dist.destroy_process_group()
