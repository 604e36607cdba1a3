//! Benchmark support crate: the benches live in `benches/benches/`.
