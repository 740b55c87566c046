# about: a GPU snapshot through the guest (passthrough guest_release): edu hot-plugged into a Linux guest, its agent (vsock) releases it, gpuvm ejects it, snapshots, gives it back; a new gpuvm restores and the agent resumes it
# qemu: -device edu,addr=0x4
. /lib/real-kernel.sh
bdf="$(pci_find 1234 11e8)" || fail "no edu device"
vfio_bind "$bdf" >/dev/null
start_gpuvm linux run --log-level info --api-sock /tmp/api.sock --kernel /images/vmlinuz \
    --initrd /images/initramfs.cpio --memory 256M --vsock cid=3,uds=/tmp/vsock.sock \
    --cmdline "console=ttyS0 quiet panic=-1 inner.checks=agent inner.end=hold"
wait_for /tmp/api.sock 30
gpuvm ctl --api-sock /tmp/api.sock start || abort_gpuvm linux "InstanceStart failed"
wait_log linux "vsock-tool: listening on vsock port 1027" 120
gpuvm ctl --api-sock /tmp/api.sock add-gpu --id edu0 --host-bdf "$bdf" >/tmp/plug.out ||
    abort_gpuvm linux "PUT /gpus/edu0 failed: $(cat /tmp/plug.out)"
guest_bdf="$(sed -n 's/.*"bdf": *"\([^"]*\)".*/\1/p' /tmp/plug.out)"
[ -n "$guest_bdf" ] || abort_gpuvm linux "the hot-plug named no guest address: $(cat /tmp/plug.out)"

# The snapshot asks the agent to release edu0, ejects it, snapshots the VM without it, plugs it back and
# tells the agent; the guest's hook checks the device answers at its address each time.
gpuvm ctl --api-sock /tmp/api.sock raw PUT /snapshot/create \
    '{"snapshot_path": "/tmp/snap", "passthrough": "guest_release"}' >/tmp/snapshot.out 2>&1 ||
    abort_gpuvm linux "the guest-release snapshot failed: $(cat /tmp/snapshot.out)"
cat /tmp/snapshot.out
grep -q '"released_gpus": *\["edu0"\]' /tmp/snapshot.out || abort_gpuvm linux "edu0 was not released"
grep -q '"reattached_gpus": *\[{' /tmp/snapshot.out || abort_gpuvm linux "edu0 was not given back"
wait_log linux "gpu-hook: resumed edu0" 120
for line in "agent: RELEASE edu0 $guest_bdf" "gpu-hook: released edu0" "gpu-hook: $guest_bdf ejected" \
    "agent: ATTACH edu0"; do
    expect_line /tmp/linux.log "$line"
done
figure "guest-release snapshot: release $(sed -n 's/.*"release_ms": *\([0-9]*\).*/\1/p' /tmp/snapshot.out) ms, total $(sed -n 's/.*"total_ms": *\([0-9]*\).*/\1/p' /tmp/snapshot.out) ms (edu, 256 MiB guest)"
pid="$(cat /tmp/linux.pid)"
kill -9 "$pid"
wait "$pid" 2>/dev/null
sed 's/^/  | /' /tmp/linux.log
rm -f /tmp/vsock.sock /tmp/api.sock

# A new gpuvm restores the snapshot (the guest runs without its GPU) and is given edu again: the agent
# hears of it over the restored vsock device and resumes it.
start_gpuvm restored run --log-level info --api-sock /tmp/api.sock
wait_for /tmp/api.sock 30
gpuvm ctl --api-sock /tmp/api.sock snapshot-load --dir /tmp/snap --resume ||
    abort_gpuvm restored "the restore failed"
gpuvm ctl --api-sock /tmp/api.sock add-gpu --id edu0 --host-bdf "$bdf" >/tmp/plug.out 2>&1 ||
    abort_gpuvm restored "giving edu0 back failed: $(cat /tmp/plug.out)"
cat /tmp/plug.out
grep -q '"resumed": *true' /tmp/plug.out || abort_gpuvm restored "the agent did not resume edu0"
wait_log restored "gpu-hook: resumed edu0" 120
if grep -q "FAIL" /tmp/restored.log; then
    abort_gpuvm restored "the restored guest reported a failure"
fi
pid="$(cat /tmp/restored.pid)"
kill -9 "$pid"
wait "$pid" 2>/dev/null
sed 's/^/  | /' /tmp/restored.log
echo "guest-release snapshot and restore with kernel VFIO: ok"
