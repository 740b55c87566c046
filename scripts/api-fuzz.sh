#!/usr/bin/env bash
# Fuzzes gpuvm's control API with schemathesis (PyPI) against live sockets, from the OpenAPI
# document api/openapi.json. Fails on any 5xx, any answer the document does not describe,
# or a gpuvm that died.
#
#   scripts/api-fuzz.sh [GPUVM_BIN]
#
# Two instances:
#   1. before start: every operation except PUT /actions (which would start or end the VM);
#   2. a running memloop guest (--config-file): every operation except PUT /actions and
#      PUT /snapshot/create (random absolute paths would write guest memory anywhere).
# The lifecycle itself is covered by tests/api.rs. schemathesis speaks TCP, so a small relay
# forwards 127.0.0.1:PORT to the Unix socket (loopback only).
# API_FUZZ_EXAMPLES (default 40) bounds the examples per operation.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.." && pwd)"
readonly REPO_ROOT
GPUVM_BIN="${1:-${GPUVM_BIN:-$REPO_ROOT/target/x86_64-unknown-linux-gnu/release/gpuvm}}"
readonly GPUVM_BIN
readonly EXAMPLES="${API_FUZZ_EXAMPLES:-40}"

# shellcheck source=scripts/api-fuzz-lib.sh
source "$REPO_ROOT/scripts/api-fuzz-lib.sh"
api_fuzz_setup gpuvm-api-fuzz

# Starts gpuvm with ARGS on socket NAME and a relay to it; sets $port and $gpuvm_pid.
start() {
    local name="$1"
    shift
    local socket="$work/$name.sock"
    # Seccomp filters are on by default: a blocked call ends gpuvm with 148 and one line.
    "$GPUVM_BIN" run --api-sock "$socket" "$@" >"$work/$name.out" 2>"$work/$name.err" &
    gpuvm_pid=$!
    pids+=("$gpuvm_pid")
    api_fuzz_relay "$name"
}

fuzz() {
    local name="$1"
    shift
    echo "api-fuzz: $name"
    # schemathesis keeps its example database in the working directory: keep it in $work.
    (cd "$work" && timeout --kill-after=10s 600 "$st" run "$REPO_ROOT/api/openapi.json" \
        --url "http://127.0.0.1:$port" \
        --checks not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance \
        --max-examples "$EXAMPLES" --seed 7 --request-timeout 30 \
        --exclude-path /actions "$@")
    if ! kill -0 "$gpuvm_pid" 2>/dev/null; then
        echo "api-fuzz: error: gpuvm ($name) died during the run" >&2
        cat "$work/$name.err" >&2
        exit 1
    fi
    if grep -q panicked "$work/$name.err"; then
        echo "api-fuzz: error: gpuvm ($name) panicked" >&2
        cat "$work/$name.err" >&2
        exit 1
    fi
}

start before-start --cmdline "memloop 8M 1 0" --memory 64M
fuzz before-start

cat >"$work/running.json" <<'JSON'
{"machine-config": {"vcpu_count": 1, "mem_size_mib": 64}, "boot-source": {"boot_args": "memloop 8M 1 0"}}
JSON
start running --config-file "$work/running.json"
fuzz running --exclude-path /snapshot/create
echo "api-fuzz: no 5xx, every answer as documented, gpuvm alive"
