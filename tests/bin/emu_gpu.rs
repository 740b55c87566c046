//! `gpuvm-emu-gpu --socket PATH [--bar1-mib N] [--vectors N] [--clients N]
//! [--device-id HEX] [--no-migration] [--reset-fails] [--dead-after-reset]`: serves the emulated NVIDIA-like GPU (gpuvm_vfio::emu) over
//! vfio-user to N clients (default 1), one after another, then exits. `--device-id`
//! makes it another model (tests of model checks); `--no-migration` leaves out the
//! migration region (a device that cannot be snapshotted). `--reset-fails` answers every
//! reset with an error; `--dead-after-reset` makes configuration space read all ones after
//! a reset (a device that does not come back).

use std::path::PathBuf;
use std::process::ExitCode;

use gpuvm_vfio::emu::{serve, EmuGpuOptions};

fn usage(error: &str) -> ExitCode {
    eprintln!(
        "gpuvm-emu-gpu: {error}\nusage: gpuvm-emu-gpu --socket PATH [--bar1-mib N] [--vectors N] [--clients N] [--device-id HEX] [--no-migration] [--reset-fails] [--dead-after-reset]"
    );
    ExitCode::from(2)
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().filter_or("GPUVM_LOG", "warn")).init();
    let mut socket = None;
    let mut options = EmuGpuOptions::default();
    let mut clients: u32 = 1;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| args.next().ok_or_else(|| format!("{name} needs a value"));
        let result: Result<(), String> = match arg.as_str() {
            "--socket" => value("--socket").map(|v| socket = Some(PathBuf::from(v))),
            "--bar1-mib" => value("--bar1-mib").and_then(|v| {
                let mib: u64 = v.parse().map_err(|_| format!("bad --bar1-mib '{v}'"))?;
                if mib == 0 || !mib.is_power_of_two() {
                    return Err(format!("--bar1-mib must be a power of two, not {mib}"));
                }
                options.bar1_size = mib << 20;
                Ok(())
            }),
            "--vectors" => value("--vectors").and_then(|v| {
                let n: u16 = v.parse().map_err(|_| format!("bad --vectors '{v}'"))?;
                if n == 0 || n > 2048 {
                    return Err("--vectors must be 1..=2048".into());
                }
                options.msix_vectors = n;
                Ok(())
            }),
            "--device-id" => value("--device-id").and_then(|v| {
                options.device_id = u16::from_str_radix(v.trim_start_matches("0x"), 16)
                    .map_err(|_| format!("bad --device-id '{v}' (hex)"))?;
                Ok(())
            }),
            "--no-migration" => {
                options.migration = false;
                Ok(())
            }
            "--reset-fails" => {
                options.reset_fails = true;
                Ok(())
            }
            "--dead-after-reset" => {
                options.dead_after_reset = true;
                Ok(())
            }
            "--clients" => value("--clients").and_then(|v| {
                clients = v
                    .parse()
                    .ok()
                    .filter(|n| *n > 0)
                    .ok_or_else(|| format!("bad --clients '{v}'"))?;
                Ok(())
            }),
            other => Err(format!("unknown argument '{other}'")),
        };
        if let Err(error) = result {
            return usage(&error);
        }
    }
    let Some(socket) = socket else {
        return usage("--socket is required");
    };
    // Each client gets the device fresh from reset, as a VMM that plugs the same device
    // again after an unplug (a GPU given back after a guest release) would.
    for _ in 0..clients {
        if let Err(error) = serve(&socket, options) {
            eprintln!("gpuvm-emu-gpu: {}: {error}", socket.display());
            return ExitCode::from(1);
        }
    }
    ExitCode::SUCCESS
}
