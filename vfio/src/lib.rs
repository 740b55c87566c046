//! PCI device passthrough for gpuvm.
//!
//! Kernel VFIO (vfio-ioctls) and vfio-user backends behind one trait land with the
//! passthrough work (issue 4); the crate exists now so the workspace has its final shape.
