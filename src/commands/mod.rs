pub mod generate;
pub mod model;
