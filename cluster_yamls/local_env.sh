# The environment of every Ray process of a single-workstation cluster (cluster_yamls/local.yaml).
#
# Sourced right before `ray stop`/`ray start`; site paths come from site.env next to this file
# (HUGINN_SHARED_DIR, HUGINN_VENV, HUGINN_NODE_LOCAL_DIR, RAY_AUTH_TOKEN_PATH; the RCCL plugin is not used here).

_huginn_env_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ ! -f "$_huginn_env_dir/site.env" ]; then
    echo "local_env.sh: $_huginn_env_dir/site.env is missing (copy site.env.example and fill it in)" >&2
    return 1
fi
source "$_huginn_env_dir/site.env"
: "${HUGINN_SHARED_DIR:?is empty: set it in site.env}" "${HUGINN_VENV:?is empty: set it in site.env}"
: "${HUGINN_NODE_LOCAL_DIR:?is empty: set it in site.env}"
export PATH="$HUGINN_VENV/bin:$PATH"
export RAY_AUTH_MODE=token
export MLFLOW_TRACKING_URI="sqlite:///$HUGINN_SHARED_DIR/mlflow/mlflow.db"
unset _huginn_env_dir
