//! The data plane starckpt's clients and storage targets share: how chunk bytes are held and
//! moved. `starckpt-proto` is the contract (frame and header formats, validated types); this crate
//! is the machinery on both ends of it.
//!
//! - [`buf`]: staging buffers and their bounded pools (heap, or shared-memory regions).
//! - [`shm`]: same-host shared memory (sealed memfd regions, the attach handshake over a Unix
//!   socket).
//! - [`zerocopy`]: the frame writer both ends use, sending large payloads over TCP zero-copy
//!   (io_uring SEND_ZC) where that pays.
//! - [`rdma`]: the RDMA fields of frames (queue-pair endpoints, client buffers), checked.
//! - [`transport`]: the chunk transport trait and its TCP, shared-memory and RDMA clients.
//! - [`placement`]: which targets hold a chunk's copies.
//! - [`faults`]: fault points for the crash matrix (the `testing` feature).
//! - [`blocking`]: blocking work run from async code.
//! - [`sync`]: locks whose holder panicked, used as they are.

pub mod blocking;
pub mod buf;
pub mod faults;
pub mod placement;
pub mod rdma;
pub mod shm;
pub mod sync;
pub mod transport;
pub mod zerocopy;
