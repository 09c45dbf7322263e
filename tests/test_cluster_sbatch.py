"""cluster_yamls/frontier.sbatch runs end to end on one node with Slurm and Lmod stood in for.

Stand-ins (this machine has neither Slurm nor Lmod): `srun` runs its command right here (dropping its options),
`scontrol show hostnames` names this host, `squeue -o %e` gives a fixed end time, `module` records what it is
asked to load, ROCR_VISIBLE_DEVICES is set the way Slurm sets it for GPU steps on AMD nodes, and the job itself
sends the batch shell the SIGTERM that `--signal=B:TERM@600` makes Slurm send ahead of the time limit. Everything else is real: the script's env file, `ray start`
for the head, the MLflow server, the wait for nodes and `ray job submit`. It all runs in a network+PID namespace of
its own; when the batch script ends, the namespace (and so the "allocation") ends with it.
"""

import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from isolation import nested_namespace

REPO = Path(__file__).resolve().parents[1]
VENV = Path(sys.executable).parent.parent

pytestmark = pytest.mark.slow

JOB = """
import os, signal, time, ray
ray.init()
names = ('NCCL_SOCKET_IFNAME', 'HIP_VISIBLE_DEVICES', 'RAY_AUTH_MODE', 'HUGINN_JOB_END_TIME', 'HUGINN_STOP_FILE')
print('SBATCH-JOB', *ray.get(ray.remote(lambda: [os.environ[n] for n in names]).remote()))
# Slurm's signal ahead of the limit goes to the batch shell only; its trap must create the stop file and keep
# waiting for this job
os.kill(int(open(os.environ['SBATCH_PID_FILE']).read()), signal.SIGTERM)
stop, deadline = os.environ['HUGINN_STOP_FILE'], time.time() + 60
while not os.path.exists(stop) and time.time() < deadline:
    time.sleep(0.2)
print('SBATCH-STOP-FILE', os.path.exists(stop))
"""


def test_frontier_sbatch_brings_up_the_cluster_and_submits_the_job():
    unshare, problem = nested_namespace()
    if problem:
        pytest.skip(f"the cluster needs a network+PID namespace of its own: {problem}")
    work = Path(f"/tmp/hrs_{secrets.token_hex(4)}")  # short: Ray's socket paths live below it
    try:
        submit, stubs = work / "submit", work / "bin"
        (submit / "cluster_yamls").mkdir(parents=True)
        stubs.mkdir()
        shutil.copy(REPO / "cluster_yamls" / "frontier_env.sh", submit / "cluster_yamls")
        token = work / "auth_token"
        token.write_text(secrets.token_hex(32))
        (submit / "cluster_yamls" / "site.env").write_text(
            f"export HUGINN_SHARED_DIR={work}/shared\nexport HUGINN_VENV={VENV}\n"
            f"export HUGINN_NODE_LOCAL_DIR={work}/node\nexport HUGINN_RCCL_PLUGIN_DIR={work}/aws-ofi-rccl\n"
            f"export RAY_AUTH_TOKEN_PATH={token}\n"
        )
        (stubs / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == -* ]]; do shift; done\nexec "$@"\n')
        (stubs / "scontrol").write_text('#!/bin/bash\n[ "$1 $2" = "show hostnames" ] && echo localhost\n')
        (stubs / "squeue").write_text('#!/bin/bash\n[ "$*" = "-h -j 4242 -o %e" ] && echo 2030-01-01T00:00:00\n')
        for stub in stubs.iterdir():
            stub.chmod(0o755)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "OMP_", "NCCL_", "SLURM_"))}
        env.update(
            PATH=f"{stubs}:{VENV / 'bin'}:{env['PATH']}",
            SLURM_SUBMIT_DIR=str(submit), SLURM_JOB_NODELIST="localhost", SLURM_JOB_ID="4242",
            ROCR_VISIBLE_DEVICES="0,1", SBATCH_PID_FILE=str(work / "sbatch.pid"), TZ="UTC",
        )
        script = (
            f'ip link set lo up && module() {{ echo "$@" >> {work}/modules; }} && export -f module && '
            f'echo $$ > {work}/sbatch.pid && exec bash {REPO}/cluster_yamls/frontier.sbatch python -c "$0"'
        )
        run = subprocess.run(
            [*unshare, "bash", "-c", script, JOB],
            capture_output=True, text=True, env=env, cwd=submit, timeout=240,
        )
        output = run.stdout + run.stderr
        assert run.returncode == 0, output[-5000:]
        # The job ran on the cluster, in the env file's environment; Slurm's ROCR_VISIBLE_DEVICES became
        # HIP_VISIBLE_DEVICES, which Ray accepts.
        # squeue's end time and the stop file reach the workers
        assert f"SBATCH-JOB hsn 0,1 token 1893456000 {work}/shared/stop/4242" in output, output[-5000:]
        # the trap created the stop file, and the script waited for the job instead of exiting on the signal
        assert "asking the job to save a checkpoint and stop" in output
        assert "SBATCH-STOP-FILE True" in output, output[-5000:]
        assert (work / "shared" / "logs" / "mlflow_server.log").exists()
        assert (work / "node" / "ray").is_dir()
    finally:
        shutil.rmtree(work, ignore_errors=True)
