//! gpuvm's architecture support: what a guest of one CPU architecture needs from the VMM
//! beyond KVM itself. Each architecture is a module; x86_64 is the only one today.
//!
//! - [`x86_64::layout`]: the guest-physical memory map (RAM regions, e820, boot structures,
//!   the MMIO hole with its PCI windows).
//! - [`x86_64::boot`]: loading kernels with the PVH and Linux 64-bit boot protocols.
//! - [`x86_64::acpi`] and [`x86_64::mptable`]: the firmware tables guests read.
//! - [`x86_64::cpuid`], [`x86_64::msr`], [`x86_64::regs`], [`x86_64::gdt`]: vCPU state at boot.
//! - [`x86_64::emulate`]: instructions KVM's emulator leaves to the VMM.
//!
//! It knows nothing of the VMM: callers pass in guest memory, KVM state and the PCI root's
//! layout, and get typed errors back.

pub mod x86_64;
