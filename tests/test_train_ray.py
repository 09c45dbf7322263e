"""End-to-end training on a real local Ray cluster with real gloo process groups and a real `mlflow server`.

One Ray head node (`ray start --head`, dashboard for job submission) and one MLflow server (SQLite backend,
absolute artifact root) serve every test in this module. Runs are 2 CPU workers of raven-tiny on small
arithmetic-sequence shards (tests/test_train_data.py), 16 steps each.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from huginn_ray import storage
from isolation import LocalRayHead, MlflowServer, pids_of_head, private_namespace_problem
from ray_jobs import submit_job
from s3_server import s3_fixture
from test_train_data import make_dataset

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
STEPS = 16

pytestmark = pytest.mark.slow


def env() -> dict:
    return {
        **os.environ,
        "RAY_AUTH_MODE": "disabled",
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",
        "RAY_DISABLE_USAGE_STATS": "1",
        "PATH": f"{VENV_BIN}:{os.environ['PATH']}",  # `python` in a submitted job is the venv's
    }


# a real S3 server (moto) with a bucket `runs`; `cluster` starts after it, so the Ray head's workers find its
# endpoint and credentials in their environment, as a cloud node's processes find theirs
s3 = s3_fixture("runs")


@pytest.fixture(scope="module")
def cluster(s3):
    problem = private_namespace_problem()
    if problem:
        pytest.skip(f"starts a Ray head node that must stay private: {problem}")
    head = LocalRayHead(num_cpus=4, env=env())
    try:
        yield {"address": head.address, "dashboard": head.dashboard, "temp_dir": head.temp_dir}
    finally:
        head.stop()  # the processes this head started, by PID; never a machine-wide `ray stop`


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    server = MlflowServer(tmp_path_factory.mktemp("mlflow_server"), env=env()).start()
    try:
        yield server.uri
    finally:
        server.stop()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("data"), num_shards=2, rows_per_shard=200, seq_len=32)


def overrides(name, out_dir, dataset, mlflow_uri, *extra):
    data_dir, tokenizer = dataset
    return [
        f"run_name={name}", f"out_dir={out_dir}", f"data.data_dir={data_dir}", f"data.tokenizer_path={tokenizer}",
        f"mlflow.tracking_uri={mlflow_uri}", "block_size=32", "model.overrides.vocab_size=64",
        "micro_batch_size=2", f"max_steps={STEPS}", "log_step_interval=1", "eval_step_interval=8",
        "checkpoint.save_step_interval=4", "checkpoint.keep=2", "warmup_allreduce_mib=1", "optim.lr=3e-3",
        "schedule.warmup_steps=3", "schedule.cooldown_steps=0", "pg_timeout_s=60", *extra,
    ]


def run_train(cluster, args, timeout=300) -> subprocess.CompletedProcess:
    """jobs/train.py on the shared test cluster, whatever its exit status."""
    return subprocess.run(
        [sys.executable, str(REPO / "jobs" / "train.py"), "--config", str(REPO / "configs/train/tiny_cpu.yaml"), *args],
        env={**env(), "RAY_ADDRESS": cluster["address"]}, capture_output=True, text=True, timeout=timeout, cwd=REPO,
    )


def train(cluster, args, timeout=300) -> subprocess.CompletedProcess:
    run = run_train(cluster, args, timeout)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return run


def losses(mlflow_uri, run_id, key="loss") -> dict[int, float]:
    history = MlflowClient(mlflow_uri).get_metric_history(run_id, key)
    by_step: dict[int, set] = {}
    for m in history:
        by_step.setdefault(m.step, set()).add(m.value)
    # a step logged twice (re-run after a restart) must have logged the same value
    assert all(len(v) == 1 for v in by_step.values()), {s: v for s, v in by_step.items() if len(v) > 1}
    return {s: v.pop() for s, v in sorted(by_step.items())}


def times_logged(mlflow_uri, run_id, key="loss") -> dict[int, int]:
    counts: dict[int, int] = {}
    for m in MlflowClient(mlflow_uri).get_metric_history(run_id, key):
        counts[m.step] = counts.get(m.step, 0) + 1
    return counts


def run_id_of(stdout: str) -> str:
    line = next(l for l in stdout.splitlines() if "[huginn] MLflow:" in l)
    return line.rsplit("(run ", 1)[1].rstrip(")")


def final_data_position(out_dir: Path, name: str) -> tuple[int, int]:
    """(step, rows consumed per shard) of the run's newest checkpoint."""
    states = [json.loads((p / "trainer_state.json").read_text()) for p in (out_dir / name).glob("checkpoint_*")
              if (p / "trainer_state.json").is_file()]
    newest = max(states, key=lambda state: state["step"])
    return newest["step"], newest["rows_per_stream"]


@pytest.fixture(scope="module")
def uninterrupted(cluster, mlflow_server, dataset, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("runs")
    # profiled steps 2-3: the losses of every other run of this module are compared with these (bitwise)
    run = train(cluster, overrides("straight", out_dir, dataset, mlflow_server, "profile.steps=[2, 3]"))
    return {"out_dir": out_dir, "run_id": run_id_of(run.stdout), "stdout": run.stdout,
            "losses": losses(mlflow_server, run_id_of(run.stdout))}


def test_two_worker_run_loss_falls(uninterrupted, mlflow_server):
    loss = uninterrupted["losses"]
    assert sorted(loss) == list(range(1, STEPS + 1))
    first, last = sum(loss[s] for s in (1, 2, 3, 4)) / 4, sum(loss[s] for s in range(13, 17)) / 4
    assert last < first - 0.5, loss
    run = MlflowClient(mlflow_server).get_run(uninterrupted["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["optim.name"] == "ELLISAdam" and run.data.params["scaling.num_workers"] == "2"
    for key in ("lr", "grad_norm", "tokens_per_second", "mfu", "recurrence_n", "recurrence_k",
                "val_loss_1", "val_loss_64", "val_loss"):
        assert key in run.data.metrics, key
    assert any(k.startswith("telemetry/") for k in run.data.metrics)
    plots = [a.path for a in MlflowClient(mlflow_server).list_artifacts(uninterrupted["run_id"], "depth_scaling")]
    assert plots and all(p.startswith("depth_scaling/step_") and p.endswith(".png") for p in plots), plots
    assert "MLflow:" in uninterrupted["stdout"] and "mlflow ui" not in uninterrupted["stdout"]
    # seeing inside the run: per-phase time per step and module norms at every log step; the module norms are
    # global (replicated gradients counted once): their squares add up to the global gradient norm
    client = MlflowClient(mlflow_server)
    for phase in ("data", "forward", "backward", "comm", "optimizer", "validation", "checkpoint"):
        assert sorted(losses(mlflow_server, uninterrupted["run_id"], f"time/{phase}")) == list(range(1, STEPS + 1))
    assert run.data.metrics["time/forward"] > 0 and run.data.metrics["time/backward"] > 0
    assert losses(mlflow_server, uninterrupted["run_id"], "time/checkpoint")[5] > 0  # step 4's save, in 5's window
    grad_norms = losses(mlflow_server, uninterrupted["run_id"], "grad_norm")
    modules = {m: losses(mlflow_server, uninterrupted["run_id"], f"grad_norm/{m}")
               for m in ("embeddings", "prelude", "core", "coda")}
    for step in (2, STEPS):
        assert sum(m[step] ** 2 for m in modules.values()) == pytest.approx(grad_norms[step] ** 2, rel=1e-6)
    assert losses(mlflow_server, uninterrupted["run_id"], "update_norm/core")[STEPS] > 0
    assert "straggler/slowest_ratio" in run.data.metrics
    # the profiled steps: a trace per rank in the run directory, both logged (a shared file system here)
    profile_dir = uninterrupted["out_dir"] / "straight" / "profile"
    assert sorted(p.name for p in profile_dir.iterdir()) == ["rank0.trace.json", "rank1.trace.json"]
    for trace in profile_dir.iterdir():
        assert any(e.get("name", "").startswith("aten::") for e in json.loads(trace.read_text())["traceEvents"])
    assert sorted(a.path for a in client.list_artifacts(uninterrupted["run_id"], "profile")) == [
        "profile/rank0.trace.json", "profile/rank1.trace.json"]
    # saved at steps 4, 8, 12, 16; checkpoint.keep=2 keeps the newest two
    kept = sorted(json.loads(p.read_text())["step"]
                  for p in (uninterrupted["out_dir"] / "straight").glob("checkpoint_*/trainer_state.json"))
    assert kept == [12, 16]


def test_sigterm_to_the_job_s_process_group_then_resumes_with_the_same_losses_and_fails_on_truncated_checkpoints(
        cluster, mlflow_server, dataset, uninterrupted):
    """A job that starts its own Ray gets SIGTERM on its whole process group (driver and everything it started
    there, as from a scheduler ending the job step) as training starts: step 1 is saved and the job stops. The
    rerun resumes to the end; every loss equals the uninterrupted run's, bitwise. Last, with every checkpoint
    truncated, the run fails once, naming them. (The fall back past an incomplete checkpoint runs end to end in
    the bucket test below; locally in tests/test_train_checkpoint_files.py.)"""
    out_dir = uninterrupted["out_dir"]
    driver = subprocess.Popen(
        [sys.executable, str(REPO / "jobs" / "train.py"), "--config", str(REPO / "configs/train/tiny_cpu.yaml"),
         *overrides("resumed", out_dir, dataset, mlflow_server)],
        env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, start_new_session=True,
    )
    lines = []
    for line in driver.stdout:
        lines.append(line)
        if line.startswith("[huginn] training resumed:"):  # the driver's SIGTERM handler is in place
            os.killpg(driver.pid, signal.SIGTERM)
            break
    stopped = "".join(lines) + driver.communicate(timeout=240)[0]
    assert driver.returncode == 0, stopped[-5000:]
    assert "[huginn] stopped on request at step 1; rerun to resume" in stopped, stopped[-3000:]
    saved = [json.loads(p.read_text())["step"] for p in (out_dir / "resumed").glob("checkpoint_*/trainer_state.json")]
    assert saved == [1]  # the SIGTERM's checkpoint: no interval checkpoint was due
    assert not (out_dir / "resumed" / "STOP").exists() and not (out_dir / "resumed" / "LOCK").exists()
    assert MlflowClient(mlflow_server).get_run(run_id_of(stopped)).info.status == "KILLED"  # resumable
    ray_dir = next(l for l in stopped.splitlines() if "Ray's own INFO/WARNING lines go to" in l).split(" go to ")[1]
    assert pids_of_head(ray_dir.split("/session_latest")[0]) == []  # the job stopped the Ray it started

    last = train(cluster, overrides("resumed", out_dir, dataset, mlflow_server))
    resumed_line = rf"\[huginn\] resumed from {re.escape(str(out_dir / 'resumed'))}/checkpoint_\S+ at step 1$"
    assert re.search(resumed_line, last.stdout + last.stderr, re.M), last.stdout[-3000:]
    run_id = run_id_of(last.stdout)
    assert run_id_of(stopped) == run_id
    assert times_logged(mlflow_server, run_id) == {s: 1 for s in range(1, STEPS + 1)}
    assert losses(mlflow_server, run_id) == uninterrupted["losses"]  # bitwise: fp32 on CPU, one thread, RNG states
    assert final_data_position(out_dir, "resumed") == final_data_position(out_dir, "straight") == (STEPS, 2 * STEPS)

    # no checkpoint that loads: one attempt that names every checkpoint tried, not max_failures retries of it
    kept = [p.parent for p in sorted((out_dir / "resumed").glob("checkpoint_*/trainer_state.json"),
                                     key=lambda p: json.loads(p.read_text())["step"])]
    for checkpoint in kept:
        weights = checkpoint / "state" / "__0_0.distcp"
        weights.write_bytes(weights.read_bytes()[:100])
    failed = run_train(cluster, overrides("resumed", out_dir, dataset, mlflow_server))
    console = failed.stdout + failed.stderr
    assert failed.returncode == 1, console[-4000:]
    assert f"cannot resume: no checkpoint of {out_dir / 'resumed'} can be resumed from; tried, newest first: " \
        f"{kept[1]} (" in console, console[-4000:]
    assert [console.count(f"[huginn] skipping checkpoint {c} (") for c in kept] == [1, 1]  # tiny_cpu: max_failures=2
    assert MlflowClient(mlflow_server).get_run(run_id).info.status == "FAILED"


def test_a_run_in_a_bucket_stopped_and_rerun_past_a_deleted_object_logs_the_local_losses(
        cluster, mlflow_server, dataset, uninterrupted):
    """Shards, tokenizer and out_dir in the S3 bucket (the moto server; the driver and Ray's workers have only
    AWS_ENDPOINT_URL and credentials), MLflow at its server: a run to step 12, one object of its newest
    checkpoint deleted, and the rerun to the end. The rerun skips that checkpoint naming the object, resumes from
    step 8's by ranged reads, and every loss equals the local run's, bitwise. Nothing lands on a local disk but
    Ray's session directory and scratch."""
    data_dir, tokenizer = dataset
    storage.upload_dir(data_dir, "s3://runs/data/shards", last="manifest.json")
    storage.upload_dir(tokenizer, "s3://runs/data/tokenizer")
    in_bucket = ("s3://runs/data/shards", "s3://runs/data/tokenizer")
    run_dir = "s3://runs/out/bucket"
    first = train(cluster, overrides("bucket", "s3://runs/out", in_bucket, mlflow_server, "max_steps=12",
                                     "profile.steps=[2, 3]"))
    checkpoints = {json.loads(storage.read_text(p))["step"]: p.rsplit("/", 1)[0]
                   for p in storage.list_prefix(run_dir) if p.endswith("/trainer_state.json")}
    assert sorted(checkpoints) == [8, 12] and all(c.startswith(f"{run_dir}/checkpoint_") for c in checkpoints.values())
    assert sorted(storage.list_prefix(f"{run_dir}/profile")) == [f"{run_dir}/profile/rank0.trace.json",
                                                                 f"{run_dir}/profile/rank1.trace.json"]
    storage.delete(f"{checkpoints[12]}/state/__0_0.distcp")
    last = train(cluster, overrides("bucket", "s3://runs/out", in_bucket, mlflow_server))
    console = last.stdout + last.stderr
    assert f"[huginn] skipping checkpoint {checkpoints[12]} (state/__0_0.distcp is missing (" in console, console[-4000:]
    assert f"[huginn] resumed from {checkpoints[8]} at step 8" in console, console[-4000:]
    run_id = run_id_of(last.stdout)
    assert run_id_of(first.stdout) == run_id
    assert times_logged(mlflow_server, run_id) == {s: 2 if 9 <= s <= 12 else 1 for s in range(1, STEPS + 1)}
    assert losses(mlflow_server, run_id) == uninterrupted["losses"]  # bitwise
    assert not storage.exists(f"{run_dir}/LOCK")
    # the paths a POSIX-only layer would have made of the URIs (`Path("s3://runs").resolve()`): none, neither
    # in the driver's working directory nor in the workers' (Ray's session directory)
    assert not (REPO / "s3:").exists()
    assert [p for p in Path(cluster["temp_dir"]).rglob("s3:*")] == []


def test_killed_worker_is_restarted_from_checkpoint_with_the_same_final_loss(
        cluster, mlflow_server, dataset, uninterrupted):
    out_dir = uninterrupted["out_dir"]
    train(cluster, overrides("killed", out_dir, dataset, mlflow_server,
                             "fault_injection.kill_rank_at_step=10", "fault_injection.kill_rank=1"))
    assert (out_dir / "killed" / "fault_injected_rank1_step10").exists()
    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("huginn_ray")
    runs = client.search_runs([experiment.experiment_id], filter_string="attributes.run_name = 'killed'")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    # the steps after the checkpoint the restart resumed from (step 8, or step 4 if Ray had not registered the
    # step-8 report when the worker died) up to step 10 ran twice; the run did not start over. The killed attempt's
    # last metrics may still be in rank 0's sender queue when Ray ends the group (MLflow logging is asynchronous),
    # so of the replayed steps a last few (step 10, and on a loaded machine step 9 too) may be logged once.
    counts = times_logged(mlflow_server, runs[0].info.run_id)
    resumed_at = min(s for s, n in counts.items() if n == 2) - 1
    assert resumed_at in (4, 8)
    assert {s: n for s, n in counts.items() if not resumed_at < s <= 10} == \
        {s: 1 for s in range(1, STEPS + 1) if not resumed_at < s <= 10}
    replayed = [counts[s] for s in range(resumed_at + 1, 11)]
    assert replayed == sorted(replayed, reverse=True) and set(replayed) <= {1, 2}, counts  # 2, ..., 2, then 1s
    killed = losses(mlflow_server, runs[0].info.run_id)
    assert killed[STEPS] == uninterrupted["losses"][STEPS]
    assert killed == uninterrupted["losses"]


def test_hsdp_run_stopped_rerun_and_killed_resumes_exactly(cluster, mlflow_server, dataset, uninterrupted):
    """parallelism.mode=hsdp over Ray Train's node (local world size 2: one shard group of 2), checkpoints written
    in the background: stop at step 7 and rerun; the rerun loses a worker after step 10 and Ray restarts it from
    the step-8 checkpoint (or step 4's, if the step-8 save was still in flight)."""
    out_dir = uninterrupted["out_dir"]
    hsdp = ("parallelism.mode=hsdp", "checkpoint.async_save=true")
    first = train(cluster, overrides("hsdp", out_dir, dataset, mlflow_server, "max_steps=7", *hsdp))
    assert "resumed from" not in first.stdout
    checkpoints = [p for p in (out_dir / "hsdp").glob("checkpoint_*") if p.is_dir()]
    assert len(checkpoints) == 2  # steps 4 (written in the background, reported at 7) and 7
    for checkpoint in checkpoints:  # every rank wrote its own shards
        assert sorted(p.name for p in (checkpoint / "state").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
        assert json.loads((checkpoint / "trainer_state.json").read_text())["layout"] == "hsdp, shard_size 2"
    second = train(cluster, overrides("hsdp", out_dir, dataset, mlflow_server, *hsdp,
                                      "fault_injection.kill_rank_at_step=10", "fault_injection.kill_rank=1"))
    assert (out_dir / "hsdp" / "fault_injected_rank1_step10").exists()
    run_id = run_id_of(second.stdout)
    assert run_id_of(first.stdout) == run_id
    counts = times_logged(mlflow_server, run_id)
    # resumed at 7, steps 8-10 replayed after the kill (the killed attempt's step 10 may die in its sender queue)
    assert all(counts[s] == 1 for s in range(1, 8)) and counts[8] == counts[9] == 2 and counts[10] in (1, 2)
    assert "the previous complete checkpoint stays the newest" not in second.stdout
    got = losses(mlflow_server, run_id)  # a replayed step must log bitwise the same loss
    expected = uninterrupted["losses"]
    assert sorted(got) == sorted(expected)
    for step, value in expected.items():  # the replicated run's losses up to summation order
        assert got[step] == pytest.approx(value, rel=1e-5), step


def test_ray_job_submit_runs_training_and_metrics_reach_mlflow(cluster, mlflow_server, dataset, tmp_path):
    # world_batch_size 8 = micro-batch 2 x 2 workers x 2 accumulation steps: the accumulation path of the loop
    args = overrides("submitted", tmp_path, dataset, mlflow_server, "max_steps=4", "eval_step_interval=4",
                     "world_batch_size=8")
    job = submit_job(
        [str(VENV_BIN / "ray"), "job", "submit", "--address", cluster["dashboard"], "--working-dir", str(REPO),
         "--", "python", "jobs/train.py", "--config", "configs/train/tiny_cpu.yaml", *args],
        env=env(), timeout=300, cwd=REPO,
    )
    assert job.returncode == 0, job.stdout[-4000:] + job.stderr[-4000:]
    assert "succeeded" in job.stdout.lower()
    run_id = run_id_of(job.stdout)
    assert sorted(losses(mlflow_server, run_id)) == [1, 2, 3, 4]
    metrics = MlflowClient(mlflow_server).get_run(run_id).data.metrics
    assert "val_loss" in metrics
    assert metrics["total_tokens"] == 4 * 8 * 32  # 4 steps of 8 sequences of 32 tokens


def test_non_finite_loss_stops_the_run_with_a_clear_message(cluster, mlflow_server, dataset, tmp_path):
    args = overrides("diverged", tmp_path, dataset, mlflow_server, "optim.name=AdamW", "optim.lr=1e30",
                     "schedule.warmup_steps=0", "grad_clip=1e30")
    run = run_train(cluster, args)
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    assert "non-finite loss" in run.stdout and "stopping (on_nonfinite=stop)" in run.stdout
    run_id = run_id_of(run.stdout)
    assert MlflowClient(mlflow_server).get_run(run_id).info.status == "FAILED"


def running(pid: int) -> bool:
    """The process exists and has not exited (a zombie has exited)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def test_a_hung_rank_makes_the_next_collective_time_out_and_every_rank_exit(cluster, mlflow_server, dataset, tmp_path):
    """Rank 1 stops answering after step 2. Rank 0's gradient all-reduce of step 3 raises after pg_timeout_s
    (launch.py passes it to Ray's TorchConfig, and gloo honours it on CPU); with max_failures=0 Ray Train ends
    the worker group, the hung rank included, and the driver exits non-zero naming the timeout. Before that, at
    half the timeout, the hang watch dumps both ranks' flight recorders and names rank 1 (hang_watch.py)."""
    timeout_s, bound_s = 10, 90  # the bound leaves room for a loaded 2-core machine; no lower bound is asserted
    args = overrides("hung", tmp_path, dataset, mlflow_server, "max_steps=4", f"pg_timeout_s={timeout_s}",
                     "max_failures=0", "fault_injection.hang_rank_at_step=2", "fault_injection.hang_rank=1")
    run = run_train(cluster, args)
    driver_exited = time.time()
    output = run.stdout + run.stderr
    marker = tmp_path / "hung" / "fault_injected_rank1_step2"  # written by rank 1 as it starts to hang
    assert marker.is_file(), output[-4000:]
    hung_at = marker.stat().st_mtime
    assert run.returncode != 0, output[-4000:]
    assert "[huginn] step 2/4" in run.stdout and "[huginn] step 3/4" not in run.stdout
    # the project's timeout (not Ray's default of 1800 s) ended rank 0's all-reduce, and the driver says so
    assert "Training failed due to worker errors" in run.stderr, output[-4000:]
    assert re.search(rf"timed out waiting {timeout_s * 1000} ?ms", run.stderr, re.IGNORECASE), output[-4000:]
    # after Ray's report, one line of the project's own names the failed rank and the cause
    assert re.search(rf"^\[huginn\] training failed, rank 0: \S+: .*timed out waiting {timeout_s * 1000} ?ms",
                     run.stdout, re.M | re.IGNORECASE), output[-4000:]
    assert driver_exited - hung_at < bound_s, (driver_exited - hung_at, output[-4000:])
    # at half the timeout both ranks dumped their flight recorder and rank 0 named the rank that did not arrive
    watch = re.findall(r"\[huginn\] hang watch: .*", run.stdout)
    assert len(watch) == 1 and re.match(r"\[huginn\] hang watch: rank 0 has waited \d+\.\d s in gloo:all_reduce #\d+ "
                                        rf"of process group 0 \(ranks \[0, 1\], pg_timeout_s={timeout_s}\); did not "
                                        r"arrive: rank 1 \(node .*\); did not answer: none;", watch[0]), watch
    dumps = tmp_path / "hung" / "flight_recorder"
    assert sorted(p.name for p in dumps.iterdir()) == ["rank_0", "rank_1"]
    workers = {int(pid) for pid in re.findall(r"RayTrainWorker pid=(\d+)", output)}
    assert len(workers) == 2 and int(marker.read_text().split("pid ")[1]) in workers, (workers, marker.read_text())
    while any(running(pid) for pid in workers) and time.time() < hung_at + bound_s:
        time.sleep(0.2)
    assert not any(running(pid) for pid in workers), f"workers still running {bound_s} s after the hang: {workers}"
    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("huginn_ray")
    runs = client.search_runs([experiment.experiment_id], filter_string="attributes.run_name = 'hung'")
    assert len(runs) == 1 and runs[0].info.status == "FAILED"
