"""`ray job submit` for tests, tolerant of a head node whose job agent is still starting.

Right after `ray start --head` the dashboard answers before its job agent has registered, and a submission
then fails with "No available agent to submit job" without running anything; such a submission is retried.
"""

import subprocess
import time

AGENT_NOT_READY = "No available agent to submit job"


def submit_job(command: list[str], attempts: int = 10, **run_kwargs) -> subprocess.CompletedProcess:
    for attempt in range(attempts):
        job = subprocess.run(command, capture_output=True, text=True, **run_kwargs)
        if job.returncode == 0 or AGENT_NOT_READY not in job.stdout + job.stderr or attempt == attempts - 1:
            return job
        time.sleep(3)
