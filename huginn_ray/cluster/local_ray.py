"""A private local Ray for a job started without a cluster (`python jobs/train.py ...`, `jobs/prepare_data.py`).

Ray's GCS and raylet listen on every interface of the machine, whatever --node-ip-address says, and anyone who
reaches an unauthenticated Ray can run code in it. So a Ray that a job starts itself always runs with token
authentication: a fresh random token per job, handed to Ray's processes through the environment only (nothing
written to ~/.ray). An explicit RAY_AUTH_TOKEN in the environment is used instead of a fresh one.
"""

from __future__ import annotations

import os
import secrets


def require_token_auth() -> None:
    """Turn on Ray token authentication for the Ray this process is about to start (and its workers)."""
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
    # Ray caches its config (the auth mode among it) when it is imported; re-read it, as Ray's own
    # enable-token-auth helper does (ray._private.authentication.authentication_token_setup).
    from ray._raylet import Config

    Config.initialize("")


def init_local_ray(*, verbose: bool = False, dashboard: bool = False, **ray_init_kwargs):
    """ray.init of a new local instance with token authentication on and the console settings of
    huginn_ray.console (Ray's own lines to its log files unless `verbose`); `dashboard` for jobs whose Ray Train
    controller queries the state API. Other keyword arguments go to ray.init. Returns ray.init's result."""
    import ray

    from huginn_ray.console import local_ray_init_kwargs, quiet_local_ray

    quiet_local_ray(verbose)  # the workers of this local Ray inherit the settings
    require_token_auth()
    return ray.init(address="local", **{**local_ray_init_kwargs(verbose, dashboard), **ray_init_kwargs})
