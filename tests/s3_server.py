"""A real S3 server for the tests: moto in server mode on a free loopback port, with the environment a test (and
every process it starts) needs to reach it the way AWS's own tools do.

    s3 = s3_fixture("runs")     # a test module's fixture `s3`: the server with bucket `runs`, AWS_ENDPOINT_URL and
                                # credentials set for the module and restored after

moto's server honours `If-None-Match: *` and `If-Match` on PutObject (412 PreconditionFailed), which
huginn_ray.storage's conditional writes use. The server runs in a session of its own and is stopped by its PID.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest

from isolation import free_port, stop_session, wait_for

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


class S3Server:
    def __init__(self):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.env = {"AWS_ENDPOINT_URL": self.endpoint, **CREDENTIALS}
        self.process = None
        self._saved: dict[str, str | None] = {}

    def __enter__(self) -> "S3Server":
        self.log = tempfile.TemporaryFile()
        self.process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                        stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for(f"{self.endpoint}/moto-api/", 60, alive=lambda: self.process.poll() is None)
        except BaseException:
            self.stop()
            raise
        for key in (*self.env, "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):  # nothing of the developer's own AWS setup
            self._saved[key] = os.environ.pop(key, None)
        os.environ.update(self.env)
        return self

    def __exit__(self, *exc) -> None:
        for key, value in self._saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self.stop()

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
                            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"])

    def create_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return f"s3://{name}"

    def stop(self) -> None:
        if self.process is None:
            return
        stop_session(self.process, timeout_s=30)
        self.process = None
        self.log.close()


def s3_fixture(*buckets: str):
    """A module-scoped pytest fixture: a running S3Server holding these (empty) buckets."""
    @pytest.fixture(scope="module")
    def s3():
        with S3Server() as server:
            for bucket in buckets:
                server.create_bucket(bucket)
            yield server
    return s3
