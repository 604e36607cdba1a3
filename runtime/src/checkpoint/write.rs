//! Saving: each rank's owned pieces, mapped to stored coordinates, into its data file; then
//! the manifest, the step directory published whole, and `latest` moved to it.

use super::{
    for_each_row, io_err, rank_file_name, step_dir_name, transpose_last2, CheckpointError,
    ChunkRecord, DataPosition, Manifest, SavedFile, SavedLayout, SavedModel, SavedTensor, FORMAT,
    FORMAT_VERSION, LATEST_FILE, MANIFEST_FILE,
};
use crate::output::{write_atomic, StagedDir};
use crate::train::TrainState;
use crate::{Tensor, Weights};
use rayon::prelude::*;
use shardc_compiler::checkpoint::LayoutError;
use shardc_compiler::checkpoint::{rank_pieces, stored_pieces, Block, RankPiece, StateKind};
use shardc_compiler::plan::{Plan, PlanParam};
use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

// Chunks are little-endian f32, written by a byte cast of the host's floats.
const _: () = assert!(
    cfg!(target_endian = "little"),
    "checkpoint data is written as little-endian f32 by a byte cast"
);

/// What a save records besides the state.
pub struct SaveInfo<'a> {
    /// Where the data stands after the step saved.
    pub data: DataPosition,
    /// The model (its `config.json` included).
    pub model: SavedModel,
    /// The model's weights: the stored tensors' dtypes, and the tensors training does not
    /// update (saved as they are, so an export is a whole model).
    pub weights: &'a Weights,
    /// Called once every file but the manifest is written, before the step is published (a
    /// test's place to crash).
    pub before_publish: Option<&'a dyn Fn()>,
}

/// Where a rank's piece of state comes from: the tensor holding it and the block of the
/// global graph-layout tensor that tensor is.
type Source<'s> = dyn Fn(&PlanParam, &RankPiece) -> Option<(&'s Tensor, Block)> + Sync + 's;

/// One chunk to write: its place in the checkpoint and where its data comes from.
struct Job<'s> {
    tensor: String,
    kind: StateKind,
    stored: Block,
    data: JobData<'s>,
}

/// A chunk's data: a stored tensor whole, or a piece of a graph-layout tensor.
enum JobData<'s> {
    Whole(&'s [f32]),
    Piece {
        /// The tensor holding it, row-major over `have` (a block of the global tensor).
        src: &'s [f32],
        have: Block,
        /// The piece, in global graph coordinates.
        graph: Block,
        /// Stored as the transpose of its last two dims.
        transposed: bool,
    },
}

impl JobData<'_> {
    /// The chunk's elements in stored order.
    fn lay_out(&self) -> std::borrow::Cow<'_, [f32]> {
        match self {
            JobData::Whole(d) => std::borrow::Cow::Borrowed(d),
            JobData::Piece {
                src,
                have,
                graph,
                transposed,
            } => {
                if !transposed && graph == have {
                    return std::borrow::Cow::Borrowed(src);
                }
                let mut buf = vec![0f32; graph.numel()];
                for_each_row(graph, have, graph, |s, d, n| {
                    buf[d..d + n].copy_from_slice(&src[s..s + n]);
                });
                if *transposed {
                    buf = transpose_last2(&buf, &graph.shape);
                }
                std::borrow::Cow::Owned(buf)
            }
        }
    }
}

/// Writes rank `rank`'s owned pieces of training plan `plan`'s state, read through `source`,
/// to `path`; rank 0 also writes the stored tensors `extra` whole (as weights). Returns the
/// file's entry and its chunks.
fn write_rank(
    path: &Path,
    plan: &Plan,
    rank: usize,
    source: &Source<'_>,
    extra: &[(String, Tensor)],
) -> Result<(SavedFile, Vec<ChunkRecord>), CheckpointError> {
    let train = plan
        .train
        .as_ref()
        .ok_or_else(|| LayoutError::NotTraining(plan.model.source.clone()))?;
    // Every chunk: what it is, and its data (borrowed when a piece is its source tensor whole
    // and untransposed, else copied out of it).
    let mut jobs: Vec<Job<'_>> = Vec::new();
    for piece in rank_pieces(plan, rank)?.into_iter().filter(|p| p.owner) {
        let p = &train.params[piece.param];
        let Some((t, have)) = source(p, &piece) else {
            return Err(CheckpointError::Mismatch {
                dir: path.to_path_buf(),
                msg: format!(
                    "rank {rank} holds no {} of parameter `{}` to save",
                    piece.kind, p.label
                ),
            });
        };
        let src = t.as_f32().unwrap_or(&[]);
        for sp in stored_pieces(&p.source, &piece.block) {
            jobs.push(Job {
                tensor: sp.tensor.clone(),
                kind: piece.kind,
                stored: sp.stored.clone(),
                data: JobData::Piece {
                    src,
                    have: have.clone(),
                    graph: sp.graph,
                    transposed: sp.transposed,
                },
            });
        }
    }
    if rank == 0 {
        for (name, t) in extra {
            jobs.push(Job {
                tensor: name.clone(),
                kind: StateKind::Param,
                stored: Block::whole(&t.shape),
                data: JobData::Whole(t.as_f32().unwrap_or(&[])),
            });
        }
    }
    let file = File::create(path).map_err(io_err(path))?;
    let mut out = BufWriter::with_capacity(1 << 20, file);
    let mut chunks = Vec::with_capacity(jobs.len());
    let mut at = 0u64;
    // In batches of about 256 MiB: chunks laid out and hashed in parallel, written in order.
    let mut rest = &jobs[..];
    while !rest.is_empty() {
        let mut n = 0;
        let mut size = 0usize;
        while n < rest.len() && (n == 0 || size + rest[n].stored.numel() * 4 <= 256 << 20) {
            size += rest[n].stored.numel() * 4;
            n += 1;
        }
        let (batch, tail) = rest.split_at(n);
        rest = tail;
        let laid: Vec<(std::borrow::Cow<'_, [f32]>, String)> = batch
            .par_iter()
            .map(|j| {
                let data = j.data.lay_out();
                let sum = super::digest(bytemuck::cast_slice(&data));
                (data, sum)
            })
            .collect();
        for (j, (data, checksum)) in batch.iter().zip(laid) {
            let bytes: &[u8] = bytemuck::cast_slice(&data);
            out.write_all(bytes).map_err(io_err(path))?;
            chunks.push(ChunkRecord {
                tensor: j.tensor.clone(),
                kind: j.kind,
                offset: j.stored.offset.clone(),
                shape: j.stored.shape.clone(),
                rank,
                start: at,
                checksum,
            });
            at += bytes.len() as u64;
        }
    }
    let file = out.into_inner().map_err(|e| CheckpointError::Io {
        path: path.to_path_buf(),
        source: e.into_error(),
    })?;
    file.sync_all().map_err(io_err(path))?;
    Ok((
        SavedFile {
            name: path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            bytes: at,
        },
        chunks,
    ))
}

/// Every stored tensor's record, and the untrained ones' values.
type StoredTensors = (BTreeMap<String, SavedTensor>, Vec<(String, Tensor)>);

/// The stored tensors of `weights` and whether training plan `plan` updates them; the ones
/// it does not, loaded (saved whole, as weights).
fn stored_tensors(plan: &Plan, weights: &Weights) -> Result<StoredTensors, CheckpointError> {
    let train = plan
        .train
        .as_ref()
        .ok_or_else(|| LayoutError::NotTraining(plan.model.source.clone()))?;
    let trained: BTreeSet<String> = train
        .params
        .iter()
        .flat_map(|p| (0..p.source.stack.unwrap_or(1)).map(|i| p.source.stored_name(i)))
        .collect();
    let mut tensors = BTreeMap::new();
    let mut extra = Vec::new();
    for name in weights.names() {
        let shape = weights.shape(&name).unwrap_or_default();
        let is_trained = trained.contains(&name);
        tensors.insert(
            name.clone(),
            SavedTensor {
                shape,
                dtype: weights.dtype(&name).unwrap_or_else(|| "F32".into()),
                trained: is_trained,
            },
        );
        if !is_trained {
            extra.push((name.clone(), weights.get(&name)?));
        }
    }
    Ok((tensors, extra))
}

/// Saves training state `state` (global, graph layout, as the thread-rank trainers keep it)
/// of plan `plan` as step `state.step` under checkpoint directory `dir`: each rank of the
/// plan's mesh writes its owned pieces to its own file (in parallel), then the manifest, then
/// the step directory is published and `latest` points to it. Returns the step directory.
pub fn save_global(
    dir: &Path,
    plan: &Plan,
    state: &TrainState,
    info: &SaveInfo<'_>,
) -> Result<PathBuf, CheckpointError> {
    let source = |p: &PlanParam, piece: &RankPiece| -> Option<(&Tensor, Block)> {
        state
            .of(piece.kind)
            .get(&p.label)
            .map(|t| (t, Block::whole(&t.shape)))
    };
    let (tensors, extra) = stored_tensors(plan, info.weights)?;
    let step_dir = dir.join(step_dir_name(state.step));
    let stage = StagedDir::at(&step_dir, &stage_path(dir, state.step))?;
    let world = plan.mesh.world_size();
    let written = (0..world)
        .into_par_iter()
        .map(|rank| {
            write_rank(
                &stage.path(&rank_file_name(rank)),
                plan,
                rank,
                &source,
                &extra,
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    publish(dir, stage, plan, state.step, info, tensors, written)
}

/// Writes the manifest of step `step` (every rank's file and chunks, `written`, in rank
/// order) into `stage`, publishes it as the step directory and points `latest` at it.
fn publish(
    dir: &Path,
    stage: StagedDir,
    plan: &Plan,
    step: u64,
    info: &SaveInfo<'_>,
    tensors: BTreeMap<String, SavedTensor>,
    written: Vec<(SavedFile, Vec<ChunkRecord>)>,
) -> Result<PathBuf, CheckpointError> {
    let step_dir = dir.join(step_dir_name(step));
    let mut files = Vec::with_capacity(written.len());
    let mut chunks = Vec::new();
    for (f, c) in written {
        files.push(f);
        chunks.extend(c);
    }
    let manifest = Manifest {
        format: FORMAT.into(),
        format_version: FORMAT_VERSION,
        step,
        data: info.data.clone(),
        model: info.model.clone(),
        layout: saved_layout(plan),
        adamw: plan
            .train
            .as_ref()
            .map(|t| t.adamw)
            .ok_or_else(|| LayoutError::NotTraining(plan.model.source.clone()))?,
        tensors,
        files,
        chunks,
    };
    if let Some(hook) = info.before_publish {
        hook();
    }
    let text = serde_json::to_string_pretty(&manifest).map_err(|e| CheckpointError::Manifest {
        path: step_dir.join(MANIFEST_FILE),
        msg: e.to_string(),
    })?;
    stage.write(MANIFEST_FILE, text.as_bytes())?;
    stage.publish()?;
    write_atomic(
        &dir.join(LATEST_FILE),
        format!("{}\n", step_dir_name(step)).as_bytes(),
    )?;
    Ok(step_dir)
}

/// Where step `step` is built before it is published: a fixed name, so a save killed midway
/// leaves one stale directory that the next save of that step replaces.
fn stage_path(dir: &Path, step: u64) -> PathBuf {
    dir.join(format!(".{}.partial", step_dir_name(step)))
}

/// The per-rank record a process of a multi-process save leaves beside its data file.
fn rank_index_name(rank: usize) -> String {
    format!("rank-{rank:05}.json")
}

/// One process's part of saving step `step` of training plan `plan` under `dir` (a
/// multi-process run: `shardc launch`, torchrun): rank `rank` writes its owned pieces, read
/// from its kept state `local` (per chunk and program input, the rank's block), into the
/// step's staging directory, beside a record of its chunks; `barrier` waits for every rank.
/// Rank 0 prepares the staging directory first and, once every rank has written, writes the
/// manifest and publishes the step. Returns the step directory on rank 0.
pub fn save_rank(
    dir: &Path,
    plan: &Plan,
    rank: usize,
    step: u64,
    local: &(dyn Fn(usize, &str) -> Option<Tensor> + Sync),
    info: &SaveInfo<'_>,
    barrier: &dyn Fn() -> Result<(), CheckpointError>,
) -> Result<Option<PathBuf>, CheckpointError> {
    let step_dir = dir.join(step_dir_name(step));
    let stage_path = stage_path(dir, step);
    let stage = if rank == 0 {
        Some(StagedDir::at(&step_dir, &stage_path)?)
    } else {
        None
    };
    barrier()?;
    let (tensors, extra) = if rank == 0 {
        stored_tensors(plan, info.weights)?
    } else {
        (BTreeMap::new(), Vec::new())
    };
    // The rank's own state, by piece (its kept tensors are exactly its blocks).
    let owned: BTreeMap<(usize, StateKind), (Tensor, Block)> = rank_pieces(plan, rank)?
        .into_iter()
        .filter(|p| p.owner)
        .filter_map(|piece| {
            let train = plan.train.as_ref()?;
            let p = &train.params[piece.param];
            let t = local(p.chunk, piece.kind.input_of(p))?;
            Some(((piece.param, piece.kind), (t, piece.block)))
        })
        .collect();
    let source = |_: &PlanParam, piece: &RankPiece| -> Option<(&Tensor, Block)> {
        owned
            .get(&(piece.param, piece.kind))
            .map(|(t, b)| (t, b.clone()))
    };
    let written = write_rank(
        &stage_path.join(super::rank_file_name(rank)),
        plan,
        rank,
        &source,
        &extra,
    )?;
    let record = serde_json::to_vec(&written).map_err(|e| CheckpointError::Manifest {
        path: stage_path.join(rank_index_name(rank)),
        msg: e.to_string(),
    })?;
    write_atomic(&stage_path.join(rank_index_name(rank)), &record)?;
    barrier()?;
    let Some(stage) = stage else {
        return Ok(None);
    };
    let mut all = Vec::with_capacity(plan.mesh.world_size());
    for r in 0..plan.mesh.world_size() {
        let p = stage_path.join(rank_index_name(r));
        let bytes = std::fs::read(&p).map_err(io_err(&p))?;
        let w: (SavedFile, Vec<ChunkRecord>) =
            serde_json::from_slice(&bytes).map_err(|e| CheckpointError::Manifest {
                path: p.clone(),
                msg: e.to_string(),
            })?;
        std::fs::remove_file(&p).map_err(io_err(&p))?;
        all.push(w);
    }
    publish(dir, stage, plan, step, info, tensors, all).map(Some)
}

/// The layout record of plan `plan`.
fn saved_layout(plan: &Plan) -> SavedLayout {
    let train = plan.train.as_ref();
    SavedLayout {
        mesh: plan.mesh.to_string(),
        strategies: plan.strategies.clone(),
        plan_hash: plan_hash(plan),
        zero_stage: train.map_or(0, |t| t.zero_stage),
        micro_batches: train.map_or(1, |t| t.micro_batches),
        recompute: train.map_or_else(String::new, |t| t.recompute.to_string()),
        schedule: plan.pipeline.as_ref().map(|s| s.kind.name().to_string()),
    }
}

/// The content hash `plan`'s file would carry.
pub(crate) fn plan_hash(plan: &Plan) -> String {
    serde_json::from_str::<serde_json::Value>(&plan.to_json())
        .ok()
        .and_then(|v| v.get("hash").and_then(|h| h.as_str()).map(str::to_string))
        .unwrap_or_default()
}
