//! The control plane: jobs, checkpoints, manifests and targets behind a gRPC service.
//!
//! Entry point: [`service::run`]. The binary (`starckpt server`) only parses flags and calls it.
pub mod auth;
mod convert;
mod copying;
pub mod gc;
pub mod repair;
pub mod service;
mod silence;
pub mod sql;
pub mod store;
pub mod tier;
pub mod tls;

pub use service::{ControlConfig, open_store, run};
pub use sql::DatabaseLock;
