//! ioctl request numbers the filters name (as kvm-ioctls, vfio-ioctls and userfaultfd
//! define them), and the `_IOC` encoding they are built with.

use std::mem::size_of;

use kvm_bindings::{
    kvm_clock_data, kvm_cpuid2, kvm_debugregs, kvm_device_attr, kvm_dirty_log, kvm_fpu,
    kvm_irq_routing, kvm_irqchip, kvm_irqfd, kvm_lapic_state, kvm_mp_state, kvm_msr_list, kvm_msrs,
    kvm_pit_state2, kvm_regs, kvm_sregs, kvm_userspace_memory_region, kvm_vcpu_events, kvm_xcrs,
    kvm_xsave,
};

/// `_IOC(dir, type, nr, size)` as the kernel encodes ioctl request numbers.
const fn ioc(dir: u32, ty: u32, nr: u32, size: usize) -> u32 {
    (dir << 30) | ((size as u32) << 16) | (ty << 8) | nr
}
const IOC_NONE: u32 = 0;
const IOC_WRITE: u32 = 1;
const IOC_READ: u32 = 2;
const fn io(ty: u32, nr: u32) -> u32 {
    ioc(IOC_NONE, ty, nr, 0)
}
const fn ior(ty: u32, nr: u32, size: usize) -> u32 {
    ioc(IOC_READ, ty, nr, size)
}
const fn iow(ty: u32, nr: u32, size: usize) -> u32 {
    ioc(IOC_WRITE, ty, nr, size)
}
const fn iowr(ty: u32, nr: u32, size: usize) -> u32 {
    ioc(IOC_READ | IOC_WRITE, ty, nr, size)
}

const KVMIO: u32 = 0xAE;
// System (/dev/kvm) and VM.
pub const KVM_CHECK_EXTENSION: u32 = io(KVMIO, 0x03);
pub const KVM_GET_MSR_INDEX_LIST: u32 = iowr(KVMIO, 0x02, size_of::<kvm_msr_list>());
pub const KVM_GET_DIRTY_LOG: u32 = iow(KVMIO, 0x42, size_of::<kvm_dirty_log>());
pub const KVM_SET_USER_MEMORY_REGION: u32 =
    iow(KVMIO, 0x46, size_of::<kvm_userspace_memory_region>());
pub const KVM_GET_IRQCHIP: u32 = iowr(KVMIO, 0x62, size_of::<kvm_irqchip>());
pub const KVM_SET_GSI_ROUTING: u32 = iow(KVMIO, 0x6a, size_of::<kvm_irq_routing>());
pub const KVM_IRQFD: u32 = iow(KVMIO, 0x76, size_of::<kvm_irqfd>());
pub const KVM_GET_CLOCK: u32 = ior(KVMIO, 0x7c, size_of::<kvm_clock_data>());
pub const KVM_GET_PIT2: u32 = ior(KVMIO, 0x9f, size_of::<kvm_pit_state2>());
pub const KVM_SET_DEVICE_ATTR: u32 = iow(KVMIO, 0xe1, size_of::<kvm_device_attr>());
pub const KVM_IOEVENTFD: u32 = iow(KVMIO, 0x79, size_of::<kvm_bindings::kvm_ioeventfd>());
pub const KVM_HAS_DEVICE_ATTR: u32 = iow(KVMIO, 0xe3, size_of::<kvm_device_attr>());
/// vCPU hot-plug: the VMM thread creates and sets up a vCPU (see [`KVM_SET_CPUID2`]).
pub const KVM_CREATE_VCPU: u32 = io(KVMIO, 0x41);
// vCPU.
pub const KVM_RUN: u32 = io(KVMIO, 0x80);
pub const KVM_GET_REGS: u32 = ior(KVMIO, 0x81, size_of::<kvm_regs>());
pub const KVM_SET_REGS: u32 = iow(KVMIO, 0x82, size_of::<kvm_regs>());
pub const KVM_GET_SREGS: u32 = ior(KVMIO, 0x83, size_of::<kvm_sregs>());
pub const KVM_GET_MSRS: u32 = iowr(KVMIO, 0x88, size_of::<kvm_msrs>());
pub const KVM_GET_LAPIC: u32 = ior(KVMIO, 0x8e, size_of::<kvm_lapic_state>());
pub const KVM_GET_CPUID2: u32 = iowr(KVMIO, 0x91, size_of::<kvm_cpuid2>());
pub const KVM_GET_MP_STATE: u32 = ior(KVMIO, 0x98, size_of::<kvm_mp_state>());
pub const KVM_GET_VCPU_EVENTS: u32 = ior(KVMIO, 0x9f, size_of::<kvm_vcpu_events>());
pub const KVM_SET_VCPU_EVENTS: u32 = iow(KVMIO, 0xa0, size_of::<kvm_vcpu_events>());
pub const KVM_GET_DEBUGREGS: u32 = ior(KVMIO, 0xa1, size_of::<kvm_debugregs>());
pub const KVM_GET_TSC_KHZ: u32 = io(KVMIO, 0xa3);
pub const KVM_GET_XSAVE: u32 = ior(KVMIO, 0xa4, size_of::<kvm_xsave>());
pub const KVM_GET_XCRS: u32 = ior(KVMIO, 0xa6, size_of::<kvm_xcrs>());
/// Setting up a hot-plugged vCPU as the builder sets up the boot ones: CPUID, MSRs, FPU,
/// local APIC.
pub const KVM_SET_MSRS: u32 = iow(KVMIO, 0x89, size_of::<kvm_msrs>());
pub const KVM_SET_FPU: u32 = iow(KVMIO, 0x8d, size_of::<kvm_fpu>());
pub const KVM_SET_LAPIC: u32 = iow(KVMIO, 0x8f, size_of::<kvm_lapic_state>());
pub const KVM_SET_CPUID2: u32 = iow(KVMIO, 0x90, size_of::<kvm_cpuid2>());

// VFIO (`_IO(';', 100 + n)`) and iommufd (`_IO(';', 0x80 + n)`).
const VFIO: u32 = b';' as u32;
pub const VFIO_GET_API_VERSION: u32 = io(VFIO, 100);
pub const VFIO_CHECK_EXTENSION: u32 = io(VFIO, 100 + 1);
pub const VFIO_SET_IOMMU: u32 = io(VFIO, 100 + 2);
pub const VFIO_GROUP_GET_STATUS: u32 = io(VFIO, 100 + 3);
pub const VFIO_GROUP_SET_CONTAINER: u32 = io(VFIO, 100 + 4);
pub const VFIO_GROUP_GET_DEVICE_FD: u32 = io(VFIO, 100 + 6);
pub const VFIO_DEVICE_GET_INFO: u32 = io(VFIO, 100 + 7);
pub const VFIO_IOMMU_GET_INFO: u32 = io(VFIO, 100 + 12);
pub const VFIO_DEVICE_BIND_IOMMUFD: u32 = io(VFIO, 100 + 18);
pub const VFIO_DEVICE_ATTACH_IOMMUFD_PT: u32 = io(VFIO, 100 + 19);
pub const IOMMU_IOAS_ALLOC: u32 = io(VFIO, 0x81);
pub const KVM_CREATE_DEVICE: u32 = iowr(KVMIO, 0xe0, size_of::<kvm_bindings::kvm_create_device>());
pub const VFIO_GROUP_UNSET_CONTAINER: u32 = io(VFIO, 100 + 5);
pub const VFIO_DEVICE_GET_REGION_INFO: u32 = io(VFIO, 100 + 8);
pub const VFIO_DEVICE_GET_IRQ_INFO: u32 = io(VFIO, 100 + 9);
pub const VFIO_DEVICE_SET_IRQS: u32 = io(VFIO, 100 + 10);
pub const VFIO_DEVICE_RESET: u32 = io(VFIO, 100 + 11);
/// VFIO migration v2 (saving a device's state into a snapshot, loading it on restore).
pub const VFIO_DEVICE_FEATURE: u32 = io(VFIO, 100 + 17);
pub const VFIO_IOMMU_MAP_DMA: u32 = io(VFIO, 100 + 13);
pub const VFIO_IOMMU_UNMAP_DMA: u32 = io(VFIO, 100 + 14);
pub const VFIO_DEVICE_DETACH_IOMMUFD_PT: u32 = io(VFIO, 100 + 20);
pub const IOMMU_DESTROY: u32 = io(VFIO, 0x80);
pub const IOMMU_IOAS_MAP: u32 = io(VFIO, 0x85);
pub const IOMMU_IOAS_UNMAP: u32 = io(VFIO, 0x86);

// userfaultfd.
const UFFDIO: u32 = 0xAA;
/// struct uffdio_range: start, len.
const UFFDIO_RANGE: usize = 16;
/// struct uffdio_api: api, features, ioctls.
pub const UFFDIO_API: u32 = iowr(UFFDIO, 0x3F, 24);
/// struct uffdio_register: range, mode, ioctls.
pub const UFFDIO_REGISTER: u32 = iowr(UFFDIO, 0x00, 32);
/// struct uffdio_writeprotect: range, mode.
pub const UFFDIO_WRITEPROTECT: u32 = iowr(UFFDIO, 0x06, 24);
pub const UFFDIO_UNREGISTER: u32 = ior(UFFDIO, 0x01, UFFDIO_RANGE);
pub const UFFDIO_WAKE: u32 = ior(UFFDIO, 0x02, UFFDIO_RANGE);
/// struct uffdio_copy: dst, src, len, mode, copy.
pub const UFFDIO_COPY: u32 = iowr(UFFDIO, 0x03, 40);
/// struct uffdio_zeropage: range, mode, zeropage.
pub const UFFDIO_ZEROPAGE: u32 = iowr(UFFDIO, 0x04, 32);

// Terminals (stdin in raw mode while the guest runs, restored at the end).
pub const TCGETS: u32 = 0x5401;
pub const TCSETS: u32 = 0x5402;
pub const TCSETSW: u32 = 0x5403;
pub const TIOCGWINSZ: u32 = 0x5413;
pub const FIONBIO: u32 = 0x5421;
pub const FIOCLEX: u32 = 0x5451;
/// virtio-net: attaches or detaches one queue of a multi-queue tap.
pub const TUNSETQUEUE: u32 = iow(b'T' as u32, 217, size_of::<i32>());
/// virtio-net hot-plugged after start: its tap queues opened by name (TUNSETIFF) or checked
/// (TUNGETIFF), and set up (offloads, vnet header size).
pub const TUNSETIFF: u32 = iow(b'T' as u32, 202, size_of::<i32>());
pub const TUNGETIFF: u32 = ior(b'T' as u32, 210, size_of::<u32>());
pub const TUNSETOFFLOAD: u32 = iow(b'T' as u32, 208, size_of::<u32>());
pub const TUNSETVNETHDRSZ: u32 = iow(b'T' as u32, 216, size_of::<i32>());

#[cfg(test)]
mod tests {
    use crate::seccomp::ioctls;

    #[test]
    fn ioctl_numbers_match_the_kernel() {
        assert_eq!(ioctls::KVM_RUN, 0xae80);
        assert_eq!(ioctls::KVM_GET_REGS, 0x8090_ae81);
        assert_eq!(ioctls::KVM_SET_USER_MEMORY_REGION, 0x4020_ae46);
        assert_eq!(ioctls::KVM_IRQFD, 0x4020_ae76);
        assert_eq!(ioctls::KVM_GET_DIRTY_LOG, 0x4010_ae42);
        assert_eq!(ioctls::UFFDIO_COPY, 0xc028_aa03);
        assert_eq!(ioctls::UFFDIO_WAKE, 0x8010_aa02);
        assert_eq!(ioctls::UFFDIO_API, 0xc018_aa3f);
        assert_eq!(ioctls::UFFDIO_REGISTER, 0xc020_aa00);
        assert_eq!(ioctls::UFFDIO_WRITEPROTECT, 0xc018_aa06);
        assert_eq!(ioctls::VFIO_DEVICE_SET_IRQS, 0x3b6e);
        assert_eq!(ioctls::VFIO_IOMMU_MAP_DMA, 0x3b71);
        // iommufd-ioctls' own test: IOMMU_IOAS_MAP() == 15237.
        assert_eq!(ioctls::IOMMU_IOAS_MAP, 15237);
        assert_eq!(ioctls::IOMMU_IOAS_UNMAP, 0x3b86);
        assert_eq!(ioctls::KVM_IOEVENTFD, 0x4040_ae79);
        assert_eq!(ioctls::TUNSETQUEUE, 0x4004_54d9);
        assert_eq!(ioctls::TUNSETIFF, libc::TUNSETIFF as u32);
        assert_eq!(ioctls::TUNGETIFF, libc::TUNGETIFF as u32);
        assert_eq!(ioctls::TUNSETOFFLOAD, libc::TUNSETOFFLOAD as u32);
        assert_eq!(ioctls::TUNSETVNETHDRSZ, libc::TUNSETVNETHDRSZ as u32);
        // The kernel's values (include/uapi/linux/kvm.h on x86_64).
        assert_eq!(ioctls::KVM_CREATE_VCPU, 0xae41);
        assert_eq!(ioctls::KVM_SET_CPUID2, 0x4008_ae90);
        assert_eq!(ioctls::KVM_SET_MSRS, 0x4008_ae89);
        assert_eq!(ioctls::KVM_SET_FPU, 0x41a0_ae8d);
        assert_eq!(ioctls::KVM_SET_LAPIC, 0x4400_ae8f);
    }
}
