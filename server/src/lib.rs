//! starckpt server side: the control plane ([`control`]) and the storage target ([`chunkserver`]).
//! They share no mutable state; a process may run either or both (`starckpt dev`).
pub mod chunkserver;
pub mod control;
pub mod dev;
pub mod lockfile;
pub mod telemetry;
pub mod testing;
