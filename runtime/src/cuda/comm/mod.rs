//! Device communicators: the collectives of [`crate::comm`] on CUDA device buffers, over one
//! group of ranks (one mesh axis): NCCL ([`nccl`]) and a single-process peer-to-peer fallback
//! ([`local_gpu`]), behind the one [`device::DeviceCommunicator`] trait.

pub mod device;
pub mod local_gpu;
pub mod nccl;
