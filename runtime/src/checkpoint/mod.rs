//! Sharded training checkpoints: every rank writes only the state it owns (weights and AdamW
//! moments) in the checkpoint's own coordinates — the model's stored tensor names, unfused and
//! untransposed, blocks at offsets of the whole tensor — and any layout reads back only the
//! blocks it needs.
//!
//! A checkpoint directory holds one directory per saved step and a pointer to the newest:
//!
//! ```text
//! DIR/latest                      "step-00000003"
//! DIR/step-00000003/manifest.json the step, data position, model config, the layout saved
//!                                 from (mesh, strategies, plan hash) and every chunk
//! DIR/step-00000003/rank-00000.bin one file per rank: its chunks, f32 little-endian,
//!                                 each row-major over its block
//! ```
//!
//! A step directory is built beside its final name and renamed into place once its manifest
//! is written; `latest` is replaced atomically after that. A crash at any point leaves the
//! previous step as the latest valid checkpoint. Opening verifies the manifest: every chunk
//! inside its tensor and file, and every tensor's state covered by chunks exactly once; each
//! chunk's BLAKE3 checksum is checked when it is first read.

mod export;
mod read;
mod write;

pub use export::{export, is_model_file, ExportDType, Exported, INDEX_FILE, SINGLE_FILE};
pub use read::step_dir;
pub use read::Checkpoint;
pub use write::{save_global, save_rank, SaveInfo};

use serde::{Deserialize, Serialize};
use shardc_compiler::checkpoint::{Block, SavedChunk, StateKind};
use shardc_compiler::ir::AdamWSpec;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// The manifest's `format` field.
pub const FORMAT: &str = "shardc-checkpoint";
/// The version of the layout this module writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// The manifest's file name in a step directory.
pub const MANIFEST_FILE: &str = "manifest.json";
/// The file naming the newest step directory.
pub const LATEST_FILE: &str = "latest";
/// Bytes per stored element (f32).
pub const ELEM_BYTES: u64 = 4;

/// BLAKE3 of `bytes` as checksums and digests are written: `blake3:` and 64 hex digits.
pub fn digest(bytes: &[u8]) -> String {
    format!("blake3:{}", blake3::hash(bytes).to_hex())
}

/// Whether `name` is an entry a checkpoint directory holds: `latest`, a step directory, or
/// the hidden staging of a save that was killed.
pub fn is_checkpoint_entry(name: &str) -> bool {
    name == LATEST_FILE || name.starts_with("step-") || name.starts_with('.')
}

/// The name of step `step`'s directory.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

/// The name of rank `rank`'s data file.
pub fn rank_file_name(rank: usize) -> String {
    format!("rank-{rank:05}.bin")
}

/// Everything a checkpoint holds besides tensor data.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`FORMAT`].
    pub format: String,
    /// [`FORMAT_VERSION`].
    pub format_version: u32,
    /// Optimizer steps taken.
    pub step: u64,
    /// Where the data stands.
    pub data: DataPosition,
    /// The model.
    pub model: SavedModel,
    /// The layout the checkpoint was saved from.
    pub layout: SavedLayout,
    /// The optimizer's hyperparameters.
    pub adamw: AdamWSpec,
    /// Every stored tensor by name.
    pub tensors: BTreeMap<String, SavedTensor>,
    /// One data file per rank of the saved layout, in rank order.
    pub files: Vec<SavedFile>,
    /// Every chunk of every file.
    pub chunks: Vec<ChunkRecord>,
}

/// The data position: the next sample to read, and what the samples were.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataPosition {
    /// Samples (sequences) consumed so far: the next sample's index.
    pub next_sample: u64,
    /// Sequences per step.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// BLAKE3 of the token ids read (little-endian i32), `blake3:…`.
    pub tokens: String,
}

/// The model a checkpoint belongs to.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SavedModel {
    /// Where it was loaded from.
    pub source: String,
    /// Its architecture.
    pub arch: String,
    /// Its `config.json`, as read.
    pub config: serde_json::Value,
}

/// The layout a checkpoint was saved from (informative: any layout resumes it).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedLayout {
    /// The mesh, `dp=2,tp=2` (empty: unsharded).
    pub mesh: String,
    /// Strategies applied.
    pub strategies: Vec<String>,
    /// The training plan's content hash.
    pub plan_hash: String,
    /// ZeRO stage.
    pub zero_stage: u8,
    /// Micro-batches per step.
    pub micro_batches: usize,
    /// Activation recomputation.
    pub recompute: String,
    /// The pipeline schedule, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule: Option<String>,
}

/// A stored tensor: its full shape, the dtype the model stored it in, and whether training
/// updates it (then its AdamW moments are in the checkpoint too).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedTensor {
    /// Full shape, stored layout.
    pub shape: Vec<usize>,
    /// The model's dtype for it (`F32`, `BF16`, `F16`): what an export writes by default.
    pub dtype: String,
    /// Updated by training (moments stored).
    pub trained: bool,
}

/// One rank's data file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedFile {
    /// File name in the step directory.
    pub name: String,
    /// Its size in bytes.
    pub bytes: u64,
}

/// One chunk: a block of one stored tensor's state, at a byte offset of a rank's file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkRecord {
    /// Stored tensor name.
    pub tensor: String,
    /// Which state.
    pub kind: StateKind,
    /// The block, in the stored tensor's coordinates.
    pub offset: Vec<usize>,
    /// Its extents.
    pub shape: Vec<usize>,
    /// The rank (and so the file) that holds it.
    pub rank: usize,
    /// Byte offset in the file.
    pub start: u64,
    /// BLAKE3 of its bytes, `blake3:…`.
    pub checksum: String,
}

impl ChunkRecord {
    /// Its block.
    pub fn block(&self) -> Block {
        Block {
            offset: self.offset.clone(),
            shape: self.shape.clone(),
        }
    }

    /// Its size in bytes.
    pub fn bytes(&self) -> u64 {
        self.shape.iter().product::<usize>() as u64 * ELEM_BYTES
    }

    /// Its layout alone.
    pub fn saved(&self) -> SavedChunk {
        SavedChunk {
            tensor: self.tensor.clone(),
            kind: self.kind,
            block: self.block(),
            rank: self.rank,
            bytes: self.bytes(),
        }
    }

    /// `tensor` `kind` `[a:b, …]`, for messages.
    pub fn describe(&self) -> String {
        format!("`{}` {} {}", self.tensor, self.kind, self.block())
    }
}

/// A checkpoint that cannot be written, read or used: each names the path, tensor, range or
/// field at fault.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// An I/O error.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// No checkpoint at the path.
    #[error("{}: not a checkpoint (no `{LATEST_FILE}` file nor `{MANIFEST_FILE}`; `shardc train --save DIR` writes one)", path.display())]
    NotFound {
        /// The path given.
        path: PathBuf,
    },
    /// A manifest that is not valid.
    #[error("{}: {msg}", path.display())]
    Manifest {
        /// The manifest.
        path: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// Part of a tensor's state held by no chunk.
    #[error("checkpoint {}: `{tensor}` {kind}: elements {missing} are in no chunk ({uncovered} of {total} elements missing)", dir.display())]
    Missing {
        /// The step directory.
        dir: PathBuf,
        /// The stored tensor.
        tensor: String,
        /// Which state.
        kind: StateKind,
        /// The first uncovered run of elements.
        missing: Block,
        /// Elements not covered.
        uncovered: usize,
        /// Elements of the tensor.
        total: usize,
    },
    /// Two chunks holding the same elements.
    #[error("checkpoint {}: `{tensor}` {kind}: chunks {chunks} overlap", dir.display())]
    Overlap {
        /// The step directory.
        dir: PathBuf,
        /// The stored tensor.
        tensor: String,
        /// Which state.
        kind: StateKind,
        /// The two chunks' blocks and ranks: `[0:4, 0:8] (rank 0) and … (rank 1)`.
        chunks: String,
    },
    /// A chunk whose bytes do not match its checksum.
    #[error("{}: chunk {chunk} at bytes {start}..{end} fails its checksum (corrupt or modified)", file.display())]
    Checksum {
        /// The data file.
        file: PathBuf,
        /// The chunk.
        chunk: String,
        /// Its first byte.
        start: u64,
        /// Past its last byte.
        end: u64,
    },
    /// The checkpoint and the model or plan disagree.
    #[error("checkpoint {}: {msg}", dir.display())]
    Mismatch {
        /// The step directory.
        dir: PathBuf,
        /// What differs.
        msg: String,
    },
    /// A layout the plan cannot describe.
    #[error(transparent)]
    Layout(#[from] shardc_compiler::checkpoint::LayoutError),
    /// A file could not be written atomically.
    #[error(transparent)]
    Output(#[from] crate::output::OutputError),
    /// The model's weights could not be read.
    #[error(transparent)]
    Runtime(#[from] crate::RuntimeError),
}

pub(crate) fn io_err(
    path: &std::path::Path,
) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Calls `f(src, dst, len)` for each contiguous row of `region`, a block inside both `src`
/// and `dst` (blocks of the same tensor, each row-major over its own shape): `src` and `dst`
/// are the row's first element's index in each, `len` its length.
pub(crate) fn for_each_row(
    region: &Block,
    src: &Block,
    dst: &Block,
    mut f: impl FnMut(usize, usize, usize),
) {
    let r = region.shape.len();
    if r == 0 {
        f(0, 0, 1);
        return;
    }
    if region.numel() == 0 {
        return;
    }
    let strides = |b: &Block| crate::weights::row_major_strides(&b.shape);
    let (ss, ds) = (strides(src), strides(dst));
    let len = region.shape[r - 1];
    let rows: usize = region.shape[..r - 1].iter().product();
    let mut idx = vec![0usize; r - 1];
    for _ in 0..rows {
        let (mut s, mut d) = (0, 0);
        for k in 0..r {
            let at = region.offset[k] + if k < r - 1 { idx[k] } else { 0 };
            s += (at - src.offset[k]) * ss[k];
            d += (at - dst.offset[k]) * ds[k];
        }
        f(s, d, len);
        // Next row: odometer over the outer dims.
        for k in (0..r - 1).rev() {
            idx[k] += 1;
            if idx[k] < region.shape[k] {
                break;
            }
            idx[k] = 0;
        }
    }
}

/// `data`, row-major over `shape`, with its last two dims swapped.
pub(crate) fn transpose_last2(data: &[f32], shape: &[usize]) -> Vec<f32> {
    let r = shape.len();
    let mut perm: Vec<usize> = (0..r).collect();
    perm.swap(r - 2, r - 1);
    crate::cpu::layout::permute(data, shape, &perm)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_of_a_region_index_both_blocks() {
        // A [4, 6] tensor; src holds rows 0..4 cols 2..6, dst cols 0..6 rows 1..3.
        let src = Block {
            offset: vec![0, 2],
            shape: vec![4, 4],
        };
        let dst = Block {
            offset: vec![1, 0],
            shape: vec![2, 6],
        };
        let region = src.intersect(&dst).unwrap();
        let mut rows = Vec::new();
        for_each_row(&region, &src, &dst, |s, d, n| rows.push((s, d, n)));
        assert_eq!(rows, vec![(4, 2, 4), (8, 8, 4)]);
    }

    #[test]
    fn transpose_swaps_the_last_two_dims() {
        let x: Vec<f32> = (0..6).map(|v| v as f32).collect();
        assert_eq!(
            transpose_last2(&x, &[2, 3]),
            vec![0.0, 3.0, 1.0, 4.0, 2.0, 5.0]
        );
    }
}
