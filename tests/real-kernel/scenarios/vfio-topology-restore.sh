# about: a VM with PCIe root ports snapshotted and restored with its GPU (passthrough guest_release): edu hot-plugged into a root port of a Linux guest (pciehp), its agent (vsock) releases it, gpuvm ejects it (attention button, Linux powers the slot off), snapshots, gives it back behind the port; a new gpuvm restores the ports from the snapshot, edu goes back behind one, Linux's pciehp brings it up there and the agent resumes it
# qemu: -device edu,addr=0x4
# Each root port for hot-plug has a 512 GiB prefetchable window: 48 physical address bits (as linux-pciehp).
# qemu: -cpu qemu64,+svm,+npt,phys-bits=48
. /lib/real-kernel.sh
bdf="$(pci_find 1234 11e8)" || fail "no edu device"
vfio_bind "$bdf" >/dev/null
# pciehp waits 5 s after the attention button before it lets a device go: give the eject room.
export GPUVM_HOTPLUG_EJECT_TIMEOUT_MS=120000
start_gpuvm linux run --log-level info --api-sock /tmp/api.sock --kernel /images/vmlinuz \
    --initrd /images/initramfs.cpio --memory 256M --vsock cid=3,uds=/tmp/vsock.sock --pcie-root-ports 2 \
    --cmdline "console=ttyS0 panic=-1 inner.checks=agent inner.end=hold"
wait_for /tmp/api.sock 30
gpuvm ctl --api-sock /tmp/api.sock start || abort_gpuvm linux "InstanceStart failed"
wait_log linux "vsock-tool: listening on vsock port 1027" 120
gpuvm ctl --api-sock /tmp/api.sock add-gpu --id edu0 --host-bdf "$bdf" >/tmp/plug.out ||
    abort_gpuvm linux "PUT /gpus/edu0 failed: $(cat /tmp/plug.out)"
cat /tmp/plug.out
guest_bdf="$(sed -n 's/.*"bdf": *"\([^"]*\)".*/\1/p' /tmp/plug.out)"
case "$guest_bdf" in
0000:0[1-9a-f]:00.0) ;;
*) abort_gpuvm linux "edu0 is not behind a root port: $(cat /tmp/plug.out)" ;;
esac

gpuvm ctl --api-sock /tmp/api.sock raw PUT /snapshot/create \
    '{"snapshot_path": "/tmp/snap", "passthrough": "guest_release"}' >/tmp/snapshot.out 2>&1 ||
    abort_gpuvm linux "the guest-release snapshot failed: $(cat /tmp/snapshot.out)"
cat /tmp/snapshot.out
grep -q '"released_gpus": *\["edu0"\]' /tmp/snapshot.out || abort_gpuvm linux "edu0 was not released"
wait_log linux "gpu-hook: resumed edu0" 120
for line in "agent: RELEASE edu0 $guest_bdf" "gpu-hook: released edu0" "gpu-hook: $guest_bdf ejected"; do
    expect_line /tmp/linux.log "$line"
done
pid="$(cat /tmp/linux.pid)"
kill -9 "$pid"
wait "$pid" 2>/dev/null
sed 's/^/  | /' /tmp/linux.log
rm -f /tmp/vsock.sock /tmp/api.sock

# A new gpuvm restores the snapshot: the root ports come back from it (the command line names none).
start_gpuvm restored run --log-level info --api-sock /tmp/api.sock
wait_for /tmp/api.sock 30
gpuvm ctl --api-sock /tmp/api.sock snapshot-load --dir /tmp/snap --resume ||
    abort_gpuvm restored "the restore failed"
gpuvm ctl --api-sock /tmp/api.sock add-gpu --id edu0 --host-bdf "$bdf" >/tmp/plug.out 2>&1 ||
    abort_gpuvm restored "giving edu0 back failed: $(cat /tmp/plug.out)"
cat /tmp/plug.out
grep -q "\"bdf\": *\"$guest_bdf\"" /tmp/plug.out || abort_gpuvm restored "edu0 came back elsewhere than $guest_bdf"
grep -q '"resumed": *true' /tmp/plug.out || abort_gpuvm restored "the agent did not resume edu0"
wait_log restored "gpu-hook: resumed edu0" 120
if grep -q "FAIL" /tmp/restored.log; then
    abort_gpuvm restored "the restored guest reported a failure"
fi
pid="$(cat /tmp/restored.pid)"
kill -9 "$pid"
wait "$pid" 2>/dev/null
sed 's/^/  | /' /tmp/restored.log
echo "a VM with PCIe root ports restored with its GPU behind a port (guest release, kernel VFIO): ok"
