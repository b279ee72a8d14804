# HiQCache image: the official SGLang image with the HiQCache series applied in
# place by scripts/overlay.py install, the same script and inputs CI tests.
# Build with `make image`. Tags follow lmsysorg/sglang: v<version>-cu130 (CUDA
# 13, the default) and v<version>-cu130-runtime. The last CUDA 12.9 image is
# v0.5.19-cu129, so there is no cu129 variant of this pin.
ARG SGLANG_IMAGE_TAG=v0.5.23-cu130
FROM lmsysorg/sglang:${SGLANG_IMAGE_TAG}

# Everything overlay.py reads, laid out as in the repository
# (scripts/check_docker.py keeps this list in step with overlay.py).
COPY sglang.lock /opt/hiqcache/
COPY scripts/overlay.py /opt/hiqcache/scripts/
COPY patches/ /opt/hiqcache/patches/
# The [y] glob lets BuildKit build a series that has no overlay files.
COPY sglang_overla[y] /opt/hiqcache/sglang_overlay/

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# find_spec locates the package without importing it (no torch at build time).
# hadolint ignore=DL3008
RUN if ! command -v patch >/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends patch \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && pinned="$(sed -n 's/^SGLANG_VERSION=//p' /opt/hiqcache/sglang.lock)" \
    && installed="$(python3 -c 'import importlib.metadata as m; print(m.version("sglang"))')" \
    && if [ "$installed" != "$pinned" ]; then \
        echo "base image has sglang $installed, sglang.lock pins $pinned" >&2; exit 1; \
    fi \
    && target="$(python3 -c 'import importlib.util as u, pathlib as p; print(p.Path(u.find_spec("sglang").origin).parent.parent)')" \
    && python3 /opt/hiqcache/scripts/overlay.py install --target "$target"

# The base image's entrypoint stays (NVIDIA's hooks; it runs any command), so
# the image starts the way lmsysorg/sglang does:
#   docker run --gpus all -e MODEL=<path or HF id> IMAGE     (this CMD: HiCache on, INT8 host)
#   docker run --gpus all -e MODEL=<m> -e HOST_DTYPE=k8v4 IMAGE  (another host format)
#   docker run --gpus all IMAGE hiqcache-serve --model-path <m> --hicache-host-dtype int8
#   docker run --gpus all IMAGE python3 -m sglang.launch_server --model-path <m> ...
#   docker run -it IMAGE bash
COPY --chmod=755 scripts/hiqcache_serve.sh /usr/local/bin/hiqcache-serve
ENV MODEL=""
EXPOSE 30000
CMD ["hiqcache-serve"]
