"""Drives gpuvm (started as `firecracker`) with the PyPI package firecracker-python, unmodified.

    python firecracker_python_driver.py --firecracker LINK --kernel VMLINUX --disk IMAGE --work DIR

Run by tests/firecracker_clients.rs inside a virtual environment holding the pinned package.
The package's MicroVM class cannot be built here: its constructor calls docker.from_env()
(a Docker daemon) and create() sets up a tap device with NAT rules. So this script uses the
package's lower layers, the ones MicroVM itself goes through: ProcessManager.start (the same
command line MicroVM._run_firecracker gives), VMMManager (get_vmm_state, update_vmm_state,
get_vmm_config) and the Api class's resources, sending the bodies MicroVM's _configure_* and
snapshot() methods send. Only the package's configuration (data_path, binary_path) is pointed
at a scratch directory and the `firecracker` link; no package code is changed.

Every step prints one `step:` line; a failed check raises, which exits non-zero with the
reason. `client-difference:` lines name where a call the package makes is refused and why.
"""

import argparse
import os
import signal
import socket
import sys
import time

from firecracker.api import Api
from firecracker.exceptions import APIError
from firecracker.process import ProcessManager
from firecracker.vmm import VMMManager

GUEST_VSOCK_PORT = 1024  # the test guest's echo port ("virtio-vsock N" workload)
GUEST_CID = 3  # MicroVMConfig.vsock_guest_cid


def step(text):
    print(f"step: {text}", flush=True)


def check(condition, text):
    if not condition:
        raise AssertionError(text)


def expect_api_error(call, needles, what):
    """Runs `call`, which must fail with the package's APIError naming one of `needles`."""
    try:
        call()
    except APIError as error:
        message = str(error)
        check(message.startswith("API fault: "), f"{what}: not a fault_message: {message}")
        check(any(n in message for n in needles), f"{what}: {message} names none of {needles}")
        return message
    raise AssertionError(f"{what}: accepted, expected a refusal naming one of {needles}")


class Instance:
    """One gpuvm process started the way MicroVM._run_firecracker starts Firecracker."""

    def __init__(self, work, link, vm_id):
        self.vm_id = vm_id
        self.vmm = VMMManager()
        self.vmm._config.data_path = work
        self.process = ProcessManager()
        self.process._config.data_path = work
        self.process._config.binary_path = link
        self.vmm_dir = f"{work}/{vm_id}"
        self.stdout_path = f"{self.vmm_dir}/firecracker.log"
        self.socket = self.vmm.socket_file(vm_id)
        for path in [self.vmm_dir, f"{self.vmm_dir}/rootfs", f"{self.vmm_dir}/logs"]:
            self.vmm.create_vmm_dir(path)
        log_file = f"{vm_id}.log"
        self.vmm.create_log_file(vm_id, log_file)
        self.log_path = f"{self.vmm_dir}/logs/{log_file}"
        args = ["--api-sock", self.socket, "--id", vm_id, "--log-path", self.log_path]
        self.pid = self.process.start(vm_id, args)
        check(self.process.is_running(vm_id), f"{vm_id}: not running after start")
        pid, _created = self.process.get_pid(vm_id)
        check(pid == self.pid, f"{vm_id}: get_pid {pid} != started {self.pid}")
        self.api = self.vmm.get_api(vm_id)
        check(self.api.socket == self.socket, f"{vm_id}: API socket {self.api.socket}")
        deadline = time.monotonic() + 30
        while True:
            try:
                self.api.describe.get()
                break
            except APIError:
                check(time.monotonic() < deadline, f"{vm_id}: the API socket never answered")
                time.sleep(0.1)

    def state(self):
        return self.vmm.get_vmm_state(self.vm_id)

    def stdout(self):
        with open(self.stdout_path, errors="replace") as f:
            return f.read()

    def wait_for_stdout(self, needle, limit=120):
        deadline = time.monotonic() + limit
        while needle not in self.stdout():
            check(time.monotonic() < deadline, f"{self.vm_id}: no {needle!r} in:\n{self.stdout()}")
            time.sleep(0.1)

    def kill(self):
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.api.close()


def vsock_echo(uds_path, payload):
    """Firecracker's hybrid vsock: CONNECT <port>\\n, answered OK <host port>\\n, then bytes."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(60)
        conn.connect(uds_path)
        conn.sendall(f"CONNECT {GUEST_VSOCK_PORT}\n".encode())
        answer = b""
        while not answer.endswith(b"\n"):
            chunk = conn.recv(1)
            check(chunk, f"vsock: closed before the answer to CONNECT ({answer!r})")
            answer += chunk
        check(answer.startswith(b"OK "), f"vsock: answer to CONNECT {answer!r}")
        conn.sendall(payload)
        echo = b""
        while len(echo) < len(payload):
            chunk = conn.recv(len(payload) - len(echo))
            check(chunk, f"vsock: closed after {len(echo)} of {len(payload)} echoed bytes")
            echo += chunk
        check(echo == payload, f"vsock: echo {echo!r} != {payload!r}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--firecracker", required=True)
    parser.add_argument("--kernel", required=True)
    parser.add_argument("--disk", required=True)
    parser.add_argument("--work", required=True)
    args = parser.parse_args()
    work = os.path.abspath(args.work)
    snapshot_dir = f"{work}/snapshots"
    os.makedirs(snapshot_dir, exist_ok=True)
    snapshot_path = f"{snapshot_dir}/snapshot"
    mem_file_path = f"{snapshot_dir}/memory"
    uds_path = f"{work}/v.sock"
    # Exited children are reaped at once, so the package's ProcessManager (os.kill(pid, 0))
    # sees them gone instead of waiting out its timeouts on zombies.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    instances = []
    try:
        first = Instance(work, args.firecracker, "fcpy0001")
        instances.append(first)
        api = first.api
        step(f"started {args.firecracker} --api-sock --id --log-path (pid {first.pid})")

        check(first.state() == "Not started", f"state before start: {first.state()}")
        info = api.describe.get().json()
        check(info["id"] == "fcpy0001", f"GET / id: {info}")
        version = api.version.get().json()
        check("firecracker_version" in version, f"GET /version: {version}")
        step(f"get_vmm_state: Not started; version {version['firecracker_version']}")

        # MicroVM.create's configuration calls, in its order, with its bodies.
        api.boot.put(kernel_image_path=args.kernel, boot_args="virtio-vsock 2")
        api.drive.put(
            drive_id="rootfs", path_on_host=args.disk, is_root_device=True, is_read_only=False
        )
        api.machine_config.put(vcpu_count=1, mem_size_mib=128)
        api.vsock.put(guest_cid=GUEST_CID, uds_path=uds_path)
        step("boot-source, drives/rootfs, machine-config, vsock: 204")

        # _configure_vmm_mmds's first call: MMDS is not served; the package reads the fault.
        message = expect_api_error(
            lambda: api.mmds_config.put(
                version="V2", ipv4_address="169.254.169.254", network_interfaces=["eth0"]
            ),
            ["MMDS"],
            "PUT /mmds/config",
        )
        print(f"client-difference: mmds_enabled=True breaks create(): {message}", flush=True)

        config = first.vmm.get_vmm_config("fcpy0001")
        check(config["boot-source"]["boot_args"] == "virtio-vsock 2", f"vm/config: {config}")
        check(config["machine-config"]["mem_size_mib"] == 128, f"vm/config: {config}")
        check(config["drives"][0]["drive_id"] == "rootfs", f"vm/config: {config}")
        check(first.vmm.get_vmm_ip_addr("fcpy0001") == "Unknown", "no ip= in boot_args")
        step("get_vmm_config echoes the bodies")

        api.actions.put(action_type="InstanceStart")
        first.wait_for_stdout("virtio-vsock: listening")
        check(first.state() == "Running", f"state after InstanceStart: {first.state()}")
        vsock_echo(uds_path, b"firecracker-python before the snapshot")
        step("InstanceStart; get_vmm_state: Running; vsock echo")

        # MicroVM.pause / resume.
        first.vmm.update_vmm_state("fcpy0001", "Paused")
        check(first.state() == "Paused", f"state after pause: {first.state()}")
        first.vmm.update_vmm_state("fcpy0001", "Resumed")
        check(first.state() == "Running", f"state after resume: {first.state()}")
        step("update_vmm_state Paused / Resumed; get_vmm_state follows")

        # MicroVM.snapshot(action="create"): pause unless paused, create, resume.
        if first.state() != "Paused":
            first.vmm.update_vmm_state("fcpy0001", "Paused")
        check(first.state() == "Paused", f"state before snapshot: {first.state()}")
        api.create_snapshot.put(mem_file_path=mem_file_path, snapshot_path=snapshot_path)
        check(os.path.isfile(snapshot_path), "no snapshot file")
        check(os.path.isfile(mem_file_path), "no memory file")
        first.vmm.update_vmm_state("fcpy0001", "Resumed")
        check(first.state() == "Running", f"state after the snapshot: {first.state()}")
        step("snapshot create {mem_file_path, snapshot_path}: both files written; Running")

        first.process.stop("fcpy0001")
        check(not first.process.is_running("fcpy0001"), "still running after stop()")
        step("ProcessManager.stop: SIGTERM ends gpuvm")

        # MicroVM.create(snapshot=True): a fresh process, snapshot(action="load"), then
        # InstanceStart.
        second = Instance(work, args.firecracker, "fcpy0002")
        instances.append(second)
        api = second.api
        check(second.state() == "Not started", f"fresh process: {second.state()}")
        mem_backend = {"backend_type": "File", "backend_path": mem_file_path}
        message = expect_api_error(
            lambda: api.load_snapshot.put(
                enable_diff_snapshots=True,
                mem_backend=mem_backend,
                snapshot_path=snapshot_path,
                resume_vm=True,
                network_overrides=[{"iface_id": "eth0", "host_dev_name": "tap_fcpy0001"}],
            ),
            ["enable_diff_snapshots", "network_overrides"],
            "snapshot load with MicroVM's body",
        )
        print(f"client-difference: MicroVM.snapshot(load) body refused: {message}", flush=True)
        check(second.state() == "Not started", f"after the refused load: {second.state()}")
        api.load_snapshot.put(
            mem_backend=mem_backend, snapshot_path=snapshot_path, resume_vm=True
        )
        check(second.state() == "Running", f"state after load: {second.state()}")
        step("snapshot load {mem_backend File, snapshot_path, resume_vm}: Running")

        message = expect_api_error(
            lambda: api.actions.put(action_type="InstanceStart"),
            ["start", "Start", "running", "Running", "already"],
            "InstanceStart after a load",
        )
        print(
            f"client-difference: create(snapshot=True)'s InstanceStart after load refused "
            f"(as by Firecracker): {message}",
            flush=True,
        )

        second.vmm.update_vmm_state("fcpy0002", "Paused")
        check(second.state() == "Paused", f"restored, paused: {second.state()}")
        second.vmm.update_vmm_state("fcpy0002", "Resumed")
        check(second.state() == "Running", f"restored, resumed: {second.state()}")
        vsock_echo(uds_path, b"firecracker-python after the restore")
        second.wait_for_stdout("virtio-vsock: ok")
        deadline = time.monotonic() + 60
        while second.process.is_running("fcpy0002"):
            check(time.monotonic() < deadline, "gpuvm did not end after the guest was done")
            time.sleep(0.1)
        step("restored guest: pause/resume, vsock echo, guest done, gpuvm ended")
        print("firecracker-python: all steps passed", flush=True)
    finally:
        for instance in instances:
            instance.kill()


if __name__ == "__main__":
    try:
        main()
    except Exception as error:  # one line naming the failed check, then the trace
        print(f"firecracker-python driver failed: {error!r}", file=sys.stderr, flush=True)
        raise
