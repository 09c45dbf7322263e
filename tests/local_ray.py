"""A local Ray for one test module: started in the private network namespace the suite runs in, shut down and its
temp directory removed at the module's end; a Ray already running in the process (another module's) is shared."""

import contextlib
import os
import shutil
import tempfile


@contextlib.contextmanager
def module_ray(prefix: str, object_store_mib: int = 256):
    import ray
    import ray.data

    if ray.is_initialized():
        yield
        return
    os.environ["RAY_AUTH_MODE"] = "disabled"
    temp_dir = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    ray.init(address="local", num_cpus=2, object_store_memory=object_store_mib << 20, _temp_dir=temp_dir,
             include_dashboard=False, log_to_driver=False)
    context = ray.data.DataContext.get_current()
    saved = (context.execution_options.preserve_order, context.enable_progress_bars)
    try:
        yield
    finally:
        # the jobs' init_ray set these process-wide; later test modules get Ray Data's defaults back
        context.execution_options.preserve_order, context.enable_progress_bars = saved
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
