# about: live update of a VM with kernel VFIO through iommufd: edu's DMA and MSI run in a loop while `gpuvm update` hands the VM to a new process, twice; the device is taken over, not reset or mapped again
# qemu: -device edu,addr=0x4
# kernel: iommufd
. /lib/real-kernel.sh
[ -c /dev/iommu ] || fail "no /dev/iommu (is CONFIG_IOMMUFD on in the outer kernel?)"
bdf="$(pci_find 1234 11e8)" || fail "no edu device"
group="$(vfio_bind "$bdf")"
[ -d "/sys/bus/pci/devices/$bdf/vfio-dev" ] || fail "$bdf has no VFIO cdev (CONFIG_VFIO_DEVICE_CDEV)"
echo "edu at $bdf, $group, /dev/iommu"

log=/tmp/edu.log
# Every gpuvm that runs the VM writes $log: each new process takes over the first one's stdout and
# stderr. /tmp/edu.pid names the one that runs it now (abort_gpuvm ends that one).
start_gpuvm edu run --log-level info --memory 256M --gpu "$bdf" --api-sock /tmp/api.sock --cmdline "edu loop"
first="$(cat /tmp/edu.pid)"
wait_for /tmp/api.sock 30
gpuvm ctl --api-sock /tmp/api.sock start || abort_gpuvm edu "InstanceStart failed"

# The guest's latest `edu: loop N ok` count (0 before the first).
loop_count() {
    count="$(sed -n 's/.*edu: loop \([0-9][0-9]*\) ok.*/\1/p' "$log" | tail -n1)"
    echo "${count:-0}"
}

# rounds_past COUNT SECONDS: whether the guest reports more than COUNT rounds within SECONDS.
rounds_past() {
    deadline=$(($(cut -d. -f1 /proc/uptime) + $2))
    while [ "$(loop_count)" -le "$1" ]; do
        [ "$(cut -d. -f1 /proc/uptime)" -lt "$deadline" ] || return 1
        sleep 0.2
    done
}

# wait_rounds_past COUNT SECONDS WHAT: waits until the guest reports more than COUNT rounds, failing
# if it reports a failure, if the gpuvm running it ends, or after SECONDS.
wait_rounds_past() {
    deadline=$(($(cut -d. -f1 /proc/uptime) + $2))
    while [ "$(loop_count)" -le "$1" ]; do
        grep -q "edu: FAIL" "$log" && abort_gpuvm edu "the guest failed $3"
        running "$(cat /tmp/edu.pid)" || abort_gpuvm edu "gpuvm ended $3"
        [ "$(cut -d. -f1 /proc/uptime)" -lt "$deadline" ] ||
            abort_gpuvm edu "no more than $1 loop rounds $2 s $3 (at $(loop_count))"
        sleep 0.2
    done
}

wait_rounds_past 0 180 "after InstanceStart"
expect_line "$log" "kernel VFIO: iommufd cdev API"
expect_line "$log" "edu: msi ok"
# The loop's pace, before any update (each round a DMA round trip and an MSI).
rounds_from="$(loop_count)"
from="$(uptime_s)"
wait_rounds_past $((rounds_from + 15)) 120 "in its first rounds"
rounds="$(($(loop_count) - rounds_from))"
seconds="$(seconds_between "$from" "$(uptime_s)")"
echo "the guest's edu loop runs: $rounds rounds in $seconds s"
figure "edu loop under kernel VFIO (iommufd), nested: $(awk -v r="$rounds" -v s="$seconds" 'BEGIN { printf "%.0f", r / s }') rounds/s (a DMA round trip of 2048 bytes and an MSI each)"

for n in 1 2; do
    old="$(cat /tmp/edu.pid)"
    lines_before="$(wc -l <"$log")"
    rounds_before="$(loop_count)"
    echo "+ gpuvm update --pid $old (update $n, at loop round $rounds_before)"
    # GPUVM_LOG=info: the new process (which inherits this environment, not the first one's
    # --log-level) logs what it took over.
    if ! GPUVM_LOG=info gpuvm update --pid "$old" >"/tmp/update-$n.out" 2>&1; then
        sed 's/^/  update: /' "/tmp/update-$n.out"
        # A failed update leaves the VM running in the old process, its device working.
        at="$(loop_count)"
        if rounds_past $((at + 4)) 15 && ! grep -q "edu: FAIL" "$log"; then
            echo "after the failed update the loop runs on in process $old (round $(loop_count))"
        else
            echo "after the failed update the loop stopped at round $(loop_count)"
        fi
        abort_gpuvm edu "live update $n of process $old refused or failed"
    fi
    cat "/tmp/update-$n.out"
    new="$(sed -n 's/.*runs in process \([0-9][0-9]*\).*/\1/p' "/tmp/update-$n.out")"
    [ -n "$new" ] && [ "$new" != "$old" ] || abort_gpuvm edu "update $n named no new process"
    echo "$new" >/tmp/edu.pid

    # The old process ends (the first one with status 0: it handed its VM over), the new one runs.
    wait_ended "$old" 30 || abort_gpuvm edu "the old gpuvm $old still runs 30 s after update $n"
    if [ "$old" = "$first" ]; then
        status=0
        wait "$old" || status=$?
        [ "$status" = 0 ] || abort_gpuvm edu "the first gpuvm exited with status $status after handing its VM over"
    fi
    running "$new" || abort_gpuvm edu "the new gpuvm $new does not run after update $n"

    # The device keeps working under the new process alone: DMA and MSI, round after round.
    rounds_after="$(loop_count)"
    wait_rounds_past $((rounds_after + 16)) 120 "after update $n"
    echo "update $n: process $old -> $new; the loop went on from round $rounds_after (the old process gone; $rounds_before when the update began) to $(loop_count)"

    # The new process took the device over: no reset, and guest RAM not DMA-mapped again.
    # (What the new process logged before it took the VM's stdout and stderr over went to gpuvm
    # update's.)
    { tail -n +"$((lines_before + 1))" "$log"; cat "/tmp/update-$n.out"; } >"/tmp/after-$n.log"
    grep "kernel VFIO" "/tmp/after-$n.log" | grep -q "taken over from the old process (no reset, no DMA map" ||
        abort_gpuvm edu "update $n: no 'kernel VFIO ... taken over from the old process (no reset, no DMA map' line"
    grep "kernel VFIO" "/tmp/after-$n.log" | grep "taken over from the old process" | sed "s/^/update $n: /"
    # (A handed-over context accounts for the mappings it took over under a name of its own.)
    grep -E "DMA map .*: (start|done)," "/tmp/after-$n.log" | sed "s/^/update $n: /"
    grep -qF "DMA map kernel VFIO (iommufd IOAS): start" "/tmp/after-$n.log" &&
        abort_gpuvm edu "update $n: the new gpuvm DMA-mapped guest RAM again"

    # The downtime: the new process's pause (its stderr, paused_to_run_us=) and the hand-over's length
    # (gpuvm update's answer).
    paused_us="$(sed -n 's/.*paused_to_run_us=\([0-9][0-9]*\).*/\1/p' "/tmp/after-$n.log" | tail -n1)"
    [ -n "$paused_us" ] || abort_gpuvm edu "update $n: the new gpuvm reported no paused_to_run_us"
    handover_ms="$(sed -n 's/.*the hand-over took \([0-9][0-9]*\) ms.*/\1/p' "/tmp/update-$n.out")"
    figure "live update $n of a VM with kernel VFIO (edu, iommufd): guest paused $((paused_us / 1000)) ms (paused_to_run_us=$paused_us), hand-over ${handover_ms:-?} ms"
done

grep -q "edu: loop note" "$log" && grep "edu: loop note" "$log"
# The VM ends through the API the last process serves.
last="$(cat /tmp/edu.pid)"
gpuvm ctl --api-sock /tmp/api.sock ctrl-alt-del || abort_gpuvm edu "SendCtrlAltDel to process $last failed"
deadline=$(($(cut -d. -f1 /proc/uptime) + 30))
while running "$last" && [ "$(cut -d. -f1 /proc/uptime)" -lt "$deadline" ]; do
    sleep 0.2
done
running "$last" && abort_gpuvm edu "gpuvm $last still runs 30 s after Ctrl-Alt-Del"
sed 's/^/  | /' "$log"
grep -q "edu: FAIL" "$log" && fail "the guest failed"
echo "live update of a VM with kernel VFIO through iommufd, twice, edu's DMA and MSI running throughout: ok"
