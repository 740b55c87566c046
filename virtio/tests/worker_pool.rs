//! The I/O threads made with the VM and by the factory (a process of its own: the threads
//! are process-wide).

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use gpuvm_virtio::worker::{
    start, EventControl, IoThreads, Worker, WorkerHandler, FACTORY_THREAD_NAME,
};
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

/// The names of this process's threads.
fn threads() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir("/proc/self/task")
        .unwrap()
        .flatten()
        .filter_map(|task| std::fs::read_to_string(task.path().join("comm")).ok())
        .map(|name| name.trim().to_string())
        .collect();
    names.sort();
    names
}

/// Waits until the process has `expected` threads (one ending may take a moment).
fn settle(expected: &[String]) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while threads() != expected {
        assert!(
            Instant::now() < deadline,
            "threads {:?}, expected {expected:?}",
            threads()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn workers_run_on_the_threads_made_with_the_vm_then_on_threads_the_factory_makes() {
    let setups = Arc::new(AtomicUsize::new(0));
    let factory_setups = Arc::new(AtomicUsize::new(0));
    let (counted, factory_counted) = (setups.clone(), factory_setups.clone());
    let before = threads();
    start(IoThreads {
        count: 1,
        setup: Arc::new(move || {
            counted.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }),
        factory: Some(Arc::new(move || {
            factory_counted.fetch_add(1, Ordering::SeqCst);
            Ok(())
        })),
    })
    .unwrap();
    assert_eq!(setups.load(Ordering::SeqCst), 1, "waited for");
    // The factory sleeps until it is asked; the thread made for a device waits for it.
    let mut idle = before.clone();
    idle.extend([FACTORY_THREAD_NAME.to_string(), "virtio-idle0".into()]);
    idle.sort();
    settle(&idle);
    assert_eq!(factory_setups.load(Ordering::SeqCst), 1);

    // The first worker takes the thread made with the VM.
    let (first, trigger, heard) = handler();
    let worker = Worker::spawn("virtio-test", first).unwrap();
    trigger.write(1).unwrap();
    assert_eq!(heard.recv().unwrap(), "virtio-test");
    assert_eq!(setups.load(Ordering::SeqCst), 1, "no new thread yet");

    // More at once, beyond any fixed number: each on a thread the factory makes, which
    // ran the setup first.
    let mut more = Vec::new();
    for index in 0..8 {
        let (handler, trigger, heard) = handler();
        let name = format!("virtio-more{index}");
        let worker = Worker::spawn(&name, handler).unwrap();
        trigger.write(1).unwrap();
        assert_eq!(heard.recv().unwrap(), name);
        more.push(worker);
    }
    assert_eq!(setups.load(Ordering::SeqCst), 1 + 8);
    assert_eq!(factory_setups.load(Ordering::SeqCst), 1, "one factory");

    // A thread ends with its worker: none is kept.
    let mut only_factory = before.clone();
    only_factory.push(FACTORY_THREAD_NAME.to_string());
    only_factory.sort();
    assert!(worker.stop().is_some());
    for worker in more {
        assert!(worker.stop().is_some());
    }
    settle(&only_factory);

    // And again: new threads, released again.
    for round in 0..3 {
        let (handler, trigger, heard) = handler();
        let worker = Worker::spawn("virtio-again", handler).unwrap();
        trigger.write(1).unwrap();
        assert_eq!(heard.recv().unwrap(), "virtio-again", "round {round}");
        assert!(worker.stop().is_some());
    }
    assert_eq!(setups.load(Ordering::SeqCst), 1 + 8 + 3);
    settle(&only_factory);
}
