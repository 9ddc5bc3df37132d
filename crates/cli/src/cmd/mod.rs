pub mod image;
pub mod sandbox;
pub mod up;
