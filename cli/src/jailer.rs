//! gpuvm as Firecracker's `jailer` (invoked as `jailer` or `gpuvm jailer`): the gpuvm-jailer crate.
pub use gpuvm_jailer::{main, wanted};
