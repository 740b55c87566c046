# about: live update of a VM with kernel VFIO through iommufd: edu's DMA and MSI run in a loop while `gpuvm update` hands the VM to a new process, twice; the device is taken over, not reset or mapped again
# qemu: -device edu,addr=0x4
# kernel: iommufd
. /lib/real-kernel.sh
# The scenario is lib.sh's, shared with vfio-type1-update.
edu_live_update_scenario iommufd
