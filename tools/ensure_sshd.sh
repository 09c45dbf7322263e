#!/usr/bin/env bash
# Best effort: make sure sshd and rsync exist for tests/test_cluster_launcher.py, which brings a cluster up with
# `ray up` over ssh to 127.0.0.1 (the launcher copies files with rsync). Runs before the tests, outside their
# namespace, which has no network. Never fails the build: without them the launcher test is skipped and says why.
missing=()
command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ] || missing+=(openssh-server)
command -v rsync >/dev/null 2>&1 || missing+=(rsync)
[ "${#missing[@]}" -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure_sshd.sh: ${missing[*]} missing and not installable here (needs root and apt-get); the ray up test will be skipped" >&2
    exit 0
fi
echo "ensure_sshd.sh: installing ${missing[*]} for the ray up test" >&2
{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"; } >&2 \
    || echo "ensure_sshd.sh: installing ${missing[*]} failed; the ray up test will be skipped" >&2
exit 0
