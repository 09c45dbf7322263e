"""Which torch device a Ray Train worker owns, on NVIDIA (CUDA) and AMD (ROCm) nodes alike.

Ray hands each GPU worker the ids of the GPUs it reserved (``ray.get_gpu_ids()``), in the node's own numbering,
and hides the others through an environment variable: CUDA_VISIBLE_DEVICES on NVIDIA nodes, HIP_VISIBLE_DEVICES
on AMD nodes (unless RAY_EXPERIMENTAL_NOSET_{CUDA,HIP}_VISIBLE_DEVICES=1 tells it not to). Ray Train then sets
CUDA_VISIBLE_DEVICES to every GPU of the node for all its workers, and its own device lookup takes the worker's
index in *that* list. On ROCm, HIP_VISIBLE_DEVICES wins over CUDA_VISIBLE_DEVICES, so a worker that Ray gave GPU 3
sees one device (cuda:0) while Ray Train asks for cuda:3: "invalid device ordinal" (ray-project/ray#49260).

Ray Train also moves each worker to *its* device before the training function runs, and that step crashes on the
same wrong ordinal. Only with RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES=1 (set by cluster_yamls/frontier_env.sh)
do Ray Train's lookup and the runtime agree on AMD nodes; check_ray_train_gpu_environment() lets the driver refuse
to start otherwise, with a message instead of a crash in every worker but the first.

The rule that holds in every combination: the runtime enumerates exactly the devices of the mask that applies
(ROCm: HIP_VISIBLE_DEVICES, else CUDA_VISIBLE_DEVICES; CUDA: CUDA_VISIBLE_DEVICES; none set: all, in node order),
so the worker's device index is the position of its Ray GPU id in that mask. ROCR_VISIBLE_DEVICES filters the
devices below HIP and before Ray numbers them, so it shifts nothing, but Ray refuses it without
HIP_VISIBLE_DEVICES, and so does this module.
"""

import logging
import os
from collections.abc import Mapping, Sequence

import torch

logger = logging.getLogger(__name__)

NOSET_SWITCHES = ("RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES", "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES")


class DeviceSelectionError(RuntimeError):
    """The worker's GPU cannot be determined from the environment; the message names the variables involved."""


def training_device() -> torch.device:
    """The device this Ray Train worker trains on: its own GPU, or the CPU when torch sees no GPU.

    Call inside a Ray Train worker (the training loop). Raises DeviceSelectionError, naming the variables, when
    Ray's GPU assignment and the visibility variables contradict each other.
    """
    import ray
    import ray.train

    local_rank = ray.train.get_context().get_local_rank()
    return select_device(
        ray_gpu_ids=[str(gpu_id) for gpu_id in ray.get_gpu_ids()],
        environ=os.environ,
        rocm=bool(torch.version.hip),
        device_count=torch.cuda.device_count() if torch.cuda.is_available() else 0,
        local_rank=local_rank,
    )


def check_ray_train_gpu_environment(use_gpu: bool, environ: Mapping[str, str] | None = None,
                                    rocm: bool | None = None) -> None:
    """Refuse, before any worker starts, a GPU run whose workers Ray Train would put on the wrong device.

    Call in the driver (a Ray job's entrypoint inherits the environment of the head's `ray start`, which the
    cluster files give every node alike). On ROCm builds Ray Train needs RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES=1:
    otherwise Ray hides all but one GPU from each worker through HIP_VISIBLE_DEVICES while Ray Train's own
    torch.cuda.set_device indexes the node-wide CUDA_VISIBLE_DEVICES (ray-project/ray#49260).
    """
    environ = os.environ if environ is None else environ
    rocm = bool(torch.version.hip) if rocm is None else rocm
    if not (use_gpu and rocm):
        return
    _refuse_rocr_alone(environ)
    if environ.get(NOSET_SWITCHES[0]) != "1":
        raise DeviceSelectionError(
            f"GPU training on a ROCm build needs {NOSET_SWITCHES[0]}=1 in the environment of every `ray start` "
            f"(now {environ.get(NOSET_SWITCHES[0], 'unset')!r}): without it Ray Train moves worker k to cuda:k "
            "while Ray lets it see one GPU, and every worker but one fails with 'invalid device ordinal'. "
            "cluster_yamls/frontier_env.sh sets it; restart the cluster after sourcing it."
        )


def distributed_backend(device: torch.device) -> str:
    """The torch.distributed backend for a device: NCCL (RCCL on ROCm builds) for GPUs, gloo for the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def select_device(
    ray_gpu_ids: Sequence[str],
    environ: Mapping[str, str],
    rocm: bool,
    device_count: int,
    local_rank: int,
) -> torch.device:
    """The device of a worker that holds the Ray GPUs `ray_gpu_ids`, given its environment and what torch sees.

    `local_rank` only labels the messages: Ray Train's local ranks need not follow GPU ids (another job may hold
    GPUs 0-3 while this one's workers, local ranks 0-3, hold GPUs 4-7).
    """
    who = f"local rank {local_rank}"
    if device_count == 0:
        if ray_gpu_ids:
            logger.warning("%s holds Ray GPU(s) %s but torch sees no GPU: training on the CPU", who, list(ray_gpu_ids))
        return torch.device("cpu")
    if not ray_gpu_ids:
        # A worker without a GPU reservation must not grab a GPU that Ray may have given to another worker.
        logger.info("%s holds no Ray GPU (ScalingConfig(use_gpu=False)): training on the CPU", who)
        return torch.device("cpu")

    mask_name, mask = _visibility_mask(environ, rocm)
    if mask is None:
        # Nothing hides devices: the runtime numbers them as Ray does (0..n-1 of the node).
        if not all(gpu_id.isdigit() for gpu_id in ray_gpu_ids):
            raise DeviceSelectionError(f"{who}: Ray GPU ids {list(ray_gpu_ids)} are not device indices")
        index = int(ray_gpu_ids[0])
        source = f"Ray GPU id {ray_gpu_ids[0]}, no visibility mask set"
    else:
        gpu_id = ray_gpu_ids[0]
        if gpu_id not in mask:
            raise DeviceSelectionError(
                f"{who}: Ray reserved GPU {gpu_id} for this worker, but {mask_name}={environ[mask_name]!r} does not "
                f"list it, so the GPU is hidden from torch. Something other than Ray changed {mask_name}; with "
                f"{_noset_state(environ)} Ray leaves the variable as the raylet's environment had it. Unset it "
                "before `ray start`, or keep Ray's setting."
            )
        index = mask.index(gpu_id)
        source = f"Ray GPU id {gpu_id} in {mask_name}={environ[mask_name]!r}"
    if index >= device_count:
        raise DeviceSelectionError(
            f"{who}: {source} selects device {index}, but torch sees only {device_count} device(s) (this would be "
            f"'invalid device ordinal'); {_describe_env(environ)}"
        )
    logger.info("%s trains on cuda:%d (%s)", who, index, source)
    return torch.device("cuda", index)


def _visibility_mask(environ: Mapping[str, str], rocm: bool) -> tuple[str, list[str] | None]:
    """The variable whose list the GPU runtime enumerates, and that list (None: all devices are visible)."""
    if rocm:
        _refuse_rocr_alone(environ)
        names = ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
    else:
        names = ("CUDA_VISIBLE_DEVICES",)
    for name in names:
        if name in environ:
            value = environ[name]
            if value in ("", "NoDevFiles"):
                return name, []
            return name, [item.strip() for item in value.split(",")]
    return "", None


def _refuse_rocr_alone(environ: Mapping[str, str]) -> None:
    if "ROCR_VISIBLE_DEVICES" in environ and "HIP_VISIBLE_DEVICES" not in environ:
        raise DeviceSelectionError(
            f"ROCR_VISIBLE_DEVICES={environ['ROCR_VISIBLE_DEVICES']!r} is set without HIP_VISIBLE_DEVICES: Ray "
            "refuses this ('Please use HIP_VISIBLE_DEVICES instead of ROCR_VISIBLE_DEVICES'). Set "
            "HIP_VISIBLE_DEVICES to 0..n-1 for the n devices ROCR_VISIBLE_DEVICES lists (frontier_env.sh does) "
            "or unset ROCR_VISIBLE_DEVICES, before `ray start`."
        )


def _noset_state(environ: Mapping[str, str]) -> str:
    return ", ".join(f"{name}={environ.get(name, '(unset)')}" for name in NOSET_SWITCHES)


def _describe_env(environ: Mapping[str, str]) -> str:
    names = ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", *NOSET_SWITCHES)
    return ", ".join(f"{name}={environ[name]!r}" for name in names if name in environ) or "no visibility variables set"
