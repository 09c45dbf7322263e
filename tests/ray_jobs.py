"""`ray job submit` for tests, tolerant of a head node whose job agent is still starting.

Right after `ray start --head` the dashboard answers before its job agent has registered, and a submission
then fails with "No available agent to submit job" without running anything; such a submission is retried.
"""

import subprocess
import time

AGENT_NOT_READY = "No available agent to submit job"


def submit_job(command: list[str], agent_wait_s: float = 180, **run_kwargs) -> subprocess.CompletedProcess:
    """Run `command` (a `ray job submit`), again every 3 s while the head's job agent is not ready, for at most
    `agent_wait_s` (an agent can take a minute to register on a loaded 2-core machine)."""
    deadline = time.monotonic() + agent_wait_s
    while True:
        job = subprocess.run(command, capture_output=True, text=True, **run_kwargs)
        if job.returncode == 0 or AGENT_NOT_READY not in job.stdout + job.stderr or time.monotonic() > deadline:
            return job
        time.sleep(3)
