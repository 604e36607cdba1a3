//! Checkpoint layouts: which block of which stored tensor each rank of a training plan owns
//! (and so writes) and needs (and so reads), in the checkpoint's own coordinates — the model's
//! stored (HuggingFace) tensor names, unfused, untransposed, unstacked, whole-tensor offsets —
//! and the copy that takes a checkpoint saved on one layout to another.
//!
//! A training plan holds each parameter's weight and AdamW moments in graph layout (a fused
//! QKV is a view of a stored tensor, experts are stacked, a linear may be transposed) and
//! split over mesh axes by its step program's shardings. [`rank_pieces`] gives a rank's block
//! of each of them in the global graph-layout tensor, [`stored_pieces`] maps a block to the
//! stored tensors it covers. Replicas are deduplicated on save: of the ranks holding the same
//! block, the one at coordinate 0 of every axis the block is not split over owns it, and a
//! parameter tied across pipeline chunks is owned by its first copy.

use crate::ir::{ParamSource, TensorType};
use crate::plan::{Plan, PlanParam};
use crate::shard::{Mesh, TensorSharding};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;

/// Which part of a parameter's training state a piece holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StateKind {
    /// The weight.
    Param,
    /// AdamW's first moment (PyTorch's `exp_avg`).
    ExpAvg,
    /// AdamW's second moment (PyTorch's `exp_avg_sq`).
    ExpAvgSq,
}

impl StateKind {
    /// The three, in storage order.
    pub const ALL: [StateKind; 3] = [StateKind::Param, StateKind::ExpAvg, StateKind::ExpAvgSq];

    /// Its name in the manifest and in messages: `param`, `exp_avg`, `exp_avg_sq`.
    pub fn name(self) -> &'static str {
        match self {
            StateKind::Param => "param",
            StateKind::ExpAvg => "exp_avg",
            StateKind::ExpAvgSq => "exp_avg_sq",
        }
    }

    /// The program input holding this part of parameter `p`'s state.
    pub fn input_of(self, p: &PlanParam) -> &str {
        match self {
            StateKind::Param => &p.param,
            StateKind::ExpAvg => &p.adam_m,
            StateKind::ExpAvgSq => &p.adam_v,
        }
    }
}

impl fmt::Display for StateKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A rectangular block of a tensor: per dim, where it starts and how far it extends.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Block {
    /// Start per dim.
    pub offset: Vec<usize>,
    /// Extent per dim.
    pub shape: Vec<usize>,
}

impl Block {
    /// The whole of a tensor of `shape`.
    pub fn whole(shape: &[usize]) -> Block {
        Block {
            offset: vec![0; shape.len()],
            shape: shape.to_vec(),
        }
    }

    /// Elements in the block.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The common part of two blocks of the same tensor, if any.
    pub fn intersect(&self, other: &Block) -> Option<Block> {
        if self.offset.len() != other.offset.len() {
            return None;
        }
        let mut out = Block {
            offset: Vec::with_capacity(self.offset.len()),
            shape: Vec::with_capacity(self.offset.len()),
        };
        for d in 0..self.offset.len() {
            let lo = self.offset[d].max(other.offset[d]);
            let hi = (self.offset[d] + self.shape[d]).min(other.offset[d] + other.shape[d]);
            if hi <= lo {
                return None;
            }
            out.offset.push(lo);
            out.shape.push(hi - lo);
        }
        Some(out)
    }

    /// Whether the block lies inside a tensor of `shape`.
    pub fn within(&self, shape: &[usize]) -> bool {
        self.offset.len() == shape.len()
            && (0..shape.len()).all(|d| {
                self.offset[d]
                    .checked_add(self.shape[d])
                    .is_some_and(|end| end <= shape[d])
            })
    }
}

impl fmt::Display for Block {
    /// `[0:4, 8:16]`: per dim, start and end.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dims: Vec<String> = self
            .offset
            .iter()
            .zip(&self.shape)
            .map(|(o, s)| format!("{o}:{}", o + s))
            .collect();
        write!(f, "[{}]", dims.join(", "))
    }
}

/// A layout the checkpoint code cannot describe: the plan is not a training plan, or a
/// parameter's state has no input in its program.
#[derive(Debug, thiserror::Error)]
pub enum LayoutError {
    /// A forward plan.
    #[error("the plan of {0} is a forward plan: checkpoints hold a training plan's state")]
    NotTraining(String),
    /// A parameter state input missing from its program.
    #[error("parameter `{label}`: its {kind} input `{input}` is in no program of chunk {chunk}")]
    MissingInput {
        /// The parameter's label.
        label: String,
        /// Which state.
        kind: StateKind,
        /// The input's name.
        input: String,
        /// Its chunk.
        chunk: usize,
    },
    /// A rank outside the mesh.
    #[error("rank {rank} is outside the plan's mesh of {world} ranks")]
    Rank {
        /// The rank asked for.
        rank: usize,
        /// The mesh's size.
        world: usize,
    },
}

/// One rank's block of one parameter's state, in the global graph-layout tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankPiece {
    /// Index into the plan's `train.params`.
    pub param: usize,
    /// Which state.
    pub kind: StateKind,
    /// The block this rank holds.
    pub block: Block,
    /// Whether this rank writes it on save (the first replica of the first copy).
    pub owner: bool,
}

/// The mesh a chunk's programs run on, and a rank's coordinates in it; `None` when the rank
/// does not hold chunk `chunk` (another pipeline stage's).
fn chunk_mesh(plan: &Plan, chunk: usize, rank: usize) -> Option<(Mesh, Vec<usize>)> {
    let mesh = &plan.mesh;
    let coords = mesh.coords(rank);
    if plan.chunks.is_empty() {
        return Some((mesh.clone(), coords));
    }
    let pp = mesh.axis("pp")?;
    let stage = plan.chunks.get(chunk)?.stage;
    if coords[pp.0 as usize] != stage {
        return None;
    }
    let stage_coords = mesh
        .axis_ids()
        .filter(|&a| a != pp)
        .map(|a| coords[a.0 as usize])
        .collect();
    Some((mesh.without_axis("pp"), stage_coords))
}

/// The layout of program input `name` of chunk `chunk`: found in its step program, then its
/// micro-batch program.
fn input_sharding<'p>(plan: &'p Plan, chunk: usize, name: &str) -> Option<&'p TensorSharding> {
    let graphs: Vec<(&crate::ir::Graph, &Vec<TensorSharding>)> = if plan.chunks.is_empty() {
        let mut g = Vec::new();
        if let Some(s) = &plan.step {
            g.push((&s.program, &s.shardings));
        }
        g.push((&plan.program, &plan.shardings));
        g
    } else {
        let ch = plan.chunks.get(chunk)?;
        let mut g = Vec::new();
        if let Some(s) = &ch.step {
            g.push((&s.program, &s.shardings));
        }
        g.push((&ch.program, &ch.shardings));
        g
    };
    graphs
        .into_iter()
        .find_map(|(g, s)| g.input_named(name).and_then(|v| s.get(v.index())))
}

/// The block of a tensor of global `shape` laid out by `s` that the rank at `coords` of
/// `mesh` holds, and whether it is the first replica (coordinate 0 on every axis that does
/// not split it).
fn local_block(
    s: &TensorSharding,
    mesh: &Mesh,
    coords: &[usize],
    shape: &[usize],
) -> (Block, bool) {
    let mut b = Block::whole(shape);
    for (d, axes) in s.dims.iter().enumerate().take(shape.len()) {
        let parts = s.parts(mesh, d).max(1);
        let idx = axes
            .iter()
            .fold(0, |acc, &a| acc * mesh.axis_size(a) + coords[a.0 as usize]);
        b.shape[d] = shape[d] / parts;
        b.offset[d] = idx * b.shape[d];
    }
    let used = s.used_axes();
    let first = mesh
        .axis_ids()
        .all(|a| used.contains(&a) || coords[a.0 as usize] == 0);
    (b, first)
}

/// Rank `rank`'s pieces of training plan `plan`'s state: per parameter and state, the block
/// it holds (its step program's layout of it), and whether it owns it. A rank of a pipeline
/// holds only its stage's chunks.
pub fn rank_pieces(plan: &Plan, rank: usize) -> Result<Vec<RankPiece>, LayoutError> {
    let train = plan
        .train
        .as_ref()
        .ok_or_else(|| LayoutError::NotTraining(plan.model.source.clone()))?;
    let world = plan.mesh.world_size();
    if rank >= world {
        return Err(LayoutError::Rank { rank, world });
    }
    // A tied parameter's first copy owns it.
    let mut first_copy: BTreeMap<&str, usize> = BTreeMap::new();
    for p in &train.params {
        first_copy.entry(&p.label).or_insert(p.chunk);
    }
    let mut out = Vec::new();
    for (i, p) in train.params.iter().enumerate() {
        let Some((mesh, coords)) = chunk_mesh(plan, p.chunk, rank) else {
            continue;
        };
        let shape = p.ty.shape();
        for kind in StateKind::ALL {
            let input = kind.input_of(p);
            let s =
                input_sharding(plan, p.chunk, input).ok_or_else(|| LayoutError::MissingInput {
                    label: p.label.clone(),
                    kind,
                    input: input.to_string(),
                    chunk: p.chunk,
                })?;
            let (block, first) = local_block(s, &mesh, &coords, &shape);
            out.push(RankPiece {
                param: i,
                kind,
                block,
                owner: first && first_copy[p.label.as_str()] == p.chunk,
            });
        }
    }
    Ok(out)
}

/// Where part of a graph-layout block lives in the checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredPiece {
    /// The stored tensor's name.
    pub tensor: String,
    /// The block of the stored tensor, in its coordinates.
    pub stored: Block,
    /// The same elements as a block of the global graph-layout tensor (inside the block
    /// asked for); for a stacked parameter its dim 0 has extent 1.
    pub graph: Block,
    /// Whether the stored block is the graph block's transpose (last two dims swapped).
    pub transposed: bool,
}

/// The stored tensors block `block` of a parameter bound by `source` covers: one piece per
/// stack entry in the block, each moved through the source's transpose and view.
pub fn stored_pieces(source: &ParamSource, block: &Block) -> Vec<StoredPiece> {
    let stacked = source.stack.is_some();
    let entries = if stacked {
        (block.offset[0]..block.offset[0] + block.shape[0]).collect()
    } else {
        vec![0]
    };
    entries
        .into_iter()
        .map(|i| {
            let mut graph = block.clone();
            if stacked {
                graph.offset[0] = i;
                graph.shape[0] = 1;
            }
            let skip = usize::from(stacked);
            let mut stored = Block {
                offset: graph.offset[skip..].to_vec(),
                shape: graph.shape[skip..].to_vec(),
            };
            let r = stored.offset.len();
            if source.transposed && r >= 2 {
                stored.offset.swap(r - 2, r - 1);
                stored.shape.swap(r - 2, r - 1);
            }
            if let Some(v) = source.view {
                stored.offset[v.dim] += v.start;
            }
            StoredPiece {
                tensor: source.stored_name(i),
                stored,
                graph,
                transposed: source.transposed && r >= 2,
            }
        })
        .collect()
}

/// The stored tensor shapes a parameter of global graph-layout type `ty` bound by `source`
/// implies, as far as it covers them (a view's stored tensor is wider along the view's dim).
pub fn stored_extent(source: &ParamSource, ty: &TensorType) -> Vec<(String, Block)> {
    stored_pieces(source, &Block::whole(&ty.shape()))
        .into_iter()
        .map(|p| (p.tensor, p.stored))
        .collect()
}

/// A chunk of a saved checkpoint, as far as layouts go: which block of which stored tensor's
/// state, written by which rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SavedChunk {
    /// Stored tensor name.
    pub tensor: String,
    /// Which state.
    pub kind: StateKind,
    /// The block, in the stored tensor's coordinates.
    pub block: Block,
    /// The rank that wrote it.
    pub rank: usize,
    /// Its size in bytes.
    pub bytes: u64,
}

/// What one rank of a target layout reads from a saved checkpoint.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RankReads {
    /// Bytes read per source rank (the rank that wrote them).
    pub from: BTreeMap<usize, u64>,
    /// Chunks touched.
    pub chunks: usize,
}

impl RankReads {
    /// Bytes read in all.
    pub fn bytes(&self) -> u64 {
        self.from.values().sum()
    }
}

/// The copy from a checkpoint (its chunks `saved`, elements of `elem_bytes` bytes) to the
/// layout of training plan `to`: per rank of `to`, the bytes it reads from each source rank's
/// file — the intersections of the blocks it needs with the chunks that hold them.
pub fn reshard_reads(
    saved: &[SavedChunk],
    to: &Plan,
    elem_bytes: u64,
) -> Result<Vec<RankReads>, LayoutError> {
    let train = to
        .train
        .as_ref()
        .ok_or_else(|| LayoutError::NotTraining(to.model.source.clone()))?;
    let mut by_tensor: BTreeMap<(&str, StateKind), Vec<&SavedChunk>> = BTreeMap::new();
    for c in saved {
        by_tensor
            .entry((c.tensor.as_str(), c.kind))
            .or_default()
            .push(c);
    }
    (0..to.mesh.world_size())
        .map(|rank| {
            let mut reads = RankReads::default();
            for piece in rank_pieces(to, rank)? {
                let p = &train.params[piece.param];
                for sp in stored_pieces(&p.source, &piece.block) {
                    for c in by_tensor
                        .get(&(sp.tensor.as_str(), piece.kind))
                        .into_iter()
                        .flatten()
                    {
                        if let Some(x) = c.block.intersect(&sp.stored) {
                            *reads.from.entry(c.rank).or_default() += x.numel() as u64 * elem_bytes;
                            reads.chunks += 1;
                        }
                    }
                }
            }
            Ok(reads)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::ParamView;

    #[test]
    fn blocks_intersect_per_dim() {
        let a = Block {
            offset: vec![0, 4],
            shape: vec![4, 4],
        };
        let b = Block {
            offset: vec![2, 6],
            shape: vec![4, 4],
        };
        let x = a.intersect(&b).unwrap();
        assert_eq!(x.offset, vec![2, 6]);
        assert_eq!(x.shape, vec![2, 2]);
        assert_eq!(x.to_string(), "[2:4, 6:8]");
        let far = Block {
            offset: vec![4, 0],
            shape: vec![1, 1],
        };
        assert_eq!(a.intersect(&far), None);
        assert!(a.within(&[4, 8]));
        assert!(!a.within(&[4, 7]));
    }

    #[test]
    fn stored_pieces_undo_stack_transpose_and_view() {
        // Experts stacked along dim 0, each stored transposed, inside a view along stored dim 0.
        let src = ParamSource {
            name: "experts.{}.w".into(),
            view: Some(ParamView {
                dim: 0,
                start: 8,
                len: 4,
            }),
            stack: Some(3),
            transposed: true,
            shards: Vec::new(),
        };
        // Graph layout [3, 6, 4]: experts 1..3, graph dim 1 rows 2..5, all of dim 2.
        let block = Block {
            offset: vec![1, 2, 0],
            shape: vec![2, 3, 4],
        };
        let pieces = stored_pieces(&src, &block);
        assert_eq!(pieces.len(), 2);
        assert_eq!(pieces[0].tensor, "experts.1.w");
        assert_eq!(pieces[1].tensor, "experts.2.w");
        // Stored [4 + view, 6]: graph dims (6, 4) swapped to (4, 6), then dim 0 moved by 8.
        assert_eq!(pieces[0].stored.offset, vec![8, 2]);
        assert_eq!(pieces[0].stored.shape, vec![4, 3]);
        assert_eq!(pieces[1].graph.offset, vec![2, 2, 0]);
        assert_eq!(pieces[1].graph.shape, vec![1, 3, 4]);
        assert!(pieces[0].transposed);
    }
}
