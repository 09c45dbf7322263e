"""tools/private_netns.sh names a missing tool instead of failing with a bare status 127, and says why the tests
that need the namespace will skip."""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "private_netns.sh"


def path_with(tmp_path, tools):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "env", "id", "mkdir", "readlink", "printenv", *tools):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    return str(bin_dir)


@pytest.mark.parametrize("present, missing", [((), "unshare ip"), (("unshare",), "ip"), (("ip",), "unshare")])
def test_missing_tools_are_named_and_the_command_still_runs(tmp_path, present, missing):
    if any(shutil.which(t) is None for t in present):
        pytest.skip(f"{present} not installed here")
    run = subprocess.run([str(SCRIPT), "printenv", "HUGINN_PRIVATE_NS_UNAVAILABLE"], capture_output=True, text=True,
                         env={**os.environ, "PATH": path_with(tmp_path, present)}, timeout=60)
    assert run.returncode == 0, run.stderr
    assert f"missing tool(s): {missing}" in run.stderr and f"missing tool(s): {missing}" in run.stdout


def test_inside_the_namespace_the_marker_names_its_namespaces():
    run = subprocess.run([str(SCRIPT), "bash", "-c", 'echo "$HUGINN_PRIVATE_NS|$(readlink /proc/self/ns/net) '
                          '$(readlink /proc/self/ns/pid)|${HUGINN_PRIVATE_NS_UNAVAILABLE:-}"'],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    marker, here, unavailable = run.stdout.strip().split("|")
    if unavailable:
        pytest.skip(f"no namespace here: {unavailable}")
    assert marker == here and marker != f"{os.readlink('/proc/self/ns/net')} {os.readlink('/proc/self/ns/pid')}"


def test_a_sigterm_to_the_process_group_ends_the_command_inside():
    # as `timeout` signals it: the namespace's PID 1 ignores signals it has no handler for, so a command that were
    # PID 1 would run on (a hung test run, say); the script's bash stays PID 1 and the command gets the signal
    command = [str(SCRIPT), sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(600)"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        assert process.stdout.readline() == "ready\n"
        os.killpg(process.pid, signal.SIGTERM)
        assert process.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        process.kill()
