#!/usr/bin/env bash
# Fuzzes gpuvm's Cloud Hypervisor API (/api/v1/, api/src/cloud_hypervisor/) with schemathesis
# (PyPI) against live sockets, from gpuvm's own description of that front end,
# api/cloud-hypervisor-openapi.json. Fails on any 5xx, any status code or body the description
# does not list, or a gpuvm that died, panicked or stopped answering vmm.ping.
#
#   scripts/api-fuzz-ch.sh [GPUVM_BIN]
#
# gpuvm runs as Cloud Hypervisor does under Kata: `cloud-hypervisor --api-socket S`, through a
# symlink named cloud-hypervisor in the work directory. Three instances:
#   1. no VM yet: every operation except
#      - vmm.shutdown and vm.shutdown: they end the gpuvm process (by design), so the rest of
#        the run would only find a dead socket;
#      - vm.delete: Cloud Hypervisor's meaning is to end the VM (gpuvm refuses it today, and
#        tests/compat_docs.rs checks that refusal);
#      - vm.boot: it would boot whatever random VmConfig a fuzzed vm.create left, an unbounded
#        guest of any size and kernel;
#      - vm.restore: a random source_url would load any directory on the host as guest state.
#   2. the embedded test guest created (vm.create), not booted: the pre-boot vm.add-* and
#      vm.remove-device paths, their bodies with known fields only (else nearly all are 400);
#      the same exclusions as 1 (vm.boot would boot what the fuzzed vm.add-* added);
#   3. the embedded test guest, created (vm.create) and booted (vm.boot), running memloop:
#      every operation except the three that end the process or the VM (vmm.shutdown,
#      vm.shutdown, vm.delete) and vm.snapshot, the vm.add-* paths pinned to the work directory
#      (they hot-plug for real); here vm.boot (409) and vm.restore (404 after
#      vm.create) can only be refused. Then vm.snapshot alone, positive cases only, from a copy of
#      the description whose destination_url can only name a scratch directory under the work
#      directory (a random absolute URL would write guest memory anywhere on the host).
# After each run gpuvm must still answer vmm.ping. schemathesis speaks TCP, so a small relay
# forwards 127.0.0.1:PORT to the Unix socket (loopback only), as in scripts/api-fuzz.sh.
# API_FUZZ_EXAMPLES (default 40) bounds the examples per operation.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.." && pwd)"
readonly REPO_ROOT
GPUVM_BIN="${1:-${GPUVM_BIN:-$REPO_ROOT/target/x86_64-unknown-linux-gnu/release/gpuvm}}"
readonly GPUVM_BIN
readonly EXAMPLES="${API_FUZZ_EXAMPLES:-40}"
readonly SPEC="$REPO_ROOT/api/cloud-hypervisor-openapi.json"

# shellcheck source=scripts/api-fuzz-lib.sh
source "$REPO_ROOT/scripts/api-fuzz-lib.sh"
api_fuzz_setup gpuvm-api-fuzz-ch

ln -s "$GPUVM_BIN" "$work/cloud-hypervisor"
"$GPUVM_BIN" guest-image --output "$work/guest.elf"

# One request through the relay: prints the status code and the body.
api_body() {
    local method="$1" route="$2" body="${3:-}"
    python3 - "$port" "$method" "$route" "$body" <<'PY'
import http.client, sys
port, method, route, body = sys.argv[1:5]
connection = http.client.HTTPConnection("127.0.0.1", int(port), timeout=30)
connection.request(method, route, body=body or None,
                   headers={"Content-Type": "application/json"} if body else {})
response = connection.getresponse()
print(response.status, response.read().decode(errors="replace"))
PY
}

# One request through the relay: prints the status code.
api() {
    api_body "$@" | cut -d' ' -f1
}

# Starts `cloud-hypervisor --api-socket` as NAME and a relay to it; sets $port and $gpuvm_pid.
start() {
    local name="$1"
    local socket="$work/$name.sock"
    # Seccomp filters are on by default: a blocked call ends gpuvm with 148 and one line.
    "$work/cloud-hypervisor" --api-socket "$socket" >"$work/$name.out" 2>"$work/$name.err" &
    gpuvm_pid=$!
    pids+=("$gpuvm_pid")
    api_fuzz_relay "$name"
}

# Fails unless gpuvm NAME is alive, has not panicked and answers vmm.ping with 200.
alive() {
    local name="$1" code
    if ! kill -0 "$gpuvm_pid" 2>/dev/null; then
        echo "api-fuzz-ch: error: gpuvm ($name) died during the run" >&2
        cat "$work/$name.err" >&2
        exit 1
    fi
    if grep -q panicked "$work/$name.err"; then
        echo "api-fuzz-ch: error: gpuvm ($name) panicked" >&2
        cat "$work/$name.err" >&2
        exit 1
    fi
    code="$(api GET /api/v1/vmm.ping)"
    if [[ "$code" != 200 ]]; then
        echo "api-fuzz-ch: error: gpuvm ($name) answers vmm.ping with $code after the run" >&2
        exit 1
    fi
}

# Runs schemathesis from SPEC against instance NAME with the extra options given.
fuzz() {
    local name="$1" spec="$2"
    shift 2
    echo "api-fuzz-ch: $name"
    # schemathesis keeps its example database in the working directory: keep it in $work.
    (cd "$work" && timeout --kill-after=10s 600 "$st" run "$spec" \
        --url "http://127.0.0.1:$port" \
        --checks not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance \
        --max-examples "$EXAMPLES" --seed 7 --request-timeout 30 \
        --exclude-path /api/v1/vmm.shutdown --exclude-path /api/v1/vm.shutdown \
        --exclude-path /api/v1/vm.delete "$@")
    alive "$name"
}

start no-vm
fuzz no-vm "$SPEC" --exclude-path /api/v1/vm.boot --exclude-path /api/v1/vm.restore

vm_config="{\"payload\": {\"kernel\": \"$work/guest.elf\", \"cmdline\": \"memloop 8M 1 0\"},
            \"cpus\": {\"boot_vcpus\": 1, \"max_vcpus\": 1}, \"memory\": {\"size\": 67108864}}"
# Sends ROUTE (PUT, with the test guest's VmConfig) to instance NAME; fails unless it is 204.
put() {
    local name="$1" route="$2" code
    code="$(api PUT "$route" "$vm_config")"
    if [[ "$code" != 204 ]]; then
        echo "api-fuzz-ch: error: PUT $route ($name) answered $code, not 204" >&2
        cat "$work/$name.err" >&2
        exit 1
    fi
}

# The devices' bodies with their known fields only: random extra fields are refused (400)
# unless at their defaults, so with them hardly any vm.add-* would get past the refusal.
python3 - "$SPEC" "$work/known-fields-spec.json" <<'PY'
import json, sys
spec_path, out_path = sys.argv[1:3]
with open(spec_path) as f:
    spec = json.load(f)
for name in ("DiskConfig", "NetConfig", "FsConfig", "VsockConfig", "DeviceConfig", "VmAddUserDevice"):
    spec["components"]["schemas"][name]["additionalProperties"] = False
with open(out_path, "w") as f:
    json.dump(spec, f)
PY
start created
put created /api/v1/vm.create
fuzz created "$work/known-fields-spec.json" --exclude-path /api/v1/vm.boot --exclude-path /api/v1/vm.restore
# What the fuzzed pre-boot vm.add-* got in (a count of 0 everywhere means none got past 400).
api_body GET /api/v1/vm.info | python3 -c '
import json, sys
config = json.loads(sys.stdin.read().partition(" ")[2])["config"]
counts = ", ".join(f"{len(config.get(k) or [])} {k}" for k in ("disks", "net", "fs", "devices"))
vsock = "a vsock" if config.get("vsock") else "no vsock"
print(f"api-fuzz-ch: created: the fuzzed VmConfig holds {counts}, {vsock}")'

# After boot the vm.add-* routes hot-plug for real: a device's paths are pinned to the work
# directory (a random path would attach any host file as a disk, bind a socket anywhere, or
# connect to any host socket) and a tap's name to one made and gone with this run.
truncate -s 1M "$work/hotplug-disk.img"
python3 - "$SPEC" "$work/running-spec.json" "$work" <<'PY'
import json, sys
spec_path, out_path, work = sys.argv[1:4]
with open(spec_path) as f:
    spec = json.load(f)
schemas = spec["components"]["schemas"]
# Pinned in the requests only (copies of the schemas): vm.info's answer holds the same
# configurations, with nulls where a request left a field out.
pinned = {
    "vm.add-disk": ("DiskConfig", {"path": f"{work}/hotplug-disk.img",
                                   "vhost_socket": f"{work}/none-blk.sock"}),
    "vm.add-fs": ("FsConfig", {"socket": f"{work}/none-fs.sock"}),
    "vm.add-vsock": ("VsockConfig", {"socket": f"{work}/hotplug-vsock.sock"}),
    "vm.add-net": ("NetConfig", {"tap": "gpuvmfuzz0"}),
    "vm.add-user-device": ("VmAddUserDevice", {"socket": f"{work}/none-user.sock"}),
}
for route, (name, fields) in pinned.items():
    copy = json.loads(json.dumps(schemas[name]))
    for field, value in fields.items():
        copy["properties"][field] = {"const": value}
    schemas[name + "Pinned"] = copy
    body = spec["paths"][f"/api/v1/{route}"]["put"]["requestBody"]["content"]["application/json"]
    body["schema"] = {"$ref": f"#/components/schemas/{name}Pinned"}
with open(out_path, "w") as f:
    json.dump(spec, f)
PY

start running
put running /api/v1/vm.create
put running /api/v1/vm.boot
fuzz running "$work/running-spec.json" --exclude-path /api/v1/vm.snapshot

# vm.snapshot with destination_url pinned to a scratch directory.
python3 - "$SPEC" "$work/snapshot-spec.json" "file://$work/snapshot" <<'PY'
import json, sys
spec_path, out_path, url = sys.argv[1:4]
with open(spec_path) as f:
    spec = json.load(f)
spec["components"]["schemas"]["VmSnapshotConfig"]["properties"]["destination_url"] = {"const": url}
with open(out_path, "w") as f:
    json.dump(spec, f)
PY
fuzz running "$work/snapshot-spec.json" --include-path /api/v1/vm.snapshot --mode positive
# Some of those snapshots were taken, not only refused.
if [[ ! -f "$work/snapshot/state" ]]; then
    echo "api-fuzz-ch: error: no vm.snapshot wrote $work/snapshot/state" >&2
    exit 1
fi

# A hot-plug that works (the fuzzed ones cannot: no device answers on a random socket): the
# emulated GPU over vfio-user, whose 200 must be the description's PciDeviceInfo. Its
# vm.remove-device is not tried: memloop does not eject, so gpuvm answers 504 after 20 s.
emu_gpu="$(dirname "$GPUVM_BIN")/gpuvm-emu-gpu"
if [[ -x "$emu_gpu" ]]; then
    "$emu_gpu" --socket "$work/emu-gpu.sock" 2>"$work/emu-gpu.err" &
    pids+=($!)
    for _ in $(seq 100); do [[ -S "$work/emu-gpu.sock" ]] && break; sleep 0.05; done
    answer="$(api_body PUT /api/v1/vm.add-user-device "{\"socket\": \"$work/emu-gpu.sock\", \"id\": \"gpu0\"}")"
    python3 - "$SPEC" "$answer" <<'PY'
import json, re, sys
spec_path, answer = sys.argv[1:3]
with open(spec_path) as f:
    schema = json.load(f)["components"]["schemas"]["PciDeviceInfo"]
status, _, body = answer.partition(" ")
if status != "200":
    sys.exit(f"api-fuzz-ch: error: vm.add-user-device of the emulated GPU answered {answer}")
info = json.loads(body)
for field in schema["required"]:
    if not isinstance(info.get(field), str):
        sys.exit(f"api-fuzz-ch: error: {body} has no string {field} (PciDeviceInfo)")
if not re.search(schema["properties"]["bdf"]["pattern"], info["bdf"]) or info["id"] != "gpu0":
    sys.exit(f"api-fuzz-ch: error: {body} is not gpu0's PciDeviceInfo")
print(f"api-fuzz-ch: emulated GPU hot-plugged: {body}")
PY
    alive running
else
    echo "api-fuzz-ch: $emu_gpu not built: no hot-plug that works tried"
fi
echo "api-fuzz-ch: no 5xx, every answer as described, gpuvm alive and answering vmm.ping"
