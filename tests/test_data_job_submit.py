"""prepare_data under `ray job submit` on a running (single-node, loopback-only) Ray cluster."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from huginn_ray.data.shards import read_manifest
from huginn_ray.data.tokenizer import train_tokenizer
from isolation import LocalRayHead, private_namespace_problem
from ray_jobs import submit_job

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@pytest.mark.slow
def test_prepare_data_under_ray_job_submit(tmp_path):
    problem = private_namespace_problem()
    if problem:
        pytest.skip(f"starts a Ray head node that must stay private: {problem}")
    (tmp_path / "docs").mkdir()
    texts = [f"document {i}: " + " ".join(f"word{j % 17}" for j in range(40 + 13 * i)) for i in range(60)]
    for i, text in enumerate(texts):
        (tmp_path / "docs" / f"d{i:02d}.txt").write_text(text)
    train_tokenizer(texts, 2048, tmp_path / "tokenizer", use_manual_tokens=False)
    (tmp_path / "sources.yaml").write_text(f"- {{name: docs, local_dir: {tmp_path / 'docs'}, features: [text]}}\n")
    (tmp_path / "data.yaml").write_text(f"sources: {tmp_path / 'sources.yaml'}\nseq_len: 32\nnum_shards: 2\n"
                                        "val_fraction: 0.3\n")
    out = tmp_path / "out"

    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PATH": f"{BIN}:{os.environ['PATH']}"}
    head = LocalRayHead(num_cpus=2, env=env)
    try:
        job = submit_job(
            [str(BIN / "ray"), "job", "submit", "--address", head.dashboard, "--working-dir",
             str(ROOT), "--", "python", "jobs/prepare_data.py", "--config", str(tmp_path / "data.yaml"),
             f"output_dir={out}", f"tokenizer.path={tmp_path / 'tokenizer'}"],
            env=env, timeout=300)
        assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
        assert "prepare_data: 2 train + 2 val shards" in job.stdout
    finally:
        head.stop()  # only the processes this head started, by PID
    manifest = read_manifest(out / "shards")
    assert manifest["num_shards"] == 2 and manifest["rows_per_shard"]["train"] > 0
    assert sorted(p.name for p in (out / "shards" / "train").glob("*.parquet")) == ["00000.parquet", "00001.parquet"]
