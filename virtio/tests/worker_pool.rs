//! The pooled I/O threads (a process of its own: the pool is process-wide).

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};

use gpuvm_virtio::worker::{prespawn, EventControl, Worker, WorkerError, WorkerHandler};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// Reports the name of the thread it runs on when kicked.
struct WhereAmI {
    kick: EventFd,
    told: mpsc::Sender<String>,
}

impl WorkerHandler for WhereAmI {
    fn register(&mut self, control: &EventControl) -> std::io::Result<()> {
        control.add(self.kick.as_raw_fd(), 1)
    }

    fn handle_event(&mut self, _token: u64, _events: EventSet, _control: &EventControl) {
        let _ = self.kick.read();
        let name = std::fs::read_to_string("/proc/thread-self/comm").unwrap();
        self.told.send(name.trim().to_string()).unwrap();
    }
}

fn handler() -> (WhereAmI, EventFd, mpsc::Receiver<String>) {
    let kick = EventFd::new(EFD_NONBLOCK).unwrap();
    let trigger = kick.try_clone().unwrap();
    let (told, heard) = mpsc::channel();
    (WhereAmI { kick, told }, trigger, heard)
}

#[test]
fn workers_run_on_pooled_threads_that_ran_their_setup_and_come_back_idle() {
    let setups = Arc::new(AtomicUsize::new(0));
    let counted = setups.clone();
    prespawn(
        1,
        0,
        Arc::new(move || {
            counted.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }),
    )
    .unwrap();
    assert_eq!(setups.load(Ordering::SeqCst), 1);

    for round in 0..3 {
        let (first, trigger, heard) = handler();
        let worker = Worker::spawn("virtio-test", first).unwrap();
        // The one pooled thread is busy: a second worker is refused, not given a
        // thread of the caller's (which may be under a filter that forbids it).
        let (second, _, _) = handler();
        assert!(matches!(
            Worker::spawn("virtio-other", second),
            Err(WorkerError::NoIdleThread)
        ));
        trigger.write(1).unwrap();
        assert_eq!(heard.recv().unwrap(), "virtio-test", "round {round}");
        assert!(worker.stop().is_some());
    }
    assert_eq!(
        setups.load(Ordering::SeqCst),
        1,
        "no thread beyond the pool"
    );
}
