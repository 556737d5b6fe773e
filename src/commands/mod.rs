pub mod generate;
pub mod keys;
pub mod model;
pub mod serve;
