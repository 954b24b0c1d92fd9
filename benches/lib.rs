//! Nothing to link: this crate holds the criterion benchmarks in `benches/` (run them with
//! `cargo bench -p starckpt-benches`) beside the end-to-end scripts in this directory.
