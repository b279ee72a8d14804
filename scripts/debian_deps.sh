#!/usr/bin/env bash
# The Debian packages some tests need beyond the Python venv, in one place:
#   promtool (package prometheus)          tests/test_alert_rules.py
#   libibverbs1 librdmacm1 libnuma1        the Mooncake store's binaries, even
#                                          over TCP (L3 tests, make demo-l3)
# The live-server tests need none (their wheels bundle their libraries).
#
#   bash scripts/debian_deps.sh check     list what is missing (exit 0)
#   bash scripts/debian_deps.sh install   apt-get install what is missing (.ci/run)
set -euo pipefail

missing=()
command -v promtool >/dev/null || missing+=(prometheus)
for lib in libibverbs1:libibverbs.so.1 librdmacm1:librdmacm.so.1 libnuma1:libnuma.so.1; do
    ldconfig -p | grep -q "${lib#*:}" || missing+=("${lib%%:*}")
done

case "${1:-}" in
check)
    if ((${#missing[@]})); then
        echo "note: Debian packages missing: ${missing[*]}; the tests that need them" \
            "skip (CI fails them). Install: sudo bash scripts/debian_deps.sh install" \
            "(what .ci/run does)." >&2
    fi
    ;;
install)
    if ((${#missing[@]})); then
        as_root=()
        [ "$(id -u)" -eq 0 ] || as_root=(sudo)
        "${as_root[@]}" apt-get update -qq
        "${as_root[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
    ;;
*)
    echo "usage: bash scripts/debian_deps.sh check|install" >&2
    exit 2
    ;;
esac
