//! Measuring for the scheduler: this device (kernels per weight format, memory, disk; a
//! cached profile) and a model (bytes and FLOPs per layer from its GGUF).

pub mod device;
pub mod host;
pub mod model;

pub use device::{device_profile, refresh_memory, serving_profile};
