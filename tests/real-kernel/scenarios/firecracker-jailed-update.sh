# about: live update of a jailed Firecracker VM (gpuvm as Firecracker's jailer on a host that runs from its initramfs: the jail moved over / in a mount namespace of its own, uid/gid 1234/1235, an open-files limit, --new-pid-ns: the VMM is pid 1 of its own PID namespace): a Linux guest writes and reads back a block of its disk (an image inside the jail) every quarter second while `gpuvm update` hands the VM to a new process twice, the second time with another binary; each new process runs in the same jail (mount namespace and root), as the same user, with the same limit, as pid 1 of a PID namespace of its own, from the jail's binary (the second binary once it ran), and the jail's pid file names it
. /lib/real-kernel.sh
mkdir -p /tmp/jails
ln -sf /bin/gpuvm /tmp/firecracker
cp /bin/gpuvm /tmp/gpuvm-new
echo "+ gpuvm jailer --id jailed --exec-file /tmp/firecracker --uid 1234 --gid 1235 --new-pid-ns ..."
# The jailer returns once the VMM runs in its PID namespace; the VMM keeps the output file.
gpuvm jailer --id jailed --exec-file /tmp/firecracker --uid 1234 --gid 1235 --chroot-base-dir /tmp/jails \
    --new-pid-ns --resource-limit no-file=1024 -- --api-sock /run/api.sock >/tmp/fc.log 2>&1 ||
    { cat /tmp/fc.log; fail "the jailer failed"; }
root=/tmp/jails/firecracker/jailed/root
wait_for "$root/firecracker.pid" 30
cat "$root/firecracker.pid" >/tmp/fc.pid
first="$(cat /tmp/fc.pid)"
wait_for "$root/run/api.sock" 30
ln -sf "$root/run/api.sock" /tmp/fc.sock
# The guest's files, inside the jail as Firecracker's docs ask; its disk writable by the jail's user.
cp /images/vmlinuz /images/initramfs.cpio "$root/"
truncate -s 16M "$root/disk.img"
chown 1234:1235 "$root/disk.img"
fc PUT /boot-source '{"kernel_image_path": "/vmlinuz", "initrd_path": "/initramfs.cpio",
    "boot_args": "console=ttyS0 quiet panic=-1 inner.checks=ioloop inner.ioloop=80 inner.end=reboot"}'
fc PUT /machine-config '{"vcpu_count": 1, "mem_size_mib": 256}'
fc PUT /drives/data '{"drive_id": "data", "path_on_host": "/disk.img", "is_root_device": false, "is_read_only": false}'
fc PUT /actions '{"action_type": "InstanceStart"}'

round_count() {
    count="$(sed -n 's/.*inner: io round \([0-9][0-9]*\) ok.*/\1/p' /tmp/fc.log | tail -n1)"
    echo "${count:-0}"
}

# field PID NAME: the last value of /proc/PID/status's NAME line (NSpid: the pid in its own namespace).
field() {
    awk -v name="$2:" '$1 == name { print $NF }' "/proc/$1/status"
}

jail_listing="$(ls "$root")"
jail_mnt="$(readlink "/proc/$first/ns/mnt")"
first_pidns="$(readlink "/proc/$first/ns/pid")"
[ "$jail_mnt" != "$(readlink /proc/self/ns/mnt)" ] || abort_gpuvm fc "the jailed VMM shares this mount namespace"
[ "$(field "$first" NSpid)" = 1 ] || abort_gpuvm fc "the jailed VMM is not pid 1 of its namespace"
wait_past fc round_count 2 180 "before the updates"
for n in 1 2; do
    old="$(cat /tmp/fc.pid)"
    before="$(round_count)"
    if [ "$n" = 2 ]; then
        live_update fc "$n" --binary /tmp/gpuvm-new
    else
        live_update fc "$n"
    fi
    new="$(cat /tmp/fc.pid)"
    # The same jail (mount namespace and root), user and limit; pid 1 of a PID namespace of its own; the
    # jail's binary.
    [ "$(cat "$root/firecracker.pid")" = "$new" ] || abort_gpuvm fc "the jail's pid file does not name $new"
    [ "$(readlink "/proc/$new/ns/mnt")" = "$jail_mnt" ] || abort_gpuvm fc "process $new is not in the jail's mount namespace"
    [ "$(field "$new" NSpid)" = 1 ] || abort_gpuvm fc "process $new is not pid 1 of its namespace"
    [ "$(readlink "/proc/$new/ns/pid")" != "$first_pidns" ] || abort_gpuvm fc "process $new is in the first one's namespace"
    [ "$(ls "/proc/$new/root")" = "$jail_listing" ] || abort_gpuvm fc "process $new's root is not the jail"
    [ "$(awk '/^Uid:/ { print $2 "/" $3 }' "/proc/$new/status")" = 1234/1234 ] || abort_gpuvm fc "process $new is not uid 1234"
    grep -q "^Max open files  *1024  *1024" "/proc/$new/limits" || abort_gpuvm fc "process $new lost the open-files limit"
    [ "$(readlink "/proc/$new/exe")" = /firecracker ] || abort_gpuvm fc "process $new runs $(readlink "/proc/$new/exe")"
    fc GET /
    grep -q '"id": *"jailed"' /tmp/fc-call.out && grep -q '"state": *"Running"' /tmp/fc-call.out ||
        abort_gpuvm fc "GET / after update $n: $(cat /tmp/fc-call.out)"
    wait_past fc round_count $((before + 3)) 120 "after update $n"
    echo "jailed update $n: process $old -> $new (pid 1 of its own namespace, uid 1234, in the jail), rounds $before -> $(round_count)"
done
cmp -s "$root/firecracker" /tmp/gpuvm-new || abort_gpuvm fc "the jail's binary is not the second update's"
# The guest reboots after its last round, which ends the VMM.
wait_gpuvm_ended fc "$(cat /tmp/fc.pid)" 240 "the guest's last round"
sed 's/^/  | /' /tmp/fc.log
expect_line /tmp/fc.log "inner: ioloop ok (80 rounds)"
expect_line /tmp/fc.log "inner: checks passed"
for n in 1 40 80; do
    dd if="$root/disk.img" bs=64k skip="$n" count=1 2>/dev/null | grep -q "blk round $n from the Linux guest" ||
        fail "round $n's block is not on the jail's disk"
done
ls -a "$root" | grep -q "update" && fail "the update left $(ls -a "$root" | grep update) in the jail"
echo "a jailed Firecracker VM across two live updates: ok"
