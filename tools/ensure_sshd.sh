#!/usr/bin/env bash
# Best effort: make sure an OpenSSH server binary exists for tests/test_cluster_launcher.py, which brings a
# cluster up with `ray up` over ssh to 127.0.0.1. Runs outside the test namespace (that one has no network).
# Never fails the build: without root or apt the launcher test is skipped and says why.
if command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ]; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure_sshd.sh: sshd missing and cannot install it (needs root and apt-get); the ray up test will be skipped" >&2
    exit 0
fi
echo "ensure_sshd.sh: installing openssh-server for the ray up test" >&2
{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends openssh-server; } >&2 \
    || echo "ensure_sshd.sh: openssh-server install failed; the ray up test will be skipped" >&2
exit 0
