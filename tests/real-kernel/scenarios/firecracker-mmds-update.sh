# about: live update of a Firecracker VM with MMDS: gpuvm as `firecracker` runs a Linux guest that took one MMDS V2 token and reads its metadata with it every half second while `gpuvm update` hands the VM to a new process, twice; the token, the metadata and Firecracker's API go along
. /lib/real-kernel.sh
start_fc_mmds_vm mmdsloop --id fc-live
first="$(cat /tmp/fc.pid)"

# The guest's latest round read with its one token (0 before the first).
round_count() {
    count="$(sed -n 's/.*inner: mmds round \([0-9][0-9]*\) ok.*/\1/p' /tmp/fc.log | tail -n1)"
    echo "${count:-0}"
}

# wait_rounds_past COUNT SECONDS WHAT: until the guest reports more than COUNT rounds; fails if the guest
# fails, if the gpuvm running it ends, or after SECONDS.
wait_rounds_past() {
    wait_past fc round_count "$1" "$2" "$3"
}

wait_rounds_past 2 180 "after InstanceStart"
for n in 1 2; do
    old="$(cat /tmp/fc.pid)"
    before="$(round_count)"
    echo "+ gpuvm update --pid $old (update $n, at round $before)"
    GPUVM_LOG=info gpuvm update --pid "$old" >"/tmp/update-$n.out" 2>&1 ||
        { sed 's/^/  update: /' "/tmp/update-$n.out"; abort_gpuvm fc "live update $n of process $old failed"; }
    cat "/tmp/update-$n.out"
    new="$(sed -n 's/.*runs in process \([0-9][0-9]*\).*/\1/p' "/tmp/update-$n.out")"
    [ -n "$new" ] && [ "$new" != "$old" ] || abort_gpuvm fc "update $n named no new process"
    echo "$new" >/tmp/fc.pid
    wait_ended "$old" 30 || abort_gpuvm fc "the old gpuvm $old still runs 30 s after update $n"
    # The new process serves Firecracker's API under the same instance id, and the same MMDS.
    fc GET /
    grep -q '"id": *"fc-live"' /tmp/fc-call.out && grep -q '"state": *"Running"' /tmp/fc-call.out ||
        abort_gpuvm fc "GET / after update $n: $(cat /tmp/fc-call.out)"
    fc GET /mmds
    grep -q 'i-gpuvm-42' /tmp/fc-call.out || abort_gpuvm fc "GET /mmds after update $n: $(cat /tmp/fc-call.out)"
    after="$(round_count)"
    wait_rounds_past $((after + 5)) 120 "after update $n"
    echo "update $n: process $old -> $new; the guest read its metadata with the same token from round $before to $(round_count)"
done
# The guest reboots after its last round, which ends the VMM.
wait_ended "$(cat /tmp/fc.pid)" 180 || abort_gpuvm fc "gpuvm still runs 180 s after the guest's last round"
wait "$first" || fail "the first gpuvm exited with status $? after handing its VM over"
sed 's/^/  | /' /tmp/fc.log
expect_line /tmp/fc.log "inner: mmdsloop ok"
expect_line /tmp/fc.log "inner: checks passed"
echo "MMDS V2 token and metadata across two live updates of a Firecracker VM: ok"
