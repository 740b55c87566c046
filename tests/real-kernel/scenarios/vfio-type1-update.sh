# about: live update of a VM with kernel VFIO through the type1 container/group API: edu's DMA and MSI run in a loop while `gpuvm update` hands the VM to a new process, twice; the DMA mappings' host addresses move to the new process (VFIO_DMA_UNMAP_FLAG_VADDR, VFIO_DMA_MAP_FLAG_VADDR), nothing unmapped or pinned again; a failed update first puts them back on the old process
# qemu: -device edu,addr=0x4
. /lib/real-kernel.sh
# The scenario is lib.sh's, shared with vfio-iommufd-update.
edu_live_update_scenario type1
