"""Device selection of a Ray Train worker under every combination of the GPU visibility variables.

This machine has no GPU, so three things are stand-ins here: torch's ROCm build (torch.version.hip), the number of
devices torch reports (torch.cuda.device_count, given per case as the real runtime would report it on an 8-GPU
node with that environment: ROCm enumerates HIP_VISIBLE_DEVICES, else CUDA_VISIBLE_DEVICES), and the Ray Train
worker holding a GPU (ray.get_gpu_ids, ray.train.get_context). The visibility variables themselves are really set
in os.environ, the way Ray and Ray Train set them.
"""

import types

import pytest
import ray
import ray.train
import torch

from huginn_ray.cluster import devices
from huginn_ray.cluster.devices import (
    DeviceSelectionError,
    check_ray_train_gpu_environment,
    distributed_backend,
    training_device,
)

VARIABLES = (
    "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES",
    "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES", "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES",
)
ALL_8 = "0,1,2,3,4,5,6,7"  # what Ray Train shares as CUDA_VISIBLE_DEVICES with 8 one-GPU workers on a node
NOSET_HIP = {"RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES": "1"}
NOSET_CUDA = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}


@pytest.fixture
def worker(monkeypatch):
    """Makes this process look like a Ray Train worker on a GPU node: returns a function that sets it up."""

    def setup(*, rocm: bool, env: dict, ray_gpu_ids: list, device_count: int, local_rank: int = 0):
        for name in VARIABLES:
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setattr(torch.version, "hip", "6.2.41133" if rocm else None)  # stands in for a ROCm build
        monkeypatch.setattr(torch.cuda, "is_available", lambda: device_count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: device_count)  # stands in for the GPUs
        monkeypatch.setattr(ray, "get_gpu_ids", lambda: list(ray_gpu_ids))  # stands in for Ray's reservation
        context = types.SimpleNamespace(get_local_rank=lambda: local_rank)
        monkeypatch.setattr(ray.train, "get_context", lambda: context)

    return setup


# (case, ROCm build, environment, Ray GPU ids of the worker, devices torch sees, expected device)
SELECTS = [
    # AMD, Ray's defaults: Ray sets HIP_VISIBLE_DEVICES to the worker's GPU, Ray Train shares CUDA_VISIBLE_DEVICES;
    # HIP wins, torch sees one device.
    ("amd-ray-defaults", True, {"HIP_VISIBLE_DEVICES": "3", "CUDA_VISIBLE_DEVICES": ALL_8}, ["3"], 1, "cuda:0"),
    ("amd-no-train-sharing", True, {"HIP_VISIBLE_DEVICES": "5"}, ["5"], 1, "cuda:0"),
    ("amd-rocr-and-hip", True, {"ROCR_VISIBLE_DEVICES": "4,5,6,7", "HIP_VISIBLE_DEVICES": "2",
                                 "CUDA_VISIBLE_DEVICES": "0,1,2,3"}, ["2"], 1, "cuda:0"),
    # AMD, Ray told not to set HIP_VISIBLE_DEVICES: Ray Train's shared CUDA_VISIBLE_DEVICES is what HIP honours.
    ("amd-noset-hip-shared", True, {**NOSET_HIP, "CUDA_VISIBLE_DEVICES": ALL_8}, ["3"], 8, "cuda:3"),
    ("amd-noset-hip-no-mask", True, dict(NOSET_HIP), ["5"], 8, "cuda:5"),
    # ... and the raylet was started with half the node: Ray's ids are that list's entries, not indices.
    ("amd-noset-hip-raylet-mask", True, {**NOSET_HIP, "HIP_VISIBLE_DEVICES": "4,5,6,7",
                                         "CUDA_VISIBLE_DEVICES": "4,5,6,7"}, ["6"], 4, "cuda:2"),
    # AMD node where Ray fell back to its NVIDIA manager (no amdsmi): Ray sets CUDA_VISIBLE_DEVICES, HIP honours it.
    ("amd-ray-set-cuda", True, {"CUDA_VISIBLE_DEVICES": "6"}, ["6"], 1, "cuda:0"),
    ("amd-ray-set-cuda-shared", True, {"CUDA_VISIBLE_DEVICES": ALL_8}, ["6"], 8, "cuda:6"),
    # NVIDIA: only CUDA_VISIBLE_DEVICES counts; stray HIP/ROCR variables change nothing.
    ("nvidia-ray-defaults", False, {"CUDA_VISIBLE_DEVICES": ALL_8}, ["3"], 8, "cuda:3"),
    ("nvidia-no-train-sharing", False, {"CUDA_VISIBLE_DEVICES": "3"}, ["3"], 1, "cuda:0"),
    ("nvidia-stray-hip", False, {"CUDA_VISIBLE_DEVICES": ALL_8, "HIP_VISIBLE_DEVICES": "3",
                                 "ROCR_VISIBLE_DEVICES": "3"}, ["3"], 8, "cuda:3"),
    ("nvidia-noset-cuda-no-mask", False, dict(NOSET_CUDA), ["2"], 8, "cuda:2"),
    ("nvidia-noset-cuda-user-mask", False, {**NOSET_CUDA, "CUDA_VISIBLE_DEVICES": "1,3"}, ["3"], 2, "cuda:1"),
    # No GPU for this worker, or none that torch can use: the CPU.
    ("no-ray-gpu", True, {"CUDA_VISIBLE_DEVICES": ALL_8}, [], 8, "cpu"),
    ("torch-sees-no-gpu", True, {"HIP_VISIBLE_DEVICES": "3"}, ["3"], 0, "cpu"),
    ("cpu-only", False, {}, [], 0, "cpu"),
]


@pytest.mark.parametrize("case,rocm,env,ray_gpu_ids,device_count,expected", SELECTS, ids=[c[0] for c in SELECTS])
def test_training_device_selects_the_workers_gpu(worker, case, rocm, env, ray_gpu_ids, device_count, expected):
    worker(rocm=rocm, env=env, ray_gpu_ids=ray_gpu_ids, device_count=device_count, local_rank=1)
    assert training_device() == torch.device(expected)


def test_ray_trains_own_lookup_gets_the_amd_case_wrong(worker):
    """Why training_device exists: Ray Train's lookup indexes CUDA_VISIBLE_DEVICES, which HIP overrides."""
    from ray.air._internal.device_manager.nvidia_gpu import CUDATorchDeviceManager

    worker(rocm=True, env={"HIP_VISIBLE_DEVICES": "3", "CUDA_VISIBLE_DEVICES": ALL_8}, ray_gpu_ids=["3"],
           device_count=1)
    assert CUDATorchDeviceManager().get_devices() == [torch.device("cuda:3")]  # ordinal 3 of 1 device: invalid
    assert training_device() == torch.device("cuda:0")


# AMD GPU workers as Ray Train sets them up by default (it shares CUDA_VISIBLE_DEVICES among a node's workers).
NOSET_HIP_CASES = [c for c in SELECTS if c[1] and NOSET_HIP.items() <= c[2].items() and c[3]
                   and "CUDA_VISIBLE_DEVICES" in c[2]]


@pytest.mark.parametrize("case,rocm,env,ray_gpu_ids,device_count,expected", NOSET_HIP_CASES,
                         ids=[c[0] for c in NOSET_HIP_CASES])
def test_ray_train_agrees_with_training_device_under_noset_hip(
    worker, case, rocm, env, ray_gpu_ids, device_count, expected
):
    """With frontier_env.sh's RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES=1, the device Ray Train moves a worker
    to before the training function runs is the one training_device() picks."""
    from ray.air._internal.device_manager.nvidia_gpu import CUDATorchDeviceManager

    worker(rocm=rocm, env=env, ray_gpu_ids=ray_gpu_ids, device_count=device_count)
    assert CUDATorchDeviceManager().get_devices()[0] == training_device() == torch.device(expected)


def test_driver_check_refuses_rocm_gpu_runs_without_noset_hip():
    with pytest.raises(DeviceSelectionError, match="RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES=1.*'unset'"):
        check_ray_train_gpu_environment(True, environ={}, rocm=True)
    with pytest.raises(DeviceSelectionError, match="ROCR_VISIBLE_DEVICES"):
        check_ray_train_gpu_environment(True, environ={**NOSET_HIP, "ROCR_VISIBLE_DEVICES": "0"}, rocm=True)
    check_ray_train_gpu_environment(True, environ=dict(NOSET_HIP), rocm=True)
    check_ray_train_gpu_environment(True, environ={}, rocm=False)  # NVIDIA: Ray Train's lookup is right
    check_ray_train_gpu_environment(False, environ={}, rocm=True)  # CPU run: no GPU to get wrong


# (case, ROCm build, environment, Ray GPU ids, devices torch sees, words the error must contain)
REFUSES = [
    ("amd-rocr-alone", True, {"ROCR_VISIBLE_DEVICES": "0,1,2,3"}, ["1"], 4,
     ["ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"]),
    ("amd-rocr-alone-noset", True, {**NOSET_HIP, "ROCR_VISIBLE_DEVICES": "2", "CUDA_VISIBLE_DEVICES": ALL_8},
     ["2"], 1, ["ROCR_VISIBLE_DEVICES"]),
    ("amd-mask-hides-the-gpu", True, {"HIP_VISIBLE_DEVICES": "0", "CUDA_VISIBLE_DEVICES": ALL_8}, ["3"], 1,
     ["HIP_VISIBLE_DEVICES='0'", "GPU 3", "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES"]),
    ("amd-empty-mask", True, {"HIP_VISIBLE_DEVICES": ""}, ["0"], 1, ["HIP_VISIBLE_DEVICES=''"]),
    ("nvidia-nodevfiles", False, {"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, ["0"], 1, ["CUDA_VISIBLE_DEVICES"]),
    ("amd-ordinal-beyond-count", True, dict(NOSET_HIP), ["7"], 4,
     ["invalid device ordinal", "device 7", "only 4", "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES='1'"]),
    ("nvidia-ordinal-beyond-count", False, {"CUDA_VISIBLE_DEVICES": ALL_8}, ["7"], 2, ["device 7", "only 2"]),
]


@pytest.mark.parametrize("case,rocm,env,ray_gpu_ids,device_count,words", REFUSES, ids=[c[0] for c in REFUSES])
def test_training_device_refuses_impossible_combinations(worker, case, rocm, env, ray_gpu_ids, device_count, words):
    worker(rocm=rocm, env=env, ray_gpu_ids=ray_gpu_ids, device_count=device_count, local_rank=2)
    with pytest.raises(DeviceSelectionError) as error:
        training_device()
    for word in words:
        assert word in str(error.value)


def test_select_device_takes_the_ray_gpu_id_not_the_local_rank():
    # Another job holds GPUs 0-3; this job's local rank 0 got GPU 6 and must use neither GPU 0 nor index 0.
    device = devices.select_device(["6"], {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, rocm=False, device_count=4,
                                   local_rank=0)
    assert device == torch.device("cuda:2")
    device = devices.select_device(["6"], {}, rocm=False, device_count=8, local_rank=0)
    assert device == torch.device("cuda:6")


def test_distributed_backend():
    assert distributed_backend(torch.device("cuda:3")) == "nccl"  # RCCL on ROCm builds, under the same name
    assert distributed_backend(torch.device("cpu")) == "gloo"
