#!/usr/bin/env bash
# Default command of the HiQCache image (installed as /usr/local/bin/hiqcache-serve):
# SGLang's server with HiCache on. The base image's entrypoint runs it like any
# other command, so `docker run IMAGE python3 -m sglang.launch_server ...` and
# `docker run IMAGE bash` work as on lmsysorg/sglang.
#
#   docker run ... -e MODEL=<path or HF id> [-e HOST_DTYPE=k8v4] IMAGE
#   docker run ... IMAGE hiqcache-serve --model-path <m> --hicache-host-dtype int8
#
# Arguments go to sglang.launch_server unchanged. Only what they leave out is
# added: --model-path "$MODEL", --host 0.0.0.0, --port 30000,
# --enable-hierarchical-cache and --hicache-host-dtype "${HOST_DTYPE:-int8c}"
# (HOST_DTYPE=auto is the stock BF16 host tier).
set -euo pipefail

args=("$@")

given() {
    local flag arg
    for flag in "$@"; do
        for arg in "${args[@]}"; do
            if [[ "$arg" == "$flag" || "$arg" == "$flag="* ]]; then
                return 0
            fi
        done
    done
    return 1
}

if ! given --model-path --model; then
    if [[ -z "${MODEL:-}" ]]; then
        echo "hiqcache-serve: no model: set MODEL to a model path or Hugging Face id" \
            "(docker run -e MODEL=...), or pass --model-path" >&2
        exit 2
    fi
    args=(--model-path "$MODEL" "${args[@]}")
fi
given --host || args+=(--host 0.0.0.0)
given --port || args+=(--port 30000)
given --enable-hierarchical-cache || args+=(--enable-hierarchical-cache)
# Without it the host tier would be stock BF16: the image exists to compress it.
if ! given --hicache-host-dtype; then
    args+=(--hicache-host-dtype "${HOST_DTYPE:-int8c}")
    echo "hiqcache-serve: host KV dtype ${HOST_DTYPE:-int8c}" \
        "(HOST_DTYPE, default int8c; auto = stock BF16 host tier)" >&2
fi

exec python3 -m sglang.launch_server "${args[@]}"
