//! Reading: a step directory opened and its manifest verified, blocks of any stored tensor's
//! state assembled from the chunks that overlap them (memory-mapped, checksummed on first
//! touch), a training plan's state loaded in its own layout.

use super::{
    for_each_row, io_err, transpose_last2, CheckpointError, ChunkRecord, Manifest, FORMAT,
    FORMAT_VERSION, LATEST_FILE, MANIFEST_FILE,
};
use crate::train::TrainState;
use crate::Tensor;
use memmap2::Mmap;
use rayon::prelude::*;
use shardc_compiler::checkpoint::{stored_pieces, Block, StateKind, StoredPiece};
use shardc_compiler::plan::Plan;
use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

/// An opened, verified checkpoint step.
pub struct Checkpoint {
    /// The step directory.
    pub dir: PathBuf,
    /// Its manifest.
    pub manifest: Manifest,
    /// Each rank's file mapped (`None`: empty).
    files: Vec<Option<Mmap>>,
    /// Chunk indices per stored tensor and state.
    index: BTreeMap<(String, StateKind), Vec<usize>>,
    /// Per chunk: its checksum already checked.
    verified: Vec<AtomicBool>,
}

impl Checkpoint {
    /// Opens a checkpoint: a checkpoint directory (its `latest` step) or a step directory;
    /// verifies the manifest (format, every chunk inside its tensor and its file, every
    /// tensor's state covered exactly once).
    pub fn open(path: &Path) -> Result<Checkpoint, CheckpointError> {
        let dir = step_dir(path)?;
        let mpath = dir.join(MANIFEST_FILE);
        let text = std::fs::read_to_string(&mpath).map_err(io_err(&mpath))?;
        let bad = |msg: String| CheckpointError::Manifest {
            path: mpath.clone(),
            msg,
        };
        let value: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
        match value.get("format").and_then(|f| f.as_str()) {
            Some(FORMAT) => {}
            other => {
                return Err(bad(format!(
                    "format {other:?}: not a shardc checkpoint manifest (`{FORMAT}`)"
                )))
            }
        }
        match value.get("format_version").and_then(|v| v.as_u64()) {
            Some(v) if v == u64::from(FORMAT_VERSION) => {}
            other => {
                return Err(bad(format!(
                    "format_version {other:?}: this shardc reads version {FORMAT_VERSION}"
                )))
            }
        }
        let manifest: Manifest = serde_json::from_value(value).map_err(|e| bad(format!("{e}")))?;
        let mut files = Vec::with_capacity(manifest.files.len());
        for f in &manifest.files {
            let p = dir.join(&f.name);
            if f.name.contains('/') || f.name.contains("..") {
                return Err(bad(format!(
                    "file name `{}` leaves the step directory",
                    f.name
                )));
            }
            let file = File::open(&p).map_err(io_err(&p))?;
            let len = file.metadata().map_err(io_err(&p))?.len();
            if len != f.bytes {
                return Err(CheckpointError::Mismatch {
                    dir: dir.clone(),
                    msg: format!(
                        "{} holds {len} bytes, the manifest says {} (truncated or replaced)",
                        f.name, f.bytes
                    ),
                });
            }
            // SAFETY: read-only map of a file no writer touches after publication; every
            // access is bounds-checked against the manifest, which was checked against the
            // file's length.
            files.push(if len == 0 {
                None
            } else {
                Some(unsafe { Mmap::map(&file) }.map_err(io_err(&p))?)
            });
        }
        let mut ck = Checkpoint {
            dir,
            verified: manifest
                .chunks
                .iter()
                .map(|_| AtomicBool::new(false))
                .collect(),
            manifest,
            files,
            index: BTreeMap::new(),
        };
        ck.verify_layout()?;
        Ok(ck)
    }

    /// Every chunk inside its tensor and file; every tensor's weight (and a trained one's
    /// moments) covered by chunks exactly once.
    fn verify_layout(&mut self) -> Result<(), CheckpointError> {
        let m = &self.manifest;
        let mpath = self.dir.join(MANIFEST_FILE);
        let bad = |msg: String| CheckpointError::Manifest {
            path: mpath.clone(),
            msg,
        };
        for (i, c) in m.chunks.iter().enumerate() {
            let Some(t) = m.tensors.get(&c.tensor) else {
                return Err(bad(format!(
                    "chunk {i} holds `{}`, a tensor the manifest does not list",
                    c.tensor
                )));
            };
            if !c.block().within(&t.shape) {
                return Err(bad(format!(
                    "chunk {i} {} lies outside the tensor's shape {:?}",
                    c.describe(),
                    t.shape
                )));
            }
            let Some(f) = m.files.get(c.rank) else {
                return Err(bad(format!(
                    "chunk {i} {} names rank {}, which has no file",
                    c.describe(),
                    c.rank
                )));
            };
            if c.start
                .checked_add(c.bytes())
                .is_none_or(|end| end > f.bytes)
            {
                return Err(bad(format!(
                    "chunk {i} {} at bytes {}..{} runs past the end of {} ({} bytes)",
                    c.describe(),
                    c.start,
                    c.start.saturating_add(c.bytes()),
                    f.name,
                    f.bytes
                )));
            }
            self.index
                .entry((c.tensor.clone(), c.kind))
                .or_default()
                .push(i);
        }
        for (name, t) in &m.tensors {
            let kinds: &[StateKind] = if t.trained {
                &StateKind::ALL
            } else {
                &[StateKind::Param]
            };
            for &kind in kinds {
                let ids = self
                    .index
                    .get(&(name.clone(), kind))
                    .cloned()
                    .unwrap_or_default();
                self.check_cover(name, kind, &t.shape, &ids)?;
            }
        }
        Ok(())
    }

    /// Chunks `ids` of `tensor`'s `kind` tile its `shape` exactly once.
    fn check_cover(
        &self,
        tensor: &str,
        kind: StateKind,
        shape: &[usize],
        ids: &[usize],
    ) -> Result<(), CheckpointError> {
        let chunks = &self.manifest.chunks;
        let mut blocks: Vec<(Block, usize)> = ids
            .iter()
            .map(|&i| (chunks[i].block(), chunks[i].rank))
            .collect();
        blocks.sort();
        // Sorted by offset: a chunk can only overlap later ones starting before its dim-0 end.
        for (i, (a, ra)) in blocks.iter().enumerate() {
            for (b, rb) in &blocks[i + 1..] {
                if a.offset
                    .first()
                    .zip(a.shape.first())
                    .is_some_and(|(o, s)| b.offset[0] >= o + s)
                {
                    break;
                }
                if a.intersect(b).is_some() {
                    return Err(CheckpointError::Overlap {
                        dir: self.dir.clone(),
                        tensor: tensor.to_string(),
                        kind,
                        chunks: format!("{a} (rank {ra}) and {b} (rank {rb})"),
                    });
                }
            }
        }
        let total: usize = shape.iter().product();
        let covered: usize = blocks.iter().map(|(b, _)| b.numel()).sum();
        if covered == total {
            return Ok(());
        }
        // Find the first uncovered run along the last dim, for the message.
        let mut hit = vec![false; total];
        let whole = Block::whole(shape);
        for (b, _) in &blocks {
            for_each_row(b, &whole, b, |s, _, n| {
                hit[s..s + n].iter_mut().for_each(|h| *h = true)
            });
        }
        let first = hit.iter().position(|h| !h).unwrap_or(0);
        let last = shape.last().copied().unwrap_or(1).max(1);
        let run = hit[first..]
            .iter()
            .take(last - first % last)
            .take_while(|h| !**h)
            .count();
        let strides = crate::weights::row_major_strides(shape);
        let mut offset: Vec<usize> = strides
            .iter()
            .zip(shape)
            .map(|(s, d)| first / s % d)
            .collect();
        let mut ext = vec![1; shape.len()];
        if let Some(l) = ext.last_mut() {
            *l = run;
        }
        if shape.is_empty() {
            offset.clear();
        }
        Err(CheckpointError::Missing {
            dir: self.dir.clone(),
            tensor: tensor.to_string(),
            kind,
            missing: Block { offset, shape: ext },
            uncovered: total - covered,
            total,
        })
    }

    /// The bytes of chunk `i`, checksum checked on first use.
    fn chunk_bytes(&self, i: usize) -> Result<&[u8], CheckpointError> {
        let c = &self.manifest.chunks[i];
        let (start, end) = (c.start as usize, (c.start + c.bytes()) as usize);
        let bytes = self.files[c.rank]
            .as_deref()
            .map_or(&[][..], |f| &f[start..end]);
        if !self.verified[i].load(Ordering::Relaxed) {
            let sum = super::digest(bytes);
            if sum != c.checksum {
                return Err(CheckpointError::Checksum {
                    file: self.dir.join(&self.manifest.files[c.rank].name),
                    chunk: c.describe(),
                    start: c.start,
                    end: c.start + c.bytes(),
                });
            }
            self.verified[i].store(true, Ordering::Relaxed);
        }
        Ok(bytes)
    }

    /// Checks every chunk's checksum.
    pub fn verify_data(&self) -> Result<(), CheckpointError> {
        use rayon::prelude::*;
        (0..self.manifest.chunks.len())
            .into_par_iter()
            .try_for_each(|i| self.chunk_bytes(i).map(|_| ()))
    }

    /// The chunks of `tensor`'s `kind`.
    pub fn chunks_of(&self, tensor: &str, kind: StateKind) -> impl Iterator<Item = &ChunkRecord> {
        self.index
            .get(&(tensor.to_string(), kind))
            .into_iter()
            .flatten()
            .map(|&i| &self.manifest.chunks[i])
    }

    /// Block `block` of stored tensor `tensor`'s `kind`, row-major over the block: read from
    /// the overlapping part of every chunk that holds some of it (and nothing else).
    pub fn read_block(
        &self,
        tensor: &str,
        kind: StateKind,
        block: &Block,
    ) -> Result<Vec<f32>, CheckpointError> {
        let mut out = vec![0f32; block.numel()];
        self.read_each(tensor, kind, block, |x, cb, bytes| {
            for_each_row(x, cb, block, |s, d, n| {
                decode(&bytes[s * 4..(s + n) * 4], &mut out[d..d + n])
            });
        })?;
        Ok(out)
    }

    /// Calls `sink(x, chunk, bytes)` for every chunk of `tensor`'s `kind` that overlaps
    /// `block`: `x` the overlap, `chunk` the chunk's block, `bytes` its data (checksummed).
    /// An error when the chunks do not cover the block.
    fn read_each(
        &self,
        tensor: &str,
        kind: StateKind,
        block: &Block,
        mut sink: impl FnMut(&Block, &Block, &[u8]),
    ) -> Result<(), CheckpointError> {
        let Some(t) = self.manifest.tensors.get(tensor) else {
            return Err(CheckpointError::Mismatch {
                dir: self.dir.clone(),
                msg: format!("holds no tensor `{tensor}`"),
            });
        };
        if !block.within(&t.shape) {
            return Err(CheckpointError::Mismatch {
                dir: self.dir.clone(),
                msg: format!(
                    "`{tensor}` is {:?}, but block {block} of it is wanted (the model's shape differs)",
                    t.shape
                ),
            });
        }
        let mut got = 0usize;
        let ids = self
            .index
            .get(&(tensor.to_string(), kind))
            .map(Vec::as_slice)
            .unwrap_or(&[]);
        for &i in ids {
            let cb = self.manifest.chunks[i].block();
            let Some(x) = cb.intersect(block) else {
                continue;
            };
            sink(&x, &cb, self.chunk_bytes(i)?);
            got += x.numel();
        }
        if got != block.numel() {
            return Err(CheckpointError::Mismatch {
                dir: self.dir.clone(),
                msg: format!(
                    "`{tensor}` {kind}: {} of the {} elements of {block} are in no chunk (a weight-only tensor has no optimizer state)",
                    block.numel() - got,
                    block.numel()
                ),
            });
        }
        Ok(())
    }

    /// Reads stored piece `sp` of a parameter's `kind` into `dst`, the global graph-layout
    /// tensor `whole`: straight from the chunks when the piece is stored as laid out (no
    /// transpose, no view), else through a buffer.
    fn read_piece(
        &self,
        sp: &StoredPiece,
        kind: StateKind,
        dst: &mut [f32],
        whole: &Block,
        direct: bool,
    ) -> Result<(), CheckpointError> {
        if direct {
            // Graph coordinates are stored ones, after the stack index when stacked.
            let lift = |b: &Block| -> Block {
                let mut g = Block {
                    offset: sp.graph.offset[..whole.offset.len() - b.offset.len()].to_vec(),
                    shape: vec![1; whole.offset.len() - b.offset.len()],
                };
                g.offset.extend(&b.offset);
                g.shape.extend(&b.shape);
                g
            };
            return self.read_each(&sp.tensor, kind, &sp.stored, |x, cb, bytes| {
                for_each_row(&lift(x), &lift(cb), whole, |s, d, n| {
                    decode(&bytes[s * 4..(s + n) * 4], &mut dst[d..d + n])
                });
            });
        }
        let mut data = self.read_block(&sp.tensor, kind, &sp.stored)?;
        if sp.transposed {
            data = transpose_last2(&data, &sp.stored.shape);
        }
        for_each_row(&sp.graph, &sp.graph, whole, |s, d, n| {
            dst[d..d + n].copy_from_slice(&data[s..s + n]);
        });
        Ok(())
    }

    /// The training state of plan `plan` from this checkpoint: every parameter's weight and
    /// moments, whole and in graph layout (a tied parameter's copies share one), each read in
    /// parallel; the step count.
    pub fn load_state(&self, plan: &Plan) -> Result<TrainState, CheckpointError> {
        let train = plan.train.as_ref().ok_or_else(|| {
            shardc_compiler::checkpoint::LayoutError::NotTraining(plan.model.source.clone())
        })?;
        let mut first: BTreeMap<&str, usize> = BTreeMap::new();
        for (i, p) in train.params.iter().enumerate() {
            first.entry(&p.label).or_insert(i);
        }
        let wanted: Vec<(usize, StateKind)> = first
            .values()
            .flat_map(|&i| StateKind::ALL.map(|k| (i, k)))
            .collect();
        let filled = wanted
            .into_par_iter()
            .map(|(i, kind)| {
                let p = &train.params[i];
                let whole = Block::whole(&p.ty.shape());
                let direct = !p.source.transposed && p.source.view.is_none();
                let mut dst = vec![0f32; whole.numel()];
                for sp in stored_pieces(&p.source, &whole) {
                    self.read_piece(&sp, kind, &mut dst, &whole, direct)?;
                }
                Ok((p.label.clone(), kind, Tensor::f32(whole.shape, dst)))
            })
            .collect::<Result<Vec<_>, CheckpointError>>()?;
        let mut state = TrainState {
            params: BTreeMap::new(),
            m: BTreeMap::new(),
            v: BTreeMap::new(),
            step: self.manifest.step,
        };
        for (label, kind, t) in filled {
            state.of_mut(kind).insert(label, t);
        }
        Ok(state)
    }

    /// Rank `rank`'s own state of training plan `plan`, as its trainer keeps it between
    /// steps: per pipeline chunk, each program input (weight, AdamW moment) holding its block,
    /// shaped as the block — only those blocks read, and nothing global allocated.
    pub fn load_locals(
        &self,
        plan: &Plan,
        rank: usize,
    ) -> Result<BTreeMap<usize, BTreeMap<String, Tensor>>, CheckpointError> {
        let train = plan.train.as_ref().ok_or_else(|| {
            shardc_compiler::checkpoint::LayoutError::NotTraining(plan.model.source.clone())
        })?;
        let pieces = shardc_compiler::checkpoint::rank_pieces(plan, rank)?;
        let filled = pieces
            .into_par_iter()
            .map(|piece| {
                let p = &train.params[piece.param];
                let direct = !p.source.transposed && p.source.view.is_none();
                let mut dst = vec![0f32; piece.block.numel()];
                for sp in stored_pieces(&p.source, &piece.block) {
                    self.read_piece(&sp, piece.kind, &mut dst, &piece.block, direct)?;
                }
                let name = piece.kind.input_of(p).to_string();
                Ok((p.chunk, name, Tensor::f32(piece.block.shape.clone(), dst)))
            })
            .collect::<Result<Vec<_>, CheckpointError>>()?;
        let mut out: BTreeMap<usize, BTreeMap<String, Tensor>> = BTreeMap::new();
        for (chunk, name, t) in filled {
            out.entry(chunk).or_default().insert(name, t);
        }
        Ok(out)
    }

    /// Every stored tensor's weight, whole, by name (an export's content).
    pub fn weights(&self) -> Result<BTreeMap<String, Tensor>, CheckpointError> {
        self.manifest
            .tensors
            .iter()
            .map(|(name, t)| {
                let data = self.read_block(name, StateKind::Param, &Block::whole(&t.shape))?;
                Ok((name.clone(), Tensor::f32(t.shape.clone(), data)))
            })
            .collect()
    }
}

/// The step directory `path` names: itself when it holds a manifest, else the one its
/// `latest` file names.
pub fn step_dir(path: &Path) -> Result<PathBuf, CheckpointError> {
    if path.join(MANIFEST_FILE).is_file() {
        return Ok(path.to_path_buf());
    }
    let latest = path.join(LATEST_FILE);
    if !latest.is_file() {
        return Err(CheckpointError::NotFound {
            path: path.to_path_buf(),
        });
    }
    let name = std::fs::read_to_string(&latest).map_err(io_err(&latest))?;
    let name = name.trim();
    if name.is_empty() || name.contains('/') || name.contains("..") {
        return Err(CheckpointError::Manifest {
            path: latest,
            msg: format!("names `{name}`, not a step directory of this checkpoint"),
        });
    }
    let dir = path.join(name);
    if !dir.join(MANIFEST_FILE).is_file() {
        return Err(CheckpointError::Manifest {
            path: latest,
            msg: format!("names {}, which holds no {MANIFEST_FILE}", dir.display()),
        });
    }
    Ok(dir)
}

/// Little-endian f32 bytes into `out`.
fn decode(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
        *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
}
