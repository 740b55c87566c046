# Shared by scripts/api-fuzz.sh and scripts/api-fuzz-ch.sh (sourced, not run): schemathesis
# from PyPI, the work directory and its clean-up, and a TCP relay to gpuvm's Unix socket
# (schemathesis speaks TCP; the relay listens on loopback only).
#
# The sourcing script sets REPO_ROOT first. After `api_fuzz_setup PREFIX`: $st is the
# schemathesis command, $work a fresh directory removed at exit, and every pid added to
# the array `pids` is killed at exit.

api_fuzz_setup() {
    local prefix="$1"
    # In a virtual environment under target/ (Debian's Python refuses system-wide pip
    # installs), unless one is on PATH already.
    st=st
    if ! command -v st >/dev/null; then
        local venv="$REPO_ROOT/target/api-fuzz-venv"
        if [[ ! -x "$venv/bin/st" ]]; then
            python3 -m venv "$venv"
            "$venv/bin/pip" install --quiet --disable-pip-version-check 'schemathesis>=4,<5'
        fi
        st="$venv/bin/st"
    fi
    work="$(mktemp -d "/tmp/$prefix.XXXXXX")"
    pids=()
    trap api_fuzz_cleanup EXIT
    # Relay: one thread pair per TCP connection, to a fresh Unix connection.
    cat >"$work/relay.py" <<'PY'
import socket, sys, threading
listen_port_file, unix_path = sys.argv[1], sys.argv[2]
server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("127.0.0.1", 0))
server.listen(64)
with open(listen_port_file, "w") as f:
    f.write(str(server.getsockname()[1]))
def pump(src, dst):
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass
while True:
    client, _ = server.accept()
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.connect(unix_path)
    except OSError:
        client.close()
        continue
    threading.Thread(target=pump, args=(client, upstream), daemon=True).start()
    threading.Thread(target=pump, args=(upstream, client), daemon=True).start()
PY
}

api_fuzz_cleanup() {
    local pid
    for pid in "${pids[@]}"; do
        kill "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    rm -rf "$work"
}

# Waits for the API socket of the gpuvm started as NAME (pid $gpuvm_pid, socket
# $work/NAME.sock) and starts a relay to it; sets $port.
api_fuzz_relay() {
    local name="$1"
    local socket="$work/$name.sock"
    for _ in $(seq 100); do [[ -S "$socket" ]] && break; sleep 0.05; done
    python3 "$work/relay.py" "$work/$name.port" "$socket" &
    pids+=($!)
    for _ in $(seq 100); do [[ -s "$work/$name.port" ]] && break; sleep 0.05; done
    port="$(cat "$work/$name.port")"
}
