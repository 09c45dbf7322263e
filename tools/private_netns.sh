#!/usr/bin/env bash
# Run a command inside a private network and PID namespace, with only loopback up.
#
# Why: Ray binds its ports to every interface and ignores --node-ip-address=127.0.0.1, and `ray stop`
# kills Ray processes machine-wide by name. Inside this namespace the test suite's Ray clusters, MLflow
# server, Hub server and sshd are reachable only on loopback, and every process they leave behind dies
# with the namespace. Needs root (CI and the dev containers run as root); otherwise runs the command as is.
set -euo pipefail
if [ "$(id -u)" = 0 ] && command -v unshare >/dev/null && unshare -n -p -f --mount-proc true 2>/dev/null; then
    exec unshare -n -p -f --mount-proc bash -c 'ip link set lo up && "$@"' private_netns "$@"
fi
echo "private_netns.sh: not root or no unshare; running without a private network namespace" >&2
exec "$@"
