pub mod iam;
pub mod image;
pub mod runtime;
pub mod sandbox;
pub mod up;
