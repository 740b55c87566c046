//! `gpuvm-test-uffd-handler`: an external page-fault handler for gpuvm's snapshot tests.
//!
//! Usage: `gpuvm-test-uffd-handler --socket PATH --snapshot DIR [--die-after-faults N | --stall]`
//!
//! Listens on the Unix socket PATH, accepts one `gpuvm restore --restore-mode external`
//! connection (Firecracker's handshake: region list plus the userfaultfd), serves its
//! page faults from the memory files that `DIR/state` names, and exits when gpuvm hangs
//! up. Prints `uffd-handler: listening` once the socket accepts connections, and a
//! statistics line at the end. Exit status: 0 served until the hang-up, 1 any failure
//! (bad arguments, bad snapshot, bad handshake, the loader failed while gpuvm ran).
//!
//! `--die-after-faults N` is for testing gpuvm's reaction to a handler that dies: the
//! background loader is off (pages come in only on fault), guest RAM stays registered
//! after the last data page (holes are served too), and once N faults have been
//! served the handler prints `uffd-handler: dying after N faults` and exits with status 3
//! at once, in the middle of the restore.
//!
//! `--stall` is for testing gpuvm with a handler that hangs: it accepts the connection,
//! prints `uffd-handler: stalling`, and never serves a fault, holding the userfaultfd and
//! the connection until gpuvm hangs up (gpuvm's vCPUs wait on their first fault forever).

use std::io::Read;
use std::os::unix::io::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use gpuvm_memory::snapshot::SnapshotChain;
use gpuvm_memory::uffd::external::ExternalHandler;
use gpuvm_memory::uffd::{LazyOptions, LazyRestore};
use gpuvm_vmm::snapshot::{MachineState, STATE_FILE};

/// How long a loader error may precede gpuvm's hang-up and still count as a consequence
/// of gpuvm exiting (its memory disappears under the loader) rather than a failure.
const HANGUP_GRACE: Duration = Duration::from_secs(2);

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().filter_or("GPUVM_LOG", "warn")).init();
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("uffd-handler: error: {message}");
            ExitCode::from(1)
        }
    }
}

/// Exit status when `--die-after-faults` ends the handler.
const DIE_STATUS: i32 = 3;

struct Args {
    socket: PathBuf,
    snapshot: PathBuf,
    die_after_faults: Option<u64>,
    stall: bool,
}

const USAGE: &str = "--socket PATH --snapshot DIR [--die-after-faults N | --stall]";

fn parse_args() -> Result<Args, String> {
    let mut socket = None;
    let mut snapshot = None;
    let mut die_after_faults = None;
    let mut stall = false;
    let mut args = std::env::args_os().skip(1);
    while let Some(flag) = args.next() {
        if flag == "--stall" {
            stall = true;
            continue;
        }
        let value = args.next().map(PathBuf::from);
        match (flag.to_str(), value) {
            (Some("--socket"), Some(v)) => socket = Some(v),
            (Some("--snapshot"), Some(v)) => snapshot = Some(v),
            (Some("--die-after-faults"), Some(v)) => {
                let n = v
                    .to_str()
                    .and_then(|v| v.parse::<u64>().ok())
                    .ok_or("--die-after-faults takes a number")?;
                die_after_faults = Some(n);
            }
            _ => return Err(format!("usage: {} {USAGE}", env!("CARGO_BIN_NAME"))),
        }
    }
    if stall && die_after_faults.is_some() {
        return Err("--stall and --die-after-faults exclude each other".into());
    }
    match (socket, snapshot) {
        (Some(socket), Some(snapshot)) => Ok(Args {
            socket,
            snapshot,
            die_after_faults,
            stall,
        }),
        _ => Err("both --socket and --snapshot are required".into()),
    }
}

/// Opens the memory chain the snapshot's state file names, validated as a chain.
fn open_chain(dir: &Path) -> Result<SnapshotChain, String> {
    let state: MachineState =
        gpuvm_vmm::persist::read_state_file(&dir.join(STATE_FILE)).map_err(|e| e.to_string())?;
    let paths: Vec<PathBuf> = state.memory_files.iter().map(|f| dir.join(f)).collect();
    SnapshotChain::open_with_file_layout(&paths).map_err(|e| e.to_string())
}

fn run() -> Result<(), String> {
    let Args {
        socket,
        snapshot: dir,
        die_after_faults,
        stall,
    } = parse_args()?;
    // Validate the snapshot before anyone connects: a bad one is our failure, not gpuvm's.
    let chain = Arc::new(open_chain(&dir)?);
    let _ = std::fs::remove_file(&socket);
    let listener = UnixListener::bind(&socket)
        .map_err(|e| format!("cannot listen on {}: {e}", socket.display()))?;
    println!("uffd-handler: listening on {}", socket.display());
    let handler = ExternalHandler::accept(&listener).map_err(|e| e.to_string())?;
    let _ = std::fs::remove_file(&socket);
    println!(
        "uffd-handler: gpuvm connected, {} regions",
        handler.regions().len()
    );
    if stall {
        println!("uffd-handler: stalling");
        // Hold the userfaultfd and the connection; read no fault.
        let (connection, _uffd, _regions) = handler.into_parts();
        while !wait_hangup(&connection, Duration::from_secs(1))? {}
        return Ok(());
    }
    let options = LazyOptions {
        background: die_after_faults.is_none(),
        // Serve holes too, so that every first touch counts as a fault.
        unregister_when_done: die_after_faults.is_none(),
        ..LazyOptions::default()
    };
    let (restore, connection) = handler.serve(chain, options).map_err(|e| e.to_string())?;
    let outcome = serve_until_hangup(&restore, &connection, die_after_faults);
    let stats = restore.stats();
    println!(
        "uffd-handler: faults={} bytes_by_faults={} bytes_background={} loaded_pages={}/{} complete={}",
        stats.faults,
        stats.bytes_loaded_by_faults,
        stats.bytes_loaded_background,
        stats.loaded_data_pages,
        stats.total_data_pages,
        stats.complete()
    );
    outcome?;
    // Errors after the hang-up are expected (gpuvm's memory is gone); stop quietly.
    drop(restore);
    Ok(())
}

/// Waits for gpuvm to close the connection. A loader error while gpuvm is still there is
/// a failure: its vCPU would wait forever on a fault nobody serves.
fn serve_until_hangup(
    restore: &LazyRestore,
    connection: &UnixStream,
    die_after_faults: Option<u64>,
) -> Result<(), String> {
    let mut loader_error: Option<(String, std::time::Instant)> = None;
    let poll = if die_after_faults.is_some() {
        Duration::from_millis(1)
    } else {
        Duration::from_millis(50)
    };
    loop {
        if wait_hangup(connection, poll)? {
            return Ok(());
        }
        if let Some(limit) = die_after_faults {
            let faults = restore.stats().faults;
            if faults >= limit {
                println!("uffd-handler: dying after {faults} faults");
                // Abruptly, as a crash would: no cleanup, no unregistering.
                std::process::exit(DIE_STATUS);
            }
        }
        match &loader_error {
            None => {
                if let Err(e) = restore.wait_timeout(Some(Duration::ZERO)) {
                    loader_error = Some((e.to_string(), std::time::Instant::now()));
                }
            }
            Some((message, since)) if since.elapsed() > HANGUP_GRACE => {
                return Err(format!("serving page faults failed: {message}"));
            }
            Some(_) => {}
        }
    }
}

/// Whether the peer hung up within `timeout` (gpuvm sends nothing after the handshake).
fn wait_hangup(connection: &UnixStream, timeout: Duration) -> Result<bool, String> {
    let mut pollfd = libc::pollfd {
        fd: connection.as_raw_fd(),
        events: libc::POLLIN | libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: one valid pollfd that lives for the whole call.
    let ready = unsafe { libc::poll(&mut pollfd, 1, timeout.as_millis() as libc::c_int) };
    if ready < 0 {
        let error = std::io::Error::last_os_error();
        if error.kind() == std::io::ErrorKind::Interrupted {
            return Ok(false);
        }
        return Err(format!("cannot poll the gpuvm connection: {error}"));
    }
    if ready == 0 {
        return Ok(false);
    }
    if pollfd.revents & (libc::POLLHUP | libc::POLLRDHUP | libc::POLLERR) != 0 {
        return Ok(true);
    }
    // Readable: EOF, or unexpected bytes which we drop.
    let mut buffer = [0u8; 256];
    match (&*connection).read(&mut buffer) {
        Ok(0) => Ok(true),
        Ok(_) => Ok(false),
        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => Ok(false),
        Err(_) => Ok(true),
    }
}
