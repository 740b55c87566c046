//! vCPU threads and their handles, tested together on real KVM vCPUs.

use std::sync::mpsc::channel;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpuvm_arch::x86_64::regs::{self, EntryPoint};
use gpuvm_devices::Bus;
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use super::control::{Activity, ANSWER_LIMIT, STOP_RUNNING_LIMIT};
use super::*;

/// Runs `f` on another thread and fails the test if it does not return in time.
fn within_seconds(seconds: u64, f: impl FnOnce() + Send + 'static) {
    let (done_tx, done_rx) = channel();
    std::thread::spawn(move || {
        f();
        let _ = done_tx.send(());
    });
    done_rx
        .recv_timeout(Duration::from_secs(seconds))
        .expect("did not finish in time (a vCPU thread was left waiting)");
}

#[test]
fn an_unlaunched_vcpu_thread_ends_when_dropped() {
    within_seconds(10, || {
        let thread = VcpuThread::spawn(3, None).unwrap();
        assert_eq!(thread.id(), 3);
        // Ready arrives whether or not the vCPU ever comes.
        thread.handle.wait_ready().unwrap();
        drop(thread);
    });
}

#[test]
fn a_vcpu_is_refused_by_another_vcpus_thread_and_runs_on_its_own() {
    within_seconds(10, || {
        let kvm = kvm_ioctls::Kvm::new().expect("open /dev/kvm");
        let vm = kvm.create_vm().expect("create VM");
        let bus = || Arc::new(Bus::new());
        let vcpu = |id: u8| {
            let fd = vm.create_vcpu(u64::from(id)).unwrap();
            Vcpu::new(id, fd, bus(), bus(), Arc::new(Vec::new()))
        };
        let reporter = Arc::new(StopReporter {
            reasons: channel().0,
            event: EventFd::new(libc::EFD_NONBLOCK).unwrap(),
        });
        let err = VcpuThread::spawn(1, None)
            .unwrap()
            .launch(vcpu(0), reporter.clone())
            .err()
            .expect("vCPU 0 launched on vCPU 1's thread");
        assert!(
            matches!(err, VcpuError::WrongThread { id: 0, thread: 1 }),
            "{err}"
        );
        // The right thread takes it; it stays paused until resumed, and stops on request.
        let mut handle = VcpuThread::spawn(1, None)
            .unwrap()
            .launch(vcpu(1), reporter)
            .unwrap();
        handle.wait_ready().unwrap();
        handle.pause().unwrap();
        assert!(handle.stop_and_join());
    });
}

/// A VM whose one vCPU runs `jmp $` in long mode, so that it never leaves KVM_RUN
/// unless kicked (as a guest's AP running ring-3 code does).
struct SpinningGuest {
    handle: VcpuHandle,
    // Guest RAM: dropped only once the vCPU thread has ended.
    ram: GuestMemoryMmap,
    _vm: kvm_ioctls::VmFd,
}

const RAM_SIZE: usize = 0x10000;
const CODE: u64 = 0x1000;

impl SpinningGuest {
    /// `prepare` gets guest RAM's host address once the code and page tables are in.
    fn start(prepare: impl FnOnce(u64, u64)) -> SpinningGuest {
        use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};
        let kvm = kvm_ioctls::Kvm::new().expect("open /dev/kvm");
        let vm = kvm.create_vm().expect("create VM");
        // The vCPU state a snapshot saves includes the in-kernel LAPIC.
        vm.create_irq_chip().expect("in-kernel irqchip");
        let ram = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), RAM_SIZE)]).unwrap();
        let host = ram.get_host_address(GuestAddress(0)).unwrap() as u64;
        let region = kvm_bindings::kvm_userspace_memory_region {
            slot: 0,
            flags: 0,
            guest_phys_addr: 0,
            memory_size: RAM_SIZE as u64,
            userspace_addr: host,
        };
        // SAFETY: the mapping outlives the VM's use of it (see `ram`).
        unsafe { vm.set_user_memory_region(region) }.expect("memory slot");
        let fd = vm.create_vcpu(0).expect("create vCPU");
        let entry = EntryPoint::Linux64 { entry: CODE };
        let sregs = regs::setup_boot_sregs(&ram, entry, fd.get_sregs().unwrap()).unwrap();
        fd.set_sregs(&sregs).unwrap();
        fd.set_regs(&regs::boot_regs(entry)).unwrap();
        ram.write_slice(&[0xeb, 0xfe], GuestAddress(CODE)).unwrap(); // jmp $
        prepare(host, RAM_SIZE as u64);
        let bus = || Arc::new(Bus::new());
        let reporter = Arc::new(StopReporter {
            reasons: channel().0,
            event: EventFd::new(libc::EFD_NONBLOCK).unwrap(),
        });
        let handle = VcpuThread::spawn(0, None)
            .unwrap()
            .launch(
                Vcpu::new(0, fd, bus(), bus(), Arc::new(Vec::new())),
                reporter,
            )
            .unwrap();
        handle.wait_ready().unwrap();
        SpinningGuest {
            handle,
            ram,
            _vm: vm,
        }
    }

    fn wait_ended(&self) {
        let shared = self
            .handle
            .wait_until(ANSWER_LIMIT, |s| s.activity == Activity::Ended);
        assert_eq!(shared.activity, Activity::Ended);
    }
}

impl Drop for SpinningGuest {
    fn drop(&mut self) {
        self.handle.stop_and_join();
        // Guest RAM goes only after the thread.
        self.wait_ended();
        let _ = &self.ram;
    }
}

/// Runs `f`, asserting that it returns within `limit`.
fn returns_within<T>(what: &str, limit: Duration, f: impl FnOnce() -> T) -> T {
    let started = Instant::now();
    let result = f();
    assert!(
        started.elapsed() < limit,
        "{what} took {:?}",
        started.elapsed()
    );
    result
}

/// Asserts that `f` succeeds within `limit`.
fn at_once(what: &str, limit: Duration, f: impl FnOnce() -> Result<(), VcpuError>) {
    returns_within(what, limit, f).unwrap_or_else(|e| panic!("{what}: {e}"));
}

#[test]
fn pause_and_resume_are_idempotent_on_a_vcpu_that_never_exits() {
    within_seconds(30, || {
        let guest = SpinningGuest::start(|_, _| {});
        let handle = &guest.handle;
        let quick = Duration::from_millis(500);
        at_once("resume", ANSWER_LIMIT, || handle.resume());
        // Redundant: nothing to do, and nothing left over for later requests.
        at_once("a second resume", quick, || handle.resume());
        assert!(matches!(handle.save_state(), Err(VcpuError::NotPaused(0))));
        at_once("pause", quick, || handle.pause());
        at_once("a second pause", quick, || handle.pause());
        handle.save_state().expect("state of a paused vCPU");
        at_once("resume", quick, || handle.resume());
        at_once("pause", quick, || handle.pause());
        at_once("resume", quick, || handle.resume());
    });
}

#[test]
fn a_vcpu_waiting_for_guest_memory_fails_a_pause_and_is_left_behind_by_a_stop() {
    within_seconds(30, || {
        let uffd = gpuvm_memory::uffd::create_uffd().expect("userfaultfd");
        let mut guest = SpinningGuest::start(|host, len| {
            // Every page missing, the page tables too: the vCPU's first instruction
            // fetch walks them from the kernel, which waits for the userfaultfd with
            // only fatal signals able to interrupt it.
            // SAFETY: guest RAM, private anonymous memory nobody else uses yet.
            let ret = unsafe {
                libc::madvise(host as *mut libc::c_void, len as usize, libc::MADV_DONTNEED)
            };
            assert_eq!(ret, 0);
            gpuvm_memory::uffd::register_ranges(&uffd, &[(host, len)], 4096)
                .expect("register guest RAM");
        });
        guest.handle.set_stall_cause("a page nobody serves");
        // Its first instruction fetch waits for a page that nobody serves.
        guest.handle.resume().unwrap();
        // Its fault reached the userfaultfd: it waits for a page now.
        let deadline = Instant::now() + ANSWER_LIMIT;
        while !matches!(uffd.read_event(), Ok(Some(_))) {
            assert!(Instant::now() < deadline, "the vCPU never faulted");
            std::thread::sleep(Duration::from_millis(1));
        }
        let quick = Duration::from_millis(500);
        let pause_fails = |what, limit| {
            let error = returns_within(what, limit, || guest.handle.pause())
                .expect_err("paused while waiting for memory");
            assert!(
                error.to_string().contains("a page nobody serves"),
                "{error}"
            );
            error
        };
        let error = pause_fails("the pause", STOP_RUNNING_LIMIT + Duration::from_secs(1));
        assert!(
            matches!(error, VcpuError::NotStopping { id: 0, .. }),
            "{error}"
        );
        // Known to be stuck now: another pause fails at once, without another kick.
        pause_fails("a second pause", quick);
        // The pause was withdrawn; a resume has nothing to wait for.
        at_once("resume", quick, || guest.handle.resume());
        let joined = returns_within("the stop", quick, || guest.handle.stop_and_join());
        assert!(!joined, "a stuck vCPU thread was joined");
        // Closing the userfaultfd drops the registration: the fault is served with a
        // zero page (the guest then triple-faults), and the thread left behind ends.
        drop(uffd);
        guest.wait_ended();
    });
}
