#!/usr/bin/env bash
# HiQCache GPU check: one command on a bare CUDA machine (PyTorch + Triton,
# no SGLang, no network). Installs the pinned SGLang wheel --no-deps into a
# temp dir, applies our series (sglang_overlay/ + patches/ via
# scripts/overlay.py install) plus any not-yet-refreshed edits of build/sglang,
# installs whatever pure-Python import it still lacks from carried wheels,
# then runs the GPU tests (tests/gpu) and the GPU benchmark
# (scripts/gpu_bench.py) and writes JSON:
#
#   <out>/gpu_check.json   summary: steps, environment, test counts, targets
#   <out>/gpu_tests.json   one record per test
#   <out>/gpu_bench.json   benchmark (restore/backup, codec GB/s, targets)
#   <out>/*.log            full output of each step
#
# Usage
#   scripts/gpu_check.sh prepare            # here (network): stage what to carry
#   scripts/gpu_check.sh [--out DIR]        # there (CUDA): run the check
#   scripts/gpu_check.sh --dry-run          # here (CPU): same flow, interpreter
#   options: --skip-tests --skip-bench --no-stock-jit
#   env:     PYTHON (default python3), HIQ_BENCH_ARGS (extra gpu_bench.py args)
#
# What to carry to the device machine (`prepare` prints the list and size):
#   build/wheels/sglang-0.5.23-cp312-cp312-manylinux_2_34_x86_64.whl
#       the pinned wheel for Python 3.12, checked against sglang.lock
#       (prepare runs: python3 scripts/overlay.py fetch --python-tag 312)
#   .whl/           pure-Python dependencies sglang's KV-cache modules import
#       and pytest, as cp312 wheels (prepare runs: pip download --no-deps
#       --only-binary=:all: --python-version 3.12 --implementation cp
#       --platform manylinux_2_28_x86_64 ... -d .whl <pins from
#       requirements/>). Only what is missing there gets installed. /.whl/ is
#       in .gitignore.
#   build/gpu-carry/ edits of build/sglang not yet refreshed into patches/ or
#       sglang_overlay/ (prepare copies them; empty once refreshed)
# For the device tool: carry = [that wheel, ".whl", "build/gpu-carry"],
# command = "bash scripts/gpu_check.sh --out $OUT". It finishes in about 5
# minutes (tests <= 240 s and benchmark <= 300 s are hard limits).

set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
SGLANG_VERSION="$(sed -n 's/^SGLANG_VERSION=//p' sglang.lock)"
CARRY_DIR="build/gpu-carry"
DEPS_DIR=".whl"
# Packages to stage in .whl/ (pins from requirements/): what a PyTorch image
# may lack among sglang's import-time needs, and pytest.
DEP_NAMES="apache-tvm-ffi compressed-tensors gguf loguru msgspec orjson pybase64 \
pyzmq sentencepiece pydantic pydantic_core annotated-types typing-inspection \
ipython traitlets dill anyio sniffio h11 starlette annotated-doc httpx2 httpcore2 \
truststore packaging pytest pluggy iniconfig"

log() { printf '[gpu-check] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

pin_of() {  # pinned "name==version" from requirements/, else the bare name
    local name="$1" line
    line="$(grep -ihE "^${name//_/[-_]}==" requirements/cpu-test.txt requirements/test-tools.txt | head -1)"
    printf '%s\n' "${line:-$name}"
}

collect_edits() {  # unrefreshed edits of build/sglang -> $1/python/...
    local dest="$1" status path
    rm -rf "$dest" && mkdir -p "$dest"
    [ -d build/sglang/.git ] || return 0
    git -C build/sglang status --porcelain --untracked-files=all -- python \
        | while IFS= read -r line; do
            status="${line:0:2}"; path="${line:3}"
            case "$path" in *.pyc|*/__pycache__/*) continue ;; esac
            if [ "$status" = " D" ] || [ "$status" = "D " ]; then
                echo "$path" >> "$dest/deleted.txt"
            elif [ -f "build/sglang/$path" ]; then
                mkdir -p "$dest/$(dirname "$path")"
                cp -p "build/sglang/$path" "$dest/$path"
                echo "$path" >> "$dest/files.txt"
            fi
        done
}

prepare() {
    log "fetching the pinned cp312 wheel"
    WHEEL="$("$PY" scripts/overlay.py fetch --python-tag 312)" || die "overlay.py fetch failed"
    log "downloading cp312 dependency wheels into $DEPS_DIR/"
    mkdir -p "$DEPS_DIR"
    local specs=() name
    for name in $DEP_NAMES; do specs+=("$(pin_of "$name")"); done
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any \
        -d "$DEPS_DIR" "${specs[@]}" || die "pip download failed"
    log "collecting unrefreshed edits of build/sglang into $CARRY_DIR/"
    collect_edits "$CARRY_DIR/edits"
    [ -f "$CARRY_DIR/edits/files.txt" ] && sed 's/^/  edit: /' "$CARRY_DIR/edits/files.txt" >&2
    [ -f "$CARRY_DIR/edits/deleted.txt" ] && log "warning: deletions cannot be carried: $(cat "$CARRY_DIR/edits/deleted.txt")"
    local rel="${WHEEL#"$ROOT"/}"
    local total
    total="$(du -cb "$WHEEL" "$DEPS_DIR" "$CARRY_DIR" | tail -1 | cut -f1)"
    log "carry: [\"$rel\", \"$DEPS_DIR\", \"$CARRY_DIR\"]  ($((total / 1048576)) MiB + the working tree; limit 64 MiB)"
    log "command: bash scripts/gpu_check.sh --out \$OUT"
}

# ---------------------------------------------------------------- arguments
MODE=run
OUT=""
DRY=0
SKIP_TESTS=0
SKIP_BENCH=0
BENCH_EXTRA=()
while [ $# -gt 0 ]; do
    case "$1" in
        prepare) MODE=prepare ;;
        --out) OUT="$2"; shift ;;
        --dry-run) DRY=1 ;;
        --skip-tests) SKIP_TESTS=1 ;;
        --skip-bench) SKIP_BENCH=1 ;;
        --no-stock-jit) BENCH_EXTRA+=(--no-stock-jit) ;;
        -h|--help) sed -n '2,40p' "$0"; exit 0 ;;
        *) die "unknown argument $1 (see --help)" ;;
    esac
    shift
done
[ "$MODE" = prepare ] && { prepare; exit 0; }

OUT="${OUT:-${OUT_DIR:-$ROOT/results/gpu-check}}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
START=$(date +%s)
WORK="$(mktemp -d "${TMPDIR:-/tmp}/hiq-gpu-check.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
SITE="$WORK/site"
DEPS="$WORK/deps"
mkdir -p "$SITE" "$DEPS" "$WORK/bin"
STEPS_FILE="$WORK/steps.tsv"
: > "$STEPS_FILE"
step() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >> "$STEPS_FILE"; log "$1: $2 ${3:+($3)}"; }

# ---------------------------------------------------------------- 1. sglang
PYTAG="$("$PY" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')" \
    || die "no $PY"
WHEEL=""
for cand in build/wheels/sglang-"$SGLANG_VERSION"-cp"$PYTAG"-*.whl "$DEPS_DIR"/sglang-"$SGLANG_VERSION"-cp"$PYTAG"-*.whl; do
    [ -f "$cand" ] && { WHEEL="$cand"; break; }
done
[ -n "$WHEEL" ] || die "no sglang $SGLANG_VERSION wheel for cp$PYTAG in build/wheels/ or $DEPS_DIR/: run 'scripts/gpu_check.sh prepare' where there is network, and carry it"
if "$PY" -m pip --version >/dev/null 2>&1; then
    "$PY" -m pip install --quiet --no-deps --no-index --no-compile \
        --disable-pip-version-check --target "$SITE" "$WHEEL" > "$OUT/install.log" 2>&1 \
        || die "pip install of $WHEEL failed (see $OUT/install.log)"
    step install_wheel ok "pip --no-deps $(basename "$WHEEL")"
else  # a wheel is a zip; --no-deps --target is an unzip
    "$PY" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' \
        "$WHEEL" "$SITE" || die "unzip of $WHEEL failed"
    step install_wheel ok "unzipped $(basename "$WHEEL") (no pip)"
fi

# ---------------------------------------------------------------- 2. our tree
if ! command -v patch >/dev/null 2>&1; then
    # overlay.py install applies the series with `patch -p1 --batch --forward
    # -d DIR -i FILE`; git apply does the same outside a repository.
    command -v git >/dev/null 2>&1 || die "neither patch nor git is installed"
    cat > "$WORK/bin/patch" <<'EOF'
#!/usr/bin/env bash
dir=. file= strip=1
while [ $# -gt 0 ]; do
    case "$1" in -d) dir="$2"; shift ;; -i) file="$2"; shift ;; -p*) strip="${1#-p}" ;; esac
    shift
done
cd "$dir" && exec git apply -p"$strip" "$file"
EOF
    chmod +x "$WORK/bin/patch"
    export PATH="$WORK/bin:$PATH"
fi
"$PY" scripts/overlay.py install --target "$SITE" > "$OUT/overlay.log" 2>&1 \
    || { cat "$OUT/overlay.log" >&2; die "overlay.py install failed"; }
step apply_series ok "$(tail -1 "$OUT/overlay.log")"

EDITS="$CARRY_DIR/edits"
if [ -d build/sglang/.git ]; then  # a full applied tree here: take its edits now
    EDITS="$WORK/edits"
    collect_edits "$EDITS"
fi
if [ -f "$EDITS/files.txt" ]; then
    cp -a "$EDITS/python/." "$SITE/"
    step apply_edits ok "$(wc -l < "$EDITS/files.txt") unrefreshed file(s): $(tr '\n' ' ' < "$EDITS/files.txt")"
else
    step apply_edits ok "none"
fi
export PYTHONPATH="$SITE:$DEPS${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1

# ---------------------------------------------------------------- 3. imports
if [ "$DRY" = 1 ]; then
    export HIQ_GPU_TEST_DEVICE=cpu TRITON_INTERPRET=1
fi
declare -A DIST=(
    [zmq]=pyzmq [tvm_ffi]=apache-tvm-ffi [yaml]=PyYAML [PIL]=pillow
    [compressed_tensors]=compressed-tensors [google]=protobuf [attr]=attrs
    [typing_inspection]=typing-inspection [annotated_types]=annotated-types
    [annotated_doc]=annotated-doc [IPython]=ipython [dateutil]=python-dateutil
)
install_dep() {  # module name -> wheel from .whl/
    local dist="${DIST[$1]:-$1}"
    [ -d "$DEPS_DIR" ] || return 1
    "$PY" -m pip install --quiet --no-deps --no-index --no-compile \
        --disable-pip-version-check --find-links "$DEPS_DIR" --target "$DEPS" "$dist" \
        >> "$OUT/deps.log" 2>&1
}
PROBE='
import importlib, sys
sys.path.insert(0, "tests/gpu")
from gpu_support import install_gpu_standins
print("standins:", install_gpu_standins(), file=sys.stderr)
for name in ("pytest", "triton", "sglang.srt.mem_cache.memory_pool",
             "sglang.srt.mem_cache.pool_host.mha",
             "sglang.srt.mem_cache.pool_host.mha_int8",
             "sglang.srt.mem_cache.allocator.token",
             "sglang.srt.managers.cache_controller"):
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and not e.name.startswith("sglang"):
            print(e.name.split(".")[0]); sys.exit(3)
        raise
'
INSTALLED=""
for attempt in $(seq 1 25); do
    missing="$("$PY" -c "$PROBE" 2>> "$OUT/imports.log")"
    rc=$?
    [ $rc = 0 ] && break
    if [ $rc != 3 ] || [ -z "$missing" ]; then
        tail -30 "$OUT/imports.log" >&2
        die "importing sglang's KV-cache modules failed (see $OUT/imports.log)"
    fi
    install_dep "$missing" || die "module $missing is missing and $DEPS_DIR/ has no wheel for it (add it to DEP_NAMES and run prepare)"
    INSTALLED="$INSTALLED $missing"
done
step imports ok "installed from $DEPS_DIR:${INSTALLED:- nothing}"

# ---------------------------------------------------------------- 4. tests
TEST_RC=-1
if [ "$SKIP_TESTS" = 0 ]; then
    HIQ_GPU_TEST_JSON="$OUT/gpu_tests.json" timeout 240 "$PY" -m pytest \
        -p no:cacheprovider --confcutdir=tests/gpu -q -rfEs tests/gpu \
        > "$OUT/gpu_tests.log" 2>&1
    TEST_RC=$?
    tail -15 "$OUT/gpu_tests.log" >&2
    step tests "$([ $TEST_RC = 0 ] && echo ok || echo "failed rc=$TEST_RC")" "$(tail -1 "$OUT/gpu_tests.log")"
fi

# ---------------------------------------------------------------- 5. bench
BENCH_RC=-1
if [ "$SKIP_BENCH" = 0 ]; then
    BENCH_ARGS=(--out "$OUT/gpu_bench.json" --budget-s 240 "${BENCH_EXTRA[@]}")
    [ "$DRY" = 1 ] && BENCH_ARGS+=(--dry-run)
    # shellcheck disable=SC2206
    BENCH_ARGS+=(${HIQ_BENCH_ARGS:-})
    timeout 300 "$PY" scripts/gpu_bench.py "${BENCH_ARGS[@]}" > "$OUT/gpu_bench.log" 2>&1
    BENCH_RC=$?
    tail -25 "$OUT/gpu_bench.log" >&2
    step bench "$([ $BENCH_RC = 0 ] && echo ok || echo "failed rc=$BENCH_RC")" ""
fi

# ---------------------------------------------------------------- 6. summary
"$PY" - "$OUT" "$STEPS_FILE" "$TEST_RC" "$BENCH_RC" "$START" "$DRY" <<'EOF'
import json, sys, time
from pathlib import Path
out, steps_file, test_rc, bench_rc, start, dry = sys.argv[1:]
out = Path(out)
steps = [dict(zip(("step", "status", "detail"), l.split("\t", 2)))
         for l in Path(steps_file).read_text().splitlines()]
summary = {"dry_run": dry == "1", "seconds": round(time.time() - int(start)),
           "steps": steps, "tests_rc": int(test_rc), "bench_rc": int(bench_rc)}
for name in ("gpu_tests", "gpu_bench"):
    p = out / f"{name}.json"
    if p.exists():
        data = json.loads(p.read_text())
        if name == "gpu_tests":
            summary["tests"] = {k: data.get(k) for k in ("counts", "standins", "device", "seconds")}
            summary["tests"]["failed"] = [t["test"] for t in data["tests"]
                                          if t["outcome"] == "failed"]
        else:
            summary["env"] = data.get("env")
            summary["targets"] = (data.get("targets") or {}).get("summary")
            summary["bench_fatal"] = data.get("fatal")
(out / "gpu_check.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary, indent=1))
EOF
[ "$TEST_RC" -le 0 ] && [ "$BENCH_RC" -le 0 ]
