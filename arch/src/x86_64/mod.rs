//! x86_64 specifics: memory layout, boot protocols, CPU state, and firmware tables.

pub mod acpi;
pub mod address_space;
pub mod boot;
pub mod cpuid;
pub mod emulate;
pub mod gdt;
pub mod layout;
pub mod mptable;
pub mod msr;
pub mod regs;
pub mod reset_vector;
