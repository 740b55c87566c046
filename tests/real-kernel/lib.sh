# Shell helpers of the real-kernel tier, sourced by the outer machine's /init, its scenarios and the /init
# of gpuvm's Linux guests (busybox sh: no bash-isms).

# A request gpuvm never answers fails after 240 s (`gpuvm ctl` would wait 600, for snapshots of large
# guests), well inside a scenario's limit, so the scenario says which request it was.
export GPUVM_CTL_TIMEOUT_S=240

uptime_s() {
    cut -d' ' -f1 /proc/uptime
}

# figure TEXT: one of the tier's figures (the runner and bench/real-kernel collect `figure:` lines).
figure() {
    echo "figure: $*"
}

fail() {
    echo "FAIL: $*"
    exit 1
}

# Seconds (two decimals) between two /proc/uptime readings.
seconds_between() {
    awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'
}

# pci_find VENDOR DEVICE [N]: the address of the Nth (default 1st) PCI function with these ids.
pci_find() {
    n=0
    for dev in /sys/bus/pci/devices/*; do
        [ "$(cat "$dev/vendor")" = "0x$1" ] && [ "$(cat "$dev/device")" = "0x$2" ] || continue
        n=$((n + 1))
        if [ "$n" = "${3:-1}" ]; then
            basename "$dev"
            return 0
        fi
    done
    return 1
}

# vfio_bind BDF: hands the function to vfio-pci and prints its IOMMU group's /dev/vfio node.
vfio_bind() {
    dev="/sys/bus/pci/devices/$1"
    [ -e "$dev/iommu_group" ] || fail "$1 has no IOMMU group (is the emulated IOMMU on?)"
    echo vfio-pci >"$dev/driver_override"
    [ -e "$dev/driver" ] && echo "$1" >"$dev/driver/unbind"
    echo "$1" >/sys/bus/pci/drivers_probe
    [ "$(basename "$(readlink "$dev/driver")")" = vfio-pci ] || fail "$1 did not bind to vfio-pci"
    group="$(basename "$(readlink "$dev/iommu_group")")"
    [ -c "/dev/vfio/$group" ] || fail "no /dev/vfio/$group for $1"
    echo "/dev/vfio/$group"
}

# run_gpuvm NAME SECONDS ARGS...: runs gpuvm with ARGS, its output in /tmp/NAME.log (also printed,
# indented); returns gpuvm's exit status (137: it ran past SECONDS and was killed, after a report of what
# it was doing).
run_gpuvm() {
    name="$1"
    limit="$2"
    shift 2
    start_gpuvm "$name" "$@"
    wait_gpuvm "$name" "$limit"
}

# report_stuck_gpuvm NAME PID: what a gpuvm that ran past its limit was doing, for the log: each
# thread's state, wait channel and kernel stack, and KVM's exit counters for its vCPUs sampled twice a
# second apart (a guest spinning exits steadily, a halted one waits for an interrupt, a stuck vCPU
# thread does neither). A line says whether its guest printed anything: an inner Linux silent from the
# start (stuck before its console) is told apart from one that stopped later.
report_stuck_gpuvm() {
    name="$1"
    pid="$2"
    echo "gpuvm ($name) ran past its limit; its threads:"
    for task in /proc/"$pid"/task/*; do
        printf '  thread %s %s: state %s, waiting in %s\n' "${task##*/}" "$(cat "$task/comm" 2>/dev/null)" \
            "$(cut -d' ' -f3 "$task/stat" 2>/dev/null)" "$(cat "$task/wchan" 2>/dev/null)"
        sed 's/^/      /' "$task/stack" 2>/dev/null | head -n 12
    done
    [ -d /sys/kernel/debug/kvm ] || mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null
    for round in 1 2; do
        for vm in /sys/kernel/debug/kvm/"$pid"-*; do
            [ -d "$vm" ] || continue
            printf '  kvm (sample %s): exits %s halt_exits %s io_exits %s mmio_exits %s irq_injections %s\n' \
                "$round" "$(cat "$vm/exits" 2>/dev/null)" "$(cat "$vm/halt_exits" 2>/dev/null)" \
                "$(cat "$vm/io_exits" 2>/dev/null)" "$(cat "$vm/mmio_exits" 2>/dev/null)" \
                "$(cat "$vm/irq_injections" 2>/dev/null)"
        done
        [ "$round" = 2 ] || sleep 1
    done
    if grep -q '^inner: ' "/tmp/$name.log"; then
        echo "gpuvm ($name): its guest stopped after printing"
    else
        echo "gpuvm ($name): its guest printed nothing (inner guest silent)"
    fi
}

# start_gpuvm NAME ARGS...: starts gpuvm in the background, its output in /tmp/NAME.log; wait_gpuvm NAME
# SECONDS then waits for it (killing it past SECONDS), prints the log and returns its status.
start_gpuvm() {
    name="$1"
    shift
    echo "+ gpuvm $* &"
    gpuvm "$@" >"/tmp/$name.log" 2>&1 &
    echo $! >"/tmp/$name.pid"
}

wait_gpuvm() {
    name="$1"
    pid="$(cat "/tmp/$name.pid")"
    deadline=$(($(cut -d. -f1 /proc/uptime) + $2))
    while kill -0 "$pid" 2>/dev/null && [ "$(cut -d. -f1 /proc/uptime)" -lt "$deadline" ]; do
        sleep 0.2
    done
    if kill -0 "$pid" 2>/dev/null; then
        report_stuck_gpuvm "$name" "$pid"
        kill -9 "$pid" 2>/dev/null && echo "gpuvm ($name) ran past $2 s; killed"
    fi
    status=0
    wait "$pid" || status=$?
    sed 's/^/  | /' "/tmp/$name.log"
    echo "gpuvm ($name) exited with status $status"
    return "$status"
}

# running PID: whether process PID runs (a zombie has ended: a first gpuvm is the scenario's child, the
# processes a live update started are init's).
running() {
    [ -r "/proc/$1/stat" ] && [ "$(cut -d' ' -f3 "/proc/$1/stat" 2>/dev/null)" != Z ]
}

# live_update NAME N [ARGS...]: `gpuvm update` (update number N, ARGS passed on) of the gpuvm NAME runs, which
# must hand its VM to a new process: /tmp/NAME.pid names that one afterwards, and the old one has ended.
live_update() {
    name="$1"
    n="$2"
    shift 2
    old="$(cat "/tmp/$name.pid")"
    echo "+ gpuvm update --pid $old $* (update $n)"
    GPUVM_LOG=info gpuvm update --pid "$old" "$@" >"/tmp/update-$n.out" 2>&1 ||
        { sed 's/^/  update: /' "/tmp/update-$n.out"; abort_gpuvm "$name" "live update $n of process $old failed"; }
    cat "/tmp/update-$n.out"
    new="$(sed -n 's/.*runs in process \([0-9][0-9]*\).*/\1/p' "/tmp/update-$n.out")"
    [ -n "$new" ] && [ "$new" != "$old" ] || abort_gpuvm "$name" "update $n named no new process"
    echo "$new" >"/tmp/$name.pid"
    wait_ended "$old" 30 || abort_gpuvm "$name" "the old gpuvm $old still runs 30 s after update $n"
    echo "update $n: process $old -> $new"
}

# live_update_logged NAME N [ARGS...]: live_update, then /tmp/after-N.log holds what the update logged: the
# lines the gpuvm log NAME gained during it (the new process writes to the old one's output) and the update's
# own output.
live_update_logged() {
    local log_lines
    log_lines="$(wc -l <"/tmp/$1.log")"
    live_update "$@"
    { tail -n +"$((log_lines + 1))" "/tmp/$1.log"; cat "/tmp/update-$2.out"; } >"/tmp/after-$2.log"
}

# update_paused_ms N: how long update N paused the guest, in ms, from the new process's paused_to_run_us
# (in /tmp/after-N.log); 0 if it printed none.
update_paused_ms() {
    local paused_us
    paused_us="$(sed -n 's/.*paused_to_run_us=\([0-9][0-9]*\).*/\1/p' "/tmp/after-$1.log" | tail -n1)"
    echo $((${paused_us:-0} / 1000))
}

# live_update_old_dies NAME [ARGS...]: `gpuvm update` (ARGS passed on) of the gpuvm NAME (the scenario's child, started with
# GPUVM_TEST_UPDATE_OLD_DIES=1), whose process then dies (abort) once the new one is ready and before it
# commits: the update fails (the process it asked is gone), the old process ends with status 134, and the new
# one runs the VM and says so (/tmp/NAME.pid names it afterwards).
live_update_old_dies() {
    local name old new exe status
    name="$1"
    shift
    old="$(cat "/tmp/$name.pid")"
    echo "+ gpuvm update --pid $old $* (its process dies after the new one is ready)"
    if GPUVM_LOG=info gpuvm update --pid "$old" "$@" >/tmp/update-dies.out 2>&1; then
        cat /tmp/update-dies.out
        abort_gpuvm "$name" "the update whose old process dies succeeded"
    fi
    wait_ended "$old" 30 || {
        sed 's/^/  update: /' /tmp/update-dies.out
        abort_gpuvm "$name" "gpuvm $old still runs 30 s after its update failed"
    }
    status=0
    wait "$old" || status=$?
    [ "$status" = 134 ] || {
        sed 's/^/  update: /' /tmp/update-dies.out
        abort_gpuvm "$name" "gpuvm $old exited with status $status, not 134 (abort), in its update"
    }
    new=""
    for exe in /proc/[0-9]*/exe; do
        [ "$(readlink "$exe" 2>/dev/null)" = /bin/gpuvm ] || continue
        new="${exe#/proc/}"
        new="${new%/exe}"
    done
    [ -n "$new" ] || { sed 's/^/  update: /' /tmp/update-dies.out; fail "no gpuvm runs after process $old died in its update"; }
    echo "$new" >"/tmp/$name.pid"
    wait_log "$name" "died after this one was ready: running the VM" 30
    echo "old process died: process $old ended by abort after the new one's Ready; process $new runs the VM"
}

# wait_ended PID SECONDS: waits until process PID has ended; fails if it still runs after SECONDS.
wait_ended() {
    deadline=$(($(cut -d. -f1 /proc/uptime) + $2))
    while running "$1" && [ "$(cut -d. -f1 /proc/uptime)" -lt "$deadline" ]; do
        sleep 0.2
    done
    ! running "$1"
}

# wait_gpuvm_ended NAME PID SECONDS WHAT: waits until gpuvm NAME's process PID (one a live update started)
# has ended, once its guest is done; past SECONDS its threads are shown and the scenario ends ("gpuvm PID still
# runs SECONDS s after WHAT").
wait_gpuvm_ended() {
    wait_ended "$2" "$3" || {
        report_stuck_gpuvm "$1" "$2"
        abort_gpuvm "$1" "gpuvm $2 still runs $3 s after $4"
    }
}

# start_fc_mmds_vm CHECKS [ARG...]: gpuvm as `firecracker --api-sock /tmp/fc.sock ARG...` (the gpuvm
# named `fc`: output in /tmp/fc.log), configured the way Firecracker's clients do it: a Linux guest that runs
# inner.checks=CHECKS and reboots (which ends a Firecracker VMM), MMDS V2 on eth0 (over tap0) holding
# instance-id i-gpuvm-42 and ami-id ami-real-kernel; then started.
start_fc_mmds_vm() {
    checks="$1"
    shift
    ln -sf /bin/gpuvm /tmp/firecracker
    echo "+ firecracker --api-sock /tmp/fc.sock $* &"
    /tmp/firecracker --api-sock /tmp/fc.sock "$@" >/tmp/fc.log 2>&1 &
    echo $! >/tmp/fc.pid
    wait_for /tmp/fc.sock 30
    fc PUT /boot-source '{"kernel_image_path": "/images/vmlinuz", "initrd_path": "/images/initramfs.cpio",
        "boot_args": "console=ttyS0 quiet panic=-1 inner.checks='"$checks"' inner.mmds=169.254.169.254 inner.end=reboot"}'
    fc PUT /machine-config '{"vcpu_count": 1, "mem_size_mib": 256}'
    fc PUT /network-interfaces/eth0 '{"iface_id": "eth0", "host_dev_name": "tap0"}'
    fc PUT /mmds/config '{"version": "V2", "network_interfaces": ["eth0"]}'
    fc PUT /mmds '{"latest": {"meta-data": {"instance-id": "i-gpuvm-42", "ami-id": "ami-real-kernel"}}}'
    fc PUT /actions '{"action_type": "InstanceStart"}'
}

# fc METHOD PATH [BODY]: one request to the `fc` gpuvm's API (its answer in /tmp/fc-call.out); a failure
# aborts it.
fc() {
    gpuvm ctl --api-sock /tmp/fc.sock raw "$@" >/tmp/fc-call.out 2>&1 ||
        abort_gpuvm fc "$1 $2 failed: $(cat /tmp/fc-call.out)"
}

# abort_gpuvm NAME MESSAGE: ends a gpuvm started by start_gpuvm, shows its log and status, and fails.
abort_gpuvm() {
    pid="$(cat "/tmp/$1.pid")"
    kill -9 "$pid" 2>/dev/null
    status=0
    wait "$pid" || status=$?
    sed 's/^/  | /' "/tmp/$1.log"
    fail "$2 (gpuvm $1 status $status)"
}

# start_ch: starts gpuvm as Cloud Hypervisor in the background, as Kata does (it starts the binary it is
# configured with; gpuvm takes Cloud Hypervisor's command line by that name), its API on /tmp/ch.sock and
# its output in /tmp/ch.log (the gpuvm named `ch` for wait_log, wait_gpuvm and abort_gpuvm); waits for the
# socket.
# start_ch PEER starts the Cloud Hypervisor binary at PEER instead (bench/real-kernel --ch), its
# socket, log and name the same.
start_ch() {
    rm -f /tmp/cloud-hypervisor /tmp/ch.sock
    ln -s "${1:-/bin/gpuvm}" /tmp/cloud-hypervisor
    echo "+ cloud-hypervisor --api-socket /tmp/ch.sock & (${1:-gpuvm})"
    /tmp/cloud-hypervisor --api-socket /tmp/ch.sock >/tmp/ch.log 2>&1 &
    echo $! >/tmp/ch.pid
    wait_for /tmp/ch.sock 30
}

# ch_checked METHOD PATH [BODY]: one request to start_ch's API, its answer in /tmp/ch-call.out; a failed
# request ends that gpuvm and the scenario.
ch_checked() {
    gpuvm ctl --api-sock /tmp/ch.sock raw "$@" >/tmp/ch-call.out 2>&1 ||
        abort_gpuvm ch "$1 $2 failed: $(cat /tmp/ch-call.out)"
}

# guest_lines LOG: LOG as the guest printed it. A gpuvm log holds the guest's serial output (stdout) and
# gpuvm's log records (stderr) in one file, and a record can land in the middle of a guest line
# ("inner: 0001:00:0[... WARN ...] ...\n1.0 ejected"): each record that starts inside a line is taken
# out and the line joined up again. Records at the start of a line stay.
guest_lines() {
    awk '{
        line = pending $0
        pending = ""
        if (match(line, /\[20[0-9][0-9]-[0-9][0-9]-[0-9][0-9]T[0-9:.]+Z (TRACE|DEBUG|INFO|WARN|ERROR) /) && RSTART > 1) {
            pending = substr(line, 1, RSTART - 1)
            next
        }
        print line
    }
    END { if (pending != "") print pending }' "$1"
}

# has_line LOG TEXT: whether LOG holds TEXT, as written or in its guest's lines (guest_lines).
has_line() {
    grep -qF -- "$2" "$1" || guest_lines "$1" | grep -qF -- "$2"
}

# guest_reported_failure LOG: whether the guest of a gpuvm log reported a failure (`inner: FAIL` from a Linux
# guest, `edu: FAIL` from the test guest's edu loop). A plain grep, cheap enough for every round of a wait:
# a line a log record split is caught by the checks after the wait.
guest_reported_failure() {
    grep -qE "(inner|edu): FAIL" "$1"
}

# wait_log NAME TEXT SECONDS: waits until the log of gpuvm NAME holds TEXT (aborting it if it never does, or
# if its guest reports a failure first).
# (The limit is read from the clock, not counted in rounds: each round forks a few processes, slow enough in
# the emulated machine to make a 120 s limit last most of the tier's 900.)
wait_log() {
    local deadline
    deadline=$(($(cut -d. -f1 /proc/uptime) + $3))
    until has_line "/tmp/$1.log" "$2"; do
        [ "$(cut -d. -f1 /proc/uptime)" -lt "$deadline" ] || {
            report_stuck_gpuvm "$1" "$(cat "/tmp/$1.pid")"
            abort_gpuvm "$1" "no '$2' after $3 s"
        }
        # A guest that reported a failure prints no more of its checks.
        guest_reported_failure "/tmp/$1.log" && abort_gpuvm "$1" "no '$2': the guest failed"
        # A gpuvm that has ended prints nothing more: no use waiting out the limit.
        running "$(cat "/tmp/$1.pid")" || has_line "/tmp/$1.log" "$2" ||
            abort_gpuvm "$1" "no '$2': gpuvm $1 ended"
        sleep 0.1
    done
}

# wait_for PATH SECONDS: waits until PATH exists.
wait_for() {
    local deadline
    deadline=$(($(cut -d. -f1 /proc/uptime) + $2))
    while [ ! -e "$1" ]; do
        [ "$(cut -d. -f1 /proc/uptime)" -lt "$deadline" ] || fail "no $1 after $2 s"
        sleep 0.1
    done
}

# expect_line LOG TEXT: fails unless LOG holds TEXT.
expect_line() {
    has_line "$1" "$2" || fail "no '$2' in $1"
}

# The DMA map figure of a gpuvm log (its `--log-level info` line for the device).
dma_map_figure() {
    sed -n 's/.*DMA map \(.*\): done, \(.*\)/\1: \2/p' "$1" | while read -r line; do
        figure "DMA map $line"
    done
}

# edu_loop_count: the latest `edu: loop N ok` count in the log of the gpuvm `edu` (0 before the first).
edu_loop_count() {
    count="$(sed -n 's/.*edu: loop \([0-9][0-9]*\) ok.*/\1/p' /tmp/edu.log | tail -n1)"
    echo "${count:-0}"
}

# edu_wait_rounds_past COUNT SECONDS WHAT: waits until the guest of the gpuvm `edu` reports more than COUNT
# rounds, failing if it reports a failure, if the gpuvm running it (/tmp/edu.pid) ends, or after SECONDS.
edu_wait_rounds_past() {
    wait_past edu edu_loop_count "$1" "$2" "$3"
}

# wait_past NAME COUNTER COUNT SECONDS WHAT: waits until COUNTER (a command, with its arguments as one word,
# printing a number: the guest's latest round) prints more than COUNT; aborts the gpuvm NAME (/tmp/NAME.pid
# runs it) if its guest reports a failure (guest_reported_failure), if it ends, or after SECONDS. WHAT says
# when, for the messages.
wait_past() {
    local deadline
    deadline=$(($(cut -d. -f1 /proc/uptime) + $4))
    while [ "$($2)" -le "$3" ]; do
        guest_reported_failure "/tmp/$1.log" && abort_gpuvm "$1" "the guest failed $5"
        running "$(cat "/tmp/$1.pid")" || abort_gpuvm "$1" "gpuvm ended $5"
        [ "$(cut -d. -f1 /proc/uptime)" -lt "$deadline" ] ||
            abort_gpuvm "$1" "no more than $3 rounds $4 s $5 (at $($2))"
        sleep 0.2
    done
}

# edu_live_update_scenario API: the vfio-*-update scenarios. QEMU's edu (1234:11e8), passed through with
# kernel VFIO opened through API (`iommufd`: /dev/iommu and the device cdev, `type1`: the container/group
# API), runs the test guest's `edu loop` (a checked DMA round trip and an MSI per round) while `gpuvm
# update` hands the VM to a new process, twice; each new process takes the device over (no reset, guest
# RAM not DMA-mapped again) and the loop goes on. With type1 the DMA mappings' host addresses move to the
# new process (VFIO_DMA_MAP_FLAG_VADDR), and a failed update first puts them back on the old one.
edu_live_update_scenario() {
    edu_api="$1"
    case "$edu_api" in
    iommufd)
        edu_api_line="kernel VFIO: iommufd cdev API"
        edu_mapper="kernel VFIO (iommufd IOAS)"
        ;;
    type1)
        edu_api_line="kernel VFIO: container/group API"
        edu_mapper="kernel VFIO (type1 container)"
        ;;
    *) fail "edu_live_update_scenario: no API $edu_api (iommufd or type1)" ;;
    esac
    if [ "$edu_api" = iommufd ]; then
        [ -c /dev/iommu ] || fail "no /dev/iommu (is CONFIG_IOMMUFD on in the outer kernel?)"
    fi
    bdf="$(pci_find 1234 11e8)" || fail "no edu device"
    group="$(vfio_bind "$bdf")"
    if [ "$edu_api" = iommufd ]; then
        [ -d "/sys/bus/pci/devices/$bdf/vfio-dev" ] || fail "$bdf has no VFIO cdev (CONFIG_VFIO_DEVICE_CDEV)"
        echo "edu at $bdf, $group, /dev/iommu"
    else
        echo "edu at $bdf, $group"
    fi

    log=/tmp/edu.log
    # Every gpuvm that runs the VM writes $log: each new process takes over the first one's stdout and
    # stderr. /tmp/edu.pid names the one that runs it now (abort_gpuvm ends that one).
    # The first process dies (abort) once the new one of its first update is ready, before it commits
    # (GPUVM_TEST_UPDATE_OLD_DIES; the processes the updates start have no such hook).
    export GPUVM_TEST_UPDATE_OLD_DIES=1
    start_gpuvm edu run --log-level info --memory 256M --gpu "$bdf" --api-sock /tmp/api.sock --cmdline "edu loop"
    unset GPUVM_TEST_UPDATE_OLD_DIES
    wait_for /tmp/api.sock 30
    gpuvm ctl --api-sock /tmp/api.sock start || abort_gpuvm edu "InstanceStart failed"

    edu_wait_rounds_past 0 180 "after InstanceStart"
    expect_line "$log" "$edu_api_line"
    expect_line "$log" "edu: msi ok"
    # The loop's pace, before any update (each round a DMA round trip and an MSI).
    rounds_from="$(edu_loop_count)"
    from="$(uptime_s)"
    edu_wait_rounds_past $((rounds_from + 15)) 120 "in its first rounds"
    rounds="$(($(edu_loop_count) - rounds_from))"
    seconds="$(seconds_between "$from" "$(uptime_s)")"
    echo "the guest's edu loop runs: $rounds rounds in $seconds s"
    figure "edu loop under kernel VFIO ($edu_api), nested: $(awk -v r="$rounds" -v s="$seconds" 'BEGIN { printf "%.0f", r / s }') rounds/s (a DMA round trip of 2048 bytes and an MSI each)"

    if [ "$edu_api" = type1 ]; then
        # A failed update (the new gpuvm crashes after the old one moved the DMA mappings' host addresses
        # off its own memory with VFIO_DMA_UNMAP_FLAG_VADDR): the old process puts them back and runs on,
        # the device's DMA working.
        old="$(cat /tmp/edu.pid)"
        rounds_before="$(edu_loop_count)"
        echo "+ GPUVM_TEST_UPDATE_FAIL=crash gpuvm update --pid $old (must fail, at loop round $rounds_before)"
        if GPUVM_TEST_UPDATE_FAIL=crash GPUVM_LOG=info gpuvm update --pid "$old" >/tmp/update-fail.out 2>&1; then
            cat /tmp/update-fail.out
            # abort_gpuvm ends the process that runs the VM now.
            new="$(sed -n 's/.*runs in process \([0-9][0-9]*\).*/\1/p' /tmp/update-fail.out)"
            [ -n "$new" ] && echo "$new" >/tmp/edu.pid
            abort_gpuvm edu "the update with GPUVM_TEST_UPDATE_FAIL=crash succeeded"
        fi
        sed 's/^/  update: /' /tmp/update-fail.out
        running "$old" || abort_gpuvm edu "the old gpuvm $old does not run after the failed update"
        rounds_after="$(edu_loop_count)"
        edu_wait_rounds_past $((rounds_after + 8)) 120 "after the failed update"
        running "$old" || abort_gpuvm edu "the old gpuvm $old ended after the failed update"
        grep -qF "DMA mappings back on this process's addresses" "$log" ||
            abort_gpuvm edu "after the failed update process $old logged no 'DMA mappings back on this process's addresses'"
        grep -F "DMA mappings back on this process's addresses" "$log" | sed "s/^/failed update: /"
        echo "failed update: the loop went on in process $old from round $rounds_after ($rounds_before when the update began) to round $(edu_loop_count)"
    fi

    # The old process dies after the hand-over point (the new one ready, no Commit yet): the new one runs
    # the VM, with the device and its DMA mappings (type1: at the new process's addresses), and serves the
    # API socket again. `gpuvm update` itself fails: the process it asked is gone.
    rounds_before="$(edu_loop_count)"
    live_update_old_dies edu
    new="$(cat /tmp/edu.pid)"
    rounds_after="$(edu_loop_count)"
    edu_wait_rounds_past $((rounds_after + 8)) 120 "after the old process died in the update"
    if [ "$edu_api" = type1 ]; then
        grep -qF "DMA mappings now use this process's addresses (VFIO_DMA_MAP_FLAG_VADDR" "$log" ||
            abort_gpuvm edu "after the old process died, no 'DMA mappings now use this process's addresses' line"
    fi
    gpuvm ctl --api-sock /tmp/api.sock raw GET / >/dev/null ||
        abort_gpuvm edu "process $new does not serve the API socket after the old one died"
    echo "after the old process died the loop went on in process $new from round $rounds_after ($rounds_before when the update began) to $(edu_loop_count)"

    for n in 1 2; do
        old="$(cat /tmp/edu.pid)"
        lines_before="$(wc -l <"$log")"
        rounds_before="$(edu_loop_count)"
        echo "update $n begins at loop round $rounds_before"
        # (live_update's GPUVM_LOG=info: the new process, which inherits that environment and not
        # the first one's --log-level, logs what it took over.)
        live_update edu "$n"
        new="$(cat /tmp/edu.pid)"

        # The old process has ended, the new one runs.
        running "$new" || abort_gpuvm edu "the new gpuvm $new does not run after update $n"

        # The device keeps working under the new process alone: DMA and MSI, round after round.
        rounds_after="$(edu_loop_count)"
        edu_wait_rounds_past $((rounds_after + 16)) 120 "after update $n"
        echo "update $n: the loop went on from round $rounds_after (process $old gone; $rounds_before when the update began) to $(edu_loop_count) in process $new"

        # The new process took the device over: no reset, and guest RAM not DMA-mapped again.
        # (What the new process logged before it took the VM's stdout and stderr over went to gpuvm
        # update's.)
        { tail -n +"$((lines_before + 1))" "$log"; cat "/tmp/update-$n.out"; } >"/tmp/after-$n.log"
        grep "kernel VFIO" "/tmp/after-$n.log" | grep -q "taken over from the old process (no reset, no DMA map" ||
            abort_gpuvm edu "update $n: no 'kernel VFIO ... taken over from the old process (no reset, no DMA map' line"
        grep "kernel VFIO" "/tmp/after-$n.log" | grep "taken over from the old process" | sed "s/^/update $n: /"
        # (A handed-over context accounts for the mappings it took over under a name of its own.)
        grep -E "DMA map .*: (start|done)," "/tmp/after-$n.log" | sed "s/^/update $n: /"
        grep -qF "DMA map $edu_mapper: start" "/tmp/after-$n.log" &&
            abort_gpuvm edu "update $n: the new gpuvm DMA-mapped guest RAM again"
        # type1: the container's mappings now point at the new process's memory (VFIO_DMA_MAP_FLAG_VADDR).
        if [ "$edu_api" = type1 ]; then
            grep -qF "DMA mappings now use this process's addresses (VFIO_DMA_MAP_FLAG_VADDR" "/tmp/after-$n.log" ||
                abort_gpuvm edu "update $n: no 'DMA mappings now use this process's addresses (VFIO_DMA_MAP_FLAG_VADDR...' line"
            grep -F "DMA mappings now use this process's addresses (VFIO_DMA_MAP_FLAG_VADDR" "/tmp/after-$n.log" |
                sed "s/^/update $n: /"
        fi

        # The downtime: the new process's pause (its stderr, paused_to_run_us=) and the hand-over's length
        # (gpuvm update's answer).
        paused_us="$(sed -n 's/.*paused_to_run_us=\([0-9][0-9]*\).*/\1/p' "/tmp/after-$n.log" | tail -n1)"
        [ -n "$paused_us" ] || abort_gpuvm edu "update $n: the new gpuvm reported no paused_to_run_us"
        handover_ms="$(sed -n 's/.*the hand-over took \([0-9][0-9]*\) ms.*/\1/p' "/tmp/update-$n.out")"
        figure "live update $n of a VM with kernel VFIO (edu, $edu_api): guest paused $((paused_us / 1000)) ms (paused_to_run_us=$paused_us), hand-over ${handover_ms:-?} ms"
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
    echo "live update of a VM with kernel VFIO through $edu_api, twice, edu's DMA and MSI running throughout: ok"
}
