pub mod generate;
pub mod gpu;
pub mod gpu_nccl;
pub mod kernels;
pub mod keys;
pub mod model;
pub mod node;
pub mod serve;
