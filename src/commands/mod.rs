pub mod generate;
pub mod kernels;
pub mod keys;
pub mod model;
pub mod serve;
