# The environment of every Ray process on Frontier (the reference launcher's modules and variables).
#
# Sourced right before `ray stop`/`ray start` on the head and on every worker (cluster_yamls/frontier.yaml,
# cluster_yamls/frontier.sbatch): a raylet passes its environment on to every task, actor and Ray Train worker it
# starts, so this file is how the RCCL/libfabric settings reach the training processes. Site paths come from
# site.env next to this file. Safe to source more than once.

_huginn_env_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ ! -f "$_huginn_env_dir/site.env" ]; then
    echo "frontier_env.sh: $_huginn_env_dir/site.env is missing (copy site.env.example and fill it in)" >&2
    return 1
fi
source "$_huginn_env_dir/site.env"
: "${HUGINN_SHARED_DIR:?is empty: set it in site.env}" "${HUGINN_VENV:?is empty: set it in site.env}"
: "${HUGINN_NODE_LOCAL_DIR:?is empty: set it in site.env}" "${HUGINN_RCCL_PLUGIN_DIR:?is empty: set it in site.env}"

# Versions as in the reference launch; pick the rocm module your torch build and RCCL plugin were built for.
module load PrgEnv-gnu/8.5.0 rocm/6.2.0 craype-accel-amd-gfx90a || return 1
export PATH="$HUGINN_VENV/bin:$PATH"

# Slurm's GPU steps set ROCR_VISIBLE_DEVICES, which Ray refuses without HIP_VISIBLE_DEVICES. HIP numbers the
# devices that ROCR leaves visible from 0, so showing all of them through HIP keeps ROCR's selection.
if [ -n "${ROCR_VISIBLE_DEVICES+set}" ] && [ -z "${HIP_VISIBLE_DEVICES+set}" ]; then
    _huginn_rocr_count=$(tr ',' '\n' <<< "$ROCR_VISIBLE_DEVICES" | grep -c .)
    export HIP_VISIBLE_DEVICES=$(seq -s, 0 $((_huginn_rocr_count - 1)))
    unset _huginn_rocr_count
fi

# Every training worker sees all 8 GCDs of its node, as every rank did in the reference launch, so that RCCL sees
# the node's other GCDs (Ray Train shares CUDA_VISIBLE_DEVICES on NVIDIA nodes for the same reason);
# huginn_ray.cluster.devices.training_device() picks each worker's own GCD from its Ray GPU id.
export RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES=1

# Collectives go through RCCL, not MPI: keep Cray MPICH's GPU transport off, its GTL library on the path.
export MPICH_GPU_SUPPORT_ENABLED=0
case ":${LD_LIBRARY_PATH:-}:" in
    *":$HUGINN_RCCL_PLUGIN_DIR/lib:"*) ;;
    *) export LD_LIBRARY_PATH="$HUGINN_RCCL_PLUGIN_DIR/lib${CRAY_MPICH_ROOTDIR:+:$CRAY_MPICH_ROOTDIR/gtl/lib}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;;
esac
export HSA_FORCE_FINE_GRAIN_PCIE=1   # fine-grained PCIe memory: RCCL peer-to-peer and RDMA performance
export FI_CXI_ATS=0                  # libfabric CXI provider: no Address Translation Services
export NCCL_NET_GDR_LEVEL=3          # GPU-Direct RDMA between nodes (the reference's default; set 0 if it hangs)
export NCCL_SOCKET_IFNAME=hsn        # RCCL bootstrap on the Slingshot interfaces
export NCCL_CROSS_NIC=1              # rings/trees may use different NICs on different nodes
export NCCL_CHECKS_DISABLE=1
export NCCL_DEBUG=VERSION
export OMP_NUM_THREADS=7             # 56 cores for 8 GCDs: 7 per training worker
export TORCH_CPP_LOG_LEVEL=ERROR
export TORCHINDUCTOR_CACHE_DIR="$HUGINN_SHARED_DIR/inductor_cache"
export TORCHINDUCTOR_FX_GRAPH_CACHE=1

# Ray: token authentication on every node and for every client; MLflow: one SQLite store on the shared filesystem,
# written by the training job and served by the MLflow server on the head node.
export RAY_AUTH_MODE=token
export MLFLOW_TRACKING_URI="sqlite:///$HUGINN_SHARED_DIR/mlflow/mlflow.db"
unset _huginn_env_dir
