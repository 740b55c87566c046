//! vCPU hot-plug of the running machine (Cloud Hypervisor's vm.resize), by ACPI as Cloud
//! Hypervisor and QEMU do it: the CPU hot-plug register block
//! (gpuvm_devices::cpu_hotplug) tells the guest which CPUs are present and which it is
//! asked to eject, the DSDT's processor devices (arch/src/x86_64/acpi/cpus.rs) let it
//! find them.
//!
//! Threads: every possible vCPU's thread is started with the VM, under the vCPU filter
//! (a thread started later would inherit the VMM thread's filter, and the vCPU filter
//! cannot be stacked onto it: KVM_RUN would stay forbidden). A hot-plugged vCPU is
//! created and set up here, on the VMM thread (KVM_CREATE_VCPU and the setup ioctls are
//! in its filter), and handed to its waiting thread, like the boot vCPUs in
//! [`Machine::run`]. A vCPU the guest ejects keeps its thread, paused ("parked"); KVM
//! cannot destroy a vCPU, so a later hot-plug of the same CPU resumes it, and the guest
//! starts it again with INIT/SIPI.

use std::sync::{Arc, Mutex};

use gpuvm_devices::CpuHotplug;

use super::{Machine, RunningMachine};
use crate::lock;
use crate::vcpu::VcpuError;

/// Why the vCPU count could not change.
#[derive(Debug, thiserror::Error)]
pub enum CpuResizeError {
    #[error("this VM has no vCPU hot-plug (it was created with max_vcpus = its vCPU count)")]
    NoHotplug,
    #[error("vCPU {0} has no thread waiting for it")]
    NoThread(u8),
    #[error("cannot add vCPU {id}: {source}")]
    Add { id: u8, source: VcpuError },
}

impl CpuResizeError {
    /// The HTTP status the API answers with.
    pub fn status(&self) -> u16 {
        match self {
            CpuResizeError::NoHotplug => 400,
            CpuResizeError::NoThread(_) | CpuResizeError::Add { .. } => 500,
        }
    }
}

impl Machine {
    /// The vCPUs the guest has now (hot-plugged ones included, ejected ones not).
    pub fn vcpu_count(&self) -> u8 {
        self.config.vcpus
    }

    /// The vCPUs the guest may have (ACPI hot-plug up to this many).
    pub fn max_vcpus(&self) -> u8 {
        self.max_vcpus.max(self.config.vcpus)
    }

    /// Whether vCPUs can be hot-plugged (the VM may have more than it booted with).
    pub fn has_vcpu_hotplug(&self) -> bool {
        self.devices.cpu_hotplug.is_some()
    }

    fn cpu_hotplug(&self) -> Option<Arc<Mutex<CpuHotplug>>> {
        self.devices.cpu_hotplug.clone()
    }
}

impl RunningMachine<'_> {
    /// Brings the guest to `vcpus` vCPUs (1 to [`Machine::max_vcpus`], checked by the
    /// caller). More: the lowest absent CPUs are added and the guest told (it starts them
    /// with INIT/SIPI). Fewer: the guest is asked to eject the highest present ones (CPU
    /// 0 never), and the count drops as it does; removals asked for earlier and no longer
    /// wanted are withdrawn. Answers at once, as Cloud Hypervisor does.
    pub fn resize_vcpus(&mut self, vcpus: u8) -> Result<(), CpuResizeError> {
        let Some(block) = self.machine.cpu_hotplug() else {
            return if vcpus == self.machine.vcpu_count() {
                Ok(())
            } else {
                Err(CpuResizeError::NoHotplug)
            };
        };
        self.park_ejected_vcpus();
        let present = lock(&block).present();
        let wanted = usize::from(vcpus);
        if wanted >= present.len() {
            for cpu in lock(&block).removing() {
                lock(&block).cancel_remove(cpu);
            }
            let absent: Vec<u8> = (0..self.machine.max_vcpus())
                .filter(|cpu| !present.contains(cpu))
                .take(wanted - present.len())
                .collect();
            for cpu in absent {
                self.add_vcpu(cpu)?;
                lock(&block).insert(cpu);
                self.machine.config.vcpus = self.machine.config.vcpus.saturating_add(1);
                log::info!(
                    "vCPU {cpu} hot-plugged; the guest has {} vCPU(s)",
                    self.machine.config.vcpus
                );
            }
        } else {
            // CPU 0 is first, and stays.
            for (index, &cpu) in present.iter().enumerate() {
                if index < wanted {
                    lock(&block).cancel_remove(cpu);
                } else if lock(&block).request_remove(cpu) {
                    log::info!("the guest is asked to eject vCPU {cpu}");
                }
            }
        }
        Ok(())
    }

    /// Hands vCPU `cpu` to the guest: a parked one (ejected before) is resumed, else it is
    /// created and handed to its waiting thread. It runs unless the VM is paused.
    fn add_vcpu(&mut self, cpu: u8) -> Result<(), CpuResizeError> {
        let add = |source| CpuResizeError::Add { id: cpu, source };
        let paused = self.machine.paused;
        if let Some(at) = self.parked.iter().position(|h| h.id == cpu) {
            let handle = self.parked.swap_remove(at);
            let resumed = if paused { Ok(()) } else { handle.resume() };
            self.handles.push(handle);
            return resumed.map_err(add);
        }
        let template = self
            .machine
            .vcpu_template
            .as_ref()
            .ok_or(CpuResizeError::NoHotplug)?;
        let at = self
            .machine
            .vcpu_threads
            .iter()
            .position(|t| t.id() == cpu)
            .ok_or(CpuResizeError::NoThread(cpu))?;
        let devices = &self.machine.devices;
        let vcpu = template
            .create(
                &self.machine.vm,
                cpu,
                devices.io_bus.clone(),
                devices.mmio_bus.clone(),
            )
            .map_err(add)?;
        let thread = self.machine.vcpu_threads.swap_remove(at);
        let mut handle = thread.launch(vcpu, self.reporter.clone()).map_err(add)?;
        if let Some(cause) = self.machine.stall_cause() {
            handle.set_stall_cause(cause);
        }
        let ready = handle.wait_ready();
        let resumed = ready.and_then(|()| if paused { Ok(()) } else { handle.resume() });
        // Steered with the others from now on, whatever happened.
        self.handles.push(handle);
        resumed.map_err(add)
    }

    /// Parks the vCPUs the guest ejected: their threads pause (out of KVM_RUN for good,
    /// unless the CPU is hot-plugged again) and they leave the guest's count.
    pub(crate) fn park_ejected_vcpus(&mut self) {
        let Some(block) = self.machine.cpu_hotplug() else {
            return;
        };
        let ejected = lock(&block).take_ejected();
        for cpu in ejected {
            let Some(at) = self.handles.iter().position(|h| h.id == cpu) else {
                continue;
            };
            let handle = self.handles.remove(at);
            if let Err(error) = handle.pause() {
                log::warn!("vCPU {cpu} ejected by the guest but not parked: {error}");
            }
            self.parked.push(handle);
            self.machine.config.vcpus = self.machine.config.vcpus.saturating_sub(1);
            log::info!(
                "vCPU {cpu} ejected by the guest and parked; the guest has {} vCPU(s)",
                self.machine.config.vcpus
            );
        }
    }
}
