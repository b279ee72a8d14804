#!/usr/bin/env bash
# HiQCache GPU check on a bare CUDA machine without network (docs/development.md,
# "GPU check"):
#   bash scripts/gpu_check.sh prepare                # here: stage build/gpu-carry/
#   bash scripts/gpu_check.sh tests|bench --out DIR  # there, one phase per command
#   bash scripts/gpu_check.sh --dry-run [tests|bench] --out DIR  # CPU, interpreted
# Options: --out DIR (results/gpu-check)  --site DIR (build/gpu-site)
#   --test-timeout S (420)  --bench-budget S (140)  --bench-timeout S (240)
#   -- ARGS (to pytest for tests, gpu_bench.py for bench). Exit 0 only if all passed.
# Python: $PYTHON, else the repository's .venv/bin/python, else python3.

set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# The test venv has torch and Triton on CPU; a GPU machine's python3 has its own.
PY="${PYTHON:-python3}"
[ -z "${PYTHON:-}" ] && [ -x "$ROOT/.venv/bin/python" ] && PY="$ROOT/.venv/bin/python"
SGLANG_VERSION="$(sed -n 's/^SGLANG_VERSION=//p' sglang.lock)"
CARRY="build/gpu-carry"
PACKAGES="tests/gpu/carried_packages.txt"

log() { printf '[gpu-check] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 2; }

# ---------------------------------------------------------------- prepare

pin_of() {  # "name==version" pinned in requirements/, else the bare name
    local name="$1" line
    line="$(grep -ihE "^${name//[-_]/[-_]}==" requirements/*.txt | head -1)"
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
    rm -rf "$CARRY/wheels" && mkdir -p "$CARRY/wheels"
    log "fetching the pinned cp312 sglang wheel"
    local wheel
    wheel="$("$PY" scripts/overlay.py fetch --python-tag 312)" || die "overlay.py fetch failed"
    cp "$wheel" "$CARRY/wheels/"
    local specs=() dist
    while read -r dist _; do specs+=("$(pin_of "$dist")"); done \
        < <(grep -v '^#' "$PACKAGES")
    log "downloading ${#specs[@]} cp312 wheels into $CARRY/wheels/"
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
        --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d "$CARRY/wheels" "${specs[@]}" || die "pip download failed"
    collect_edits "$CARRY/edits"
    [ -f "$CARRY/edits/files.txt" ] && sed 's/^/  unrefreshed edit: /' "$CARRY/edits/files.txt" >&2
    [ -f "$CARRY/edits/deleted.txt" ] \
        && log "warning: deletions cannot be carried: $(tr '\n' ' ' < "$CARRY/edits/deleted.txt")"
    local total
    total="$(( $(du -sb "$CARRY" | cut -f1) + $(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1) ))"
    log "carry: [\"$CARRY\"]  ($((total / 1048576)) MiB with the working tree; the limit is 64 MiB)"
    log "then, as two commands: bash scripts/gpu_check.sh tests --out \$OUT"
    log "                       bash scripts/gpu_check.sh bench --out \$OUT"
}

# ---------------------------------------------------------------- arguments
PHASES=()
OUT=""
SITE=""
DRY=0
TEST_TIMEOUT=420
BENCH_BUDGET=140
BENCH_TIMEOUT=240
EXTRA=()
while [ $# -gt 0 ]; do
    case "$1" in
        prepare) prepare; exit 0 ;;
        tests|bench) PHASES+=("$1") ;;
        --out) OUT="$2"; shift ;;
        --site) SITE="$2"; shift ;;
        --dry-run) DRY=1 ;;
        --test-timeout) TEST_TIMEOUT="$2"; shift ;;
        --bench-budget) BENCH_BUDGET="$2"; shift ;;
        --bench-timeout) BENCH_TIMEOUT="$2"; shift ;;
        --) shift; EXTRA=("$@"); break ;;
        -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
        *) die "unknown argument $1 (see --help)" ;;
    esac
    shift
done
[ ${#PHASES[@]} -gt 0 ] || PHASES=(tests bench)
OUT="${OUT:-$ROOT/results/gpu-check}"
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"
SITE="${SITE:-$ROOT/build/gpu-site}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$ROOT/build/gpu-triton-cache}"
SUMMARY="$OUT/gpu_check.json"

step() {  # name status detail: recorded in gpu_check.json at once
    log "$1: $2${3:+ ($3)}"
    "$PY" - "$SUMMARY" "$1" "$2" "${3:-}" "$DRY" <<'EOF'
import json, sys, time
from pathlib import Path
path, name, status, detail, dry = Path(sys.argv[1]), *sys.argv[2:]
data = json.loads(path.read_text()) if path.exists() else {}
data["dry_run"] = dry == "1"
step = {"step": name, "status": status, "detail": detail, "at": time.strftime("%H:%M:%S")}
data.setdefault("steps", []).append(step)
path.write_text(json.dumps(data, indent=1))
EOF
}

# ---------------------------------------------------------------- site

sglang_wheel() {  # the pinned wheel for this Python: carried, else the wheel cache
    local tag dir cand
    tag="$("$PY" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')" \
        || die "no Python at $PY"
    for dir in "$CARRY/wheels" "${HIQ_WHEEL_CACHE:-build/wheels}" build/wheels; do
        for cand in "$dir"/sglang-"$SGLANG_VERSION"-cp"$tag"-*.whl; do
            [ -f "$cand" ] && { echo "$cand"; return 0; }
        done
    done
    die "no sglang $SGLANG_VERSION wheel for cp$tag in $CARRY/wheels/: run 'bash scripts/gpu_check.sh prepare' where there is network, and carry $CARRY"
}

missing_wheels() {  # carried wheels whose distribution this Python lacks
    [ -d "$CARRY/wheels" ] || return 0
    "$PY" - "$CARRY/wheels" <<'EOF'
import importlib.metadata as md, sys
from pathlib import Path
for wheel in sorted(Path(sys.argv[1]).glob("*.whl")):
    dist = wheel.name.split("-")[0]
    if dist == "sglang":
        continue
    try:
        md.version(dist)
    except md.PackageNotFoundError:
        print(wheel)
EOF
}

inputs_digest() {  # edits dir, wheels...: what the site is built from
    local edits="$1"
    shift
    {
        "$PY" -c 'import sys; print(sys.version)'
        printf '%s\n' "$@"
        find patches sglang_overlay "$edits" -type f ! -name '*.pyc' 2>/dev/null \
            | LC_ALL=C sort | xargs -r sha256sum
    } | sha256sum | cut -c1-16
}

ensure_site() {
    local wheel wheels digest edits="$CARRY/edits"
    wheel="$(sglang_wheel)" || exit 2
    mapfile -t wheels < <(missing_wheels)
    if [ -d build/sglang/.git ]; then  # an applied tree here: take its edits now
        edits="build/gpu-edits"
        collect_edits "$edits"
    fi
    digest="$(inputs_digest "$edits" "$wheel" "${wheels[@]}")"
    if [ -f "$SITE/.hiq-site" ] && [ "$(cat "$SITE/.hiq-site")" = "$digest" ]; then
        step site ok "reused $SITE"
        return
    fi
    rm -rf "$SITE" && mkdir -p "$SITE"
    local names
    names="$(basename -a "$wheel" "${wheels[@]}" | tr '\n' ' ')"
    if "$PY" -m pip --version >/dev/null 2>&1; then
        "$PY" -m pip install --no-index --no-deps --no-compile --disable-pip-version-check \
            --target "$SITE" "$wheel" "${wheels[@]}" > "$OUT/install.log" 2>&1 \
            || die "pip install failed (see $OUT/install.log)"
    else  # a wheel is a zip; --no-deps --target is an unzip
        local w
        for w in "$wheel" "${wheels[@]}"; do
            "$PY" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' \
                "$w" "$SITE" || die "unzip of $w failed"
        done
    fi
    step install ok "one pip call: $names"

    if ! command -v patch >/dev/null 2>&1; then
        # overlay.py install runs `patch -p1 --batch --forward [-R] -d DIR -i FILE`;
        # git apply does the same outside a repository.
        command -v git >/dev/null 2>&1 || die "neither patch nor git is installed"
        mkdir -p "$SITE/.bin"
        cat > "$SITE/.bin/patch" <<'EOF'
#!/usr/bin/env bash
dir=. file= strip=1 reverse=
while [ $# -gt 0 ]; do
    case "$1" in
        -d) dir="$2"; shift ;; -i) file="$2"; shift ;; -p*) strip="${1#-p}" ;; -R) reverse=-R ;;
    esac
    shift
done
cd "$dir" && exec git apply $reverse -p"$strip" "$file"
EOF
        chmod +x "$SITE/.bin/patch"
        export PATH="$SITE/.bin:$PATH"
    fi
    "$PY" scripts/overlay.py install --target "$SITE" > "$OUT/overlay.log" 2>&1 \
        || { cat "$OUT/overlay.log" >&2; die "overlay.py install failed"; }
    step apply_series ok "$(tail -1 "$OUT/overlay.log")"

    if [ -f "$edits/files.txt" ]; then
        cp -a "$edits/python/." "$SITE/"
        step apply_edits ok "$(wc -l < "$edits/files.txt") unrefreshed file(s): $(tr '\n' ' ' < "$edits/files.txt")"
    fi
    echo "$digest" > "$SITE/.hiq-site"
}

# ---------------------------------------------------------------- phases

run_phase() {  # phase timeout tail-lines module args...: its log is $OUT/gpu_<phase>.log
    local phase="$1" limit="$2" lines="$3" rc detail=""
    shift 3
    [ "$DRY" = 1 ] && set -- "$@" --dry-run
    timeout "$limit" "$PY" -m "$@" "${EXTRA[@]}" > "$OUT/gpu_$phase.log" 2>&1
    rc=$?
    tail -"$lines" "$OUT/gpu_$phase.log" >&2
    [ "$phase" = tests ] && detail="$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1])).get("verdict", "cut short"))' \
        "$OUT/gpu_tests.json" 2>/dev/null || echo "no report")"
    # Only the tests phase has a verdict, and its timeout is a "failed: " one.
    [ $rc = 124 ] && detail="${detail:+failed: }timed out after ${limit}s (partial results in gpu_$phase.json)"
    step "$phase" "$([ $rc = 0 ] && echo ok || echo failed)" "$detail"
    return $rc
}

# Both phases import torch and Triton: without them, one line, not two tracebacks.
missing="$("$PY" -c 'import importlib.util as u
print(", ".join(m for m in ("torch", "triton") if u.find_spec(m) is None))' 2>/dev/null)" \
    || die "no Python at $PY: pass PYTHON=/path/to/python (one with PyTorch and Triton)"
[ -z "$missing" ] || die "$PY has no $missing: pass PYTHON=/path/to/python with" \
    "PyTorch and Triton (on CPU the test venv: make venv, then PYTHON=.venv/bin/python)"

START=$(date +%s)
ensure_site
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
if [ "$DRY" = 1 ]; then
    export HIQ_GPU_TEST_DEVICE=cpu TRITON_INTERPRET=1
fi
FAILED=0
for phase in "${PHASES[@]}"; do
    case "$phase" in
        tests) run_phase tests "$TEST_TIMEOUT" 15 tests.gpu.run_gpu_tests \
            --json "$OUT/gpu_tests.json" || FAILED=1 ;;
        bench) run_phase bench "$BENCH_TIMEOUT" 25 scripts.gpu_bench \
            --out "$OUT/gpu_bench.json" --budget-s "$BENCH_BUDGET" || FAILED=1 ;;
    esac
done
log "done in $(( $(date +%s) - START )) s; results in $OUT"
exit $FAILED
