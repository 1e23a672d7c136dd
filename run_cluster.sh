#!/usr/bin/env bash
# Start this node's Ray container, in the foreground, the way vLLM's and Aphrodite's docs use it:
#
#   bash run_cluster.sh IMAGE HEAD_IP --head|--worker HF_HOME [docker run args...]
#   bash run_cluster.sh llmctl:latest 10.0.0.1 --head   /data/hf -e VLLM_HOST_IP=10.0.0.1
#   bash run_cluster.sh llmctl:latest 10.0.0.1 --worker /data/hf -e VLLM_HOST_IP=10.0.0.2
#
# The container (named "node", or $LLMCTL_CONTAINER_NAME) uses host networking, a 10.24 GB
# /dev/shm, all GPUs when the NVIDIA runtime exists, and HF_HOME mounted at
# /root/.cache/huggingface. Inside it, `ray start --block` runs with the node IP taken from
# VLLM_HOST_IP (the head falls back to HEAD_IP). `-e LLMCTL_NUM_GPUS=N` declares N GPUs to Ray
# (logical ones on CPU-only nodes). Keep the shell open: when the script ends, for any reason
# (Ctrl-C, a closed terminal, Ray exiting), it removes its container.
#
# `llmctl cluster up --head/--worker` does the same, detached; `llmctl cluster up -i cluster.yaml`
# does it for every node over SSH.
set -euo pipefail

usage() {
    sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//' >&2
}

if [ $# -lt 4 ]; then
    echo "error: expected IMAGE HEAD_IP --head|--worker HF_HOME, got $# arguments" >&2
    usage
    exit 2
fi
IMAGE=$1
HEAD_IP=$2
ROLE=$3
HF_HOME_DIR=$4
shift 4
NAME=${LLMCTL_CONTAINER_NAME:-node}

case "$ROLE" in
    --head | --worker) ;;
    *)
        echo "error: the third argument must be --head or --worker, not '$ROLE'" >&2
        usage
        exit 2
        ;;
esac
if ! command -v docker >/dev/null 2>&1; then
    echo "error: docker is not installed on this node (apt-get install docker.io)" >&2
    exit 1
fi
if ! docker info >/dev/null 2>&1; then
    echo "error: the Docker daemon does not answer on this node (start dockerd)" >&2
    exit 1
fi
if ! docker image inspect "$IMAGE" >/dev/null 2>&1; then
    echo "error: the image $IMAGE is not on this node (docker load -i FILE, or llmctl image build)" >&2
    exit 1
fi
if docker container inspect "$NAME" >/dev/null 2>&1; then
    echo "error: a container named $NAME already exists on this node;" \
        "remove it (docker rm -f $NAME) or set LLMCTL_CONTAINER_NAME" >&2
    exit 1
fi

GPU_ARGS=()
if docker info --format '{{json .Runtimes}}' 2>/dev/null | grep -q nvidia; then
    GPU_ARGS=(--gpus all)
fi

# Evaluated inside the container, where -e VLLM_HOST_IP=... and -e LLMCTL_NUM_GPUS=... are set;
# HEAD_IP arrives as $1, never spliced into the script text.
if [ "$ROLE" = --head ]; then
    RAY_START='exec ray start --block --head --port=6379 --node-ip-address="${VLLM_HOST_IP:-$1}"'
else
    RAY_START='exec ray start --block --address="$1:6379" ${VLLM_HOST_IP:+--node-ip-address=$VLLM_HOST_IP}'
fi
RAY_START="$RAY_START"' --disable-usage-stats ${LLMCTL_NUM_GPUS:+--num-gpus=$LLMCTL_NUM_GPUS}'

cleanup() {
    docker rm --force "$NAME" >/dev/null 2>&1 || true
}
trap cleanup EXIT
trap 'exit 129' HUP
trap 'exit 130' INT
trap 'exit 143' TERM

# In the background, so a signal runs the traps at once instead of after docker run returns.
docker run --name "$NAME" --network host --shm-size 10.24g "${GPU_ARGS[@]}" \
    --volume "$HF_HOME_DIR:/root/.cache/huggingface" "$@" \
    --entrypoint /bin/sh "$IMAGE" -c "$RAY_START" sh "$HEAD_IP" &
wait $!
