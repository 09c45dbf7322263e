"""Wait until a Ray cluster started by hand (cluster_yamls/frontier.sbatch) has all its nodes."""

import socket
import time


class ClusterWaitTimeout(TimeoutError):
    """The cluster did not reach the expected size in time; the message says how far it got."""


def wait_for_nodes(address: str, count: int, timeout_s: float, poll_s: float = 2.0) -> int:
    """Block until `count` Ray nodes are alive at `address` (host:port of the GCS); returns the number alive."""
    import ray

    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    # Connecting a driver to a GCS that is not up yet blocks for a long time: wait for the port first.
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=poll_s).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise ClusterWaitTimeout(f"no Ray GCS listening at {address} after {timeout_s:.0f} s") from None
            time.sleep(poll_s)
    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:
        while True:
            alive = sum(1 for node in ray.nodes() if node["Alive"])
            if alive >= count:
                return alive
            if time.monotonic() > deadline:
                raise ClusterWaitTimeout(f"{alive} of {count} Ray nodes alive at {address} after {timeout_s:.0f} s")
            time.sleep(poll_s)
    finally:
        ray.shutdown()
