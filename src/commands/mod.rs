pub mod generate;
pub mod gpu;
pub mod kernels;
pub mod keys;
pub mod model;
pub mod serve;
