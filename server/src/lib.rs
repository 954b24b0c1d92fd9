//! starckpt server side: the control plane ([`control`]) and the storage target ([`target`]).
//! They share no mutable state; a process may run either or both (`starckpt dev`).
pub mod control;
pub mod dev;
pub mod lockfile;
pub mod target;
pub mod telemetry;
pub mod testing;
