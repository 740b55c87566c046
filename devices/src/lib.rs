//! Emulated devices for gpuvm.
//!
//! - [`bus`]: the address bus that routes port I/O and MMIO exits to devices.
//! - [`serial`]: a 16550A UART for the console.
//! - [`i8042`]: the keyboard controller, only for its CPU-reset command.
//! - [`acpi_sleep`]: the hardware-reduced ACPI sleep control register, for power-off.
//! - [`cpu_hotplug`]: the ACPI CPU hot-plug register block (vCPUs added and removed).
//! - [`memory_hotplug`]: the ACPI memory hot-plug register block (RAM added by vm.resize).
//! - [`exit_port`]: where the guest reports its exit status.
//! - [`pci`]: the PCI root bus, BAR emulation and MSI-X.
//! - [`sink`]: harmless stand-ins for legacy ports Linux probes (POST code, CMOS/RTC).
//! - [`persist`]: the trait through which every component with state is saved and restored.
//!
//! Every device accepts any access a guest can make (odd widths, offsets past its
//! registers, empty accesses) without panicking.

pub mod acpi_sleep;
pub mod bus;
pub mod cpu_hotplug;
pub mod exit_port;
pub mod i8042;
pub mod memory_hotplug;
pub mod pci;
pub mod persist;
pub mod serial;
pub mod sink;

pub use acpi_sleep::AcpiSleepControl;
pub use bus::{Bus, BusDevice, BusError};
pub use cpu_hotplug::{CpuHotplug, CpuHotplugState};
pub use exit_port::{ExitPort, ExitStatus};
pub use i8042::I8042;
pub use memory_hotplug::{MemoryHotplug, MemoryHotplugState};
pub use persist::Persist;
pub use serial::{SerialDevice, SerialError, SerialState};
pub use sink::Sink;
