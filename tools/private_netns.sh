#!/usr/bin/env bash
# Run a command inside a private network and PID namespace, with only loopback up.
#
# Why: Ray binds its ports to every interface and ignores --node-ip-address=127.0.0.1. Inside this namespace
# the test suite's Ray clusters, MLflow server, Hub server and sshd are reachable only on loopback, and every
# process they leave behind dies with the namespace (its PID 1 is the bash below).
#
# As root: `unshare -n -p -f --mount-proc`. As any other user: the same inside a user namespace of its own
# (`--user --map-root-user`), which most kernels allow; the command then runs as uid 0 of that namespace,
# with no privilege outside it. The tests recognise the namespace by HUGINN_PRIVATE_NS (the inode names of the
# network and PID namespaces, written here), not by guessing. Where no namespace can be made, the command runs
# as is with HUGINN_PRIVATE_NS_UNAVAILABLE set to the reason: the tests that need the namespace skip with that
# reason, and under CI=true such a skip fails the run (tests/conftest.py).
set -euo pipefail
missing=()
for tool in unshare ip; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
reason=""
if [ "${#missing[@]}" -gt 0 ]; then
    reason="missing tool(s): ${missing[*]} (unshare: util-linux; ip: iproute2)"
else
    flags=(-n -p -f --mount-proc)
    if [ "$(id -u)" != 0 ]; then
        flags=(--user --map-root-user "${flags[@]}")
        # inside, the user is "root": keep pytest off /tmp/pytest-of-root, which the real root may own
        if [ -z "${PYTEST_DEBUG_TEMPROOT:-}" ]; then
            export PYTEST_DEBUG_TEMPROOT="${TMPDIR:-/tmp}/huginn-tests-$(id -u)"
            mkdir -p -m 700 "$PYTEST_DEBUG_TEMPROOT"
        fi
    fi
    if probe=$(unshare "${flags[@]}" ip link set lo up 2>&1); then
        # shellcheck disable=SC2016
        # PID 1 of a namespace ignores signals it has no handler for, so a command exec'd as PID 1 would outlive
        # `timeout` (which signals the process group): this bash stays PID 1 and passes a SIGTERM on
        exec unshare "${flags[@]}" bash -c \
            'ip link set lo up && export HUGINN_PRIVATE_NS="$(readlink /proc/self/ns/net) $(readlink /proc/self/ns/pid)" || exit
             "$@" <&0 & command_pid=$!
             trap "kill -TERM $command_pid" TERM
             until wait "$command_pid"; status=$?; ! kill -0 "$command_pid" 2>/dev/null; do :; done
             exit "$status"' \
            private_netns "$@"
    fi
    reason="unshare ${flags[*]} is not allowed here: ${probe:-no message}"
fi
echo "private_netns.sh: $reason; running without a private network namespace" >&2
export HUGINN_PRIVATE_NS_UNAVAILABLE="$reason"
exec "$@"
