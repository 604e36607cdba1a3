//! Launch configurations that satisfy each kernel family's contract (block sizes, grid shape,
//! dynamic shared memory), so the runtime does not re-derive them.

use crate::{entry_name, KernelDType, KernelError};
use cudarc::driver::LaunchConfig;

/// Threads per block of elementwise (grid-stride) kernels.
pub const ELEMENTWISE_THREADS: u32 = 256;
/// Cap on the grid of grid-stride kernels (more blocks add nothing once the GPU is full).
pub const MAX_GRID_STRIDE_BLOCKS: u32 = 65_535;
/// Queries per attention block (`ATTN_BLOCK_Q` in attention.cu).
pub const ATTENTION_BLOCK_Q: usize = 16;
/// Keys per attention tile (`ATTN_BLOCK_K`).
pub const ATTENTION_BLOCK_K: usize = 32;
/// Threads per attention block (`ATTN_THREADS`); the kernel traps on any other size.
pub const ATTENTION_THREADS: u32 = 128;
/// Largest head width the attention kernel supports.
pub const ATTENTION_MAX_HEAD_DIM: usize = 256;
/// Largest expert count the router supports.
pub const ROUTER_MAX_EXPERTS: usize = 1024;

fn blocks(n: usize, per_block: usize) -> u32 {
    let b = n.div_ceil(per_block).max(1);
    u32::try_from(b)
        .unwrap_or(u32::MAX)
        .min(MAX_GRID_STRIDE_BLOCKS)
}

/// Grid-stride kernels over `n` elements, a thread each: cast, dispatch, combine,
/// cross_entropy_from_stats (n = rows), repeat_grad (n = dx elements), embedding_grad (n =
/// ids·hidden), the runtime's layout kernels; and, with `n` the output's element count,
/// dispatch_grad, combine_grad_y and attention_grad_dq / dk / dv (each thread sums over S, or
/// over the group's heads times Tq, for its element).
pub fn elementwise_launch(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks(n, ELEMENTWISE_THREADS as usize), 1, 1),
        block_dim: (ELEMENTWISE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Grid-stride kernels that move 16-byte vectors (`dtype.vector_lanes()` elements per thread
/// and step) over `n` elements: unary, scale, add/mul, swiglu, reduce_*, embedding (n =
/// ids·hidden), unary_grad_*, adam_moment, adamw_update, generated fused kernels. One
/// thread per vector; where a kernel falls back to scalar accesses (unaligned pointers) its
/// grid-stride loop covers the rest, so the shape is valid either way.
pub fn vector_launch(n: usize, dtype: KernelDType) -> LaunchConfig {
    elementwise_launch(n.div_ceil(dtype.vector_lanes()))
}

/// `rope_*` over `pairs` rotation pairs: one thread per vector unit (in the vector form a
/// unit holds at least `vector_lanes / 2` pairs), grid-stride beyond.
pub fn rope_launch(pairs: usize, dtype: KernelDType) -> LaunchConfig {
    elementwise_launch(pairs.div_ceil(dtype.vector_lanes() / 2))
}

/// One block per row (block-stride): rmsnorm, layernorm, add_rmsnorm, softmax, cross_entropy,
/// cross_entropy_stats, cross_entropy_shard_grad, norm_stats, norm_grad_dx.
/// Wider rows get wider blocks (a multiple of 32, at most 1024).
pub fn rows_launch(rows: usize, cols: usize) -> LaunchConfig {
    let threads: u32 = match cols {
        0..=256 => 64,
        257..=1024 => 128,
        1025..=4096 => 256,
        4097..=16384 => 512,
        _ => 1024,
    };
    LaunchConfig {
        grid_dim: (blocks(rows, 1), 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Columns per block of the column reductions of norm_grad.cu: a warp's width, lane `l` of
/// every warp summing column `32·tile + l`.
pub const COLUMN_TILE: usize = 32;
/// Rows each warp of a column reduction is given at least, before the block grows a warp.
pub const COLUMN_ROWS_PER_WARP: usize = 16;
/// Most warps per block of a column reduction (1024 threads).
pub const COLUMN_MAX_WARPS: usize = 32;

/// The column reductions `norm_grad_dw_*` and `bias_grad_*` over `[rows, cols]`: one block per
/// [`COLUMN_TILE`] columns (block-stride beyond the grid cap), one warp per
/// [`COLUMN_ROWS_PER_WARP`] rows, 1 to [`COLUMN_MAX_WARPS`]. The kernels' sums depend on the
/// block width only, which depends on `rows` only: a shape always gives the same bits.
pub fn columns_launch(rows: usize, cols: usize) -> LaunchConfig {
    let warps = rows
        .div_ceil(COLUMN_ROWS_PER_WARP)
        .clamp(1, COLUMN_MAX_WARPS);
    LaunchConfig {
        grid_dim: (blocks(cols, COLUMN_TILE), 1, 1),
        block_dim: (32 * warps as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `router_*` and `router_grad_*`: one warp per token, 4 warps per block.
pub fn router_launch(tokens: usize, experts: usize) -> Result<LaunchConfig, KernelError> {
    if experts == 0 || experts > ROUTER_MAX_EXPERTS {
        return Err(KernelError::InvalidLaunch {
            kernel: "router",
            param: "experts",
            value: experts,
            allowed: "1..=1024",
        });
    }
    Ok(LaunchConfig {
        grid_dim: (blocks(tokens, 4), 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// `loss_sum_f32`: exactly one block.
pub fn loss_sum_launch() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (1024, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Dynamic shared memory of `attention_*` for `head_dim`: a 16-query tile plus a 32-key tile of
/// f32, each row padded to a multiple of 32. At most 48 KiB (head_dim 256), so no opt-in.
pub fn attention_shared_bytes(head_dim: usize) -> usize {
    let dp = head_dim.div_ceil(32) * 32;
    (ATTENTION_BLOCK_Q + ATTENTION_BLOCK_K) * dp * 4
}

/// `attention_*`: grid (ceil(Tq/16), Hq, B), 128 threads, dynamic shared memory for `head_dim`.
pub fn attention_launch(
    batch: usize,
    seq_q: usize,
    heads_q: usize,
    heads_kv: usize,
    head_dim: usize,
) -> Result<LaunchConfig, KernelError> {
    SCALAR_ATTENTION.launch([batch, seq_q, heads_q, heads_kv, head_dim])
}

/// Queries per block of `attention_tc_bf16` (`ATC_BLOCK_Q` in attention_tc.cu), 16 per warp.
pub const ATTENTION_TC_BLOCK_Q: usize = 64;
/// Keys per tile of `attention_tc_bf16` (`ATC_BLOCK_K`).
pub const ATTENTION_TC_BLOCK_K: usize = 64;
/// The head widths `attention_tc_bf16` supports; others go to `attention_bf16`.
pub const ATTENTION_TC_HEAD_DIMS: [usize; 2] = [64, 128];
/// Alignment in bytes `attention_tc_bf16` needs of q, k and v (16-byte `cp.async` rows).
pub const ATTENTION_TC_ALIGN: u64 = 16;
/// Dynamic shared memory the default (opt-in free) launch may use.
pub const DEFAULT_MAX_DYNAMIC_SHARED: usize = 48 * 1024;

/// Dynamic shared memory of `attention_tc_bf16` for `head_dim`: a 64-query tile and two
/// buffers each of a 64-key K and V tile, bf16. 40 KiB for 64, 80 KiB for 128: above
/// [`DEFAULT_MAX_DYNAMIC_SHARED`], so the function must be opted in to that size.
pub fn attention_tc_shared_bytes(head_dim: usize) -> usize {
    (ATTENTION_TC_BLOCK_Q + 4 * ATTENTION_TC_BLOCK_K) * head_dim * 2
}

/// Whether `attention_tc_bf16` can run this call: a supported `head_dim` and q, k, v (device
/// addresses) aligned to [`ATTENTION_TC_ALIGN`]. Otherwise use `attention_bf16`.
pub fn attention_tc_supported(head_dim: usize, q: u64, k: u64, v: u64) -> bool {
    ATTENTION_TC_HEAD_DIMS.contains(&head_dim)
        && [q, k, v].iter().all(|p| p % ATTENTION_TC_ALIGN == 0)
}

/// The attention entry point for one call and its launch configuration:
/// `attention_tc_bf16` when `tensor_core` is allowed, the dtype is bf16, the device is sm_80 or
/// newer (`sm_major` >= 8) and [`attention_tc_supported`] holds; otherwise `attention_{dtype}`.
/// With `lse`, the entries that also write each query's log-sum-exp (a trailing `float* lse`,
/// `[B, Tq, Hq]` f32, natural log), `attention_tc_lse_bf16` or `attention_lse_{dtype}`, under
/// the same conditions and with the same launches. `dims = [batch, seq_q, heads_q, heads_kv,
/// head_dim]`; `qkv` are the device addresses of q, k and v. The kernels of a pair take the
/// same argument list. (Never the split-KV path, whose partial results carry no lse.)
pub fn attention_kernel(
    dtype: KernelDType,
    sm_major: i32,
    tensor_core: bool,
    lse: bool,
    dims: [usize; 5],
    [q, k, v]: [u64; 3],
) -> Result<(String, LaunchConfig), KernelError> {
    let supported = attention_tc_supported(dims[4], q, k, v);
    let pair = if lse {
        [&TENSOR_CORE_ATTENTION_LSE, &SCALAR_ATTENTION_LSE]
    } else {
        [&TENSOR_CORE_ATTENTION, &SCALAR_ATTENTION]
    };
    choose_attention_kernel(pair, dtype, sm_major, tensor_core && supported, dims)
}

/// The tensor-core kernel of `pair` when `tensor_core` (allowed and supported for the call),
/// the dtype is bf16 and the device is sm_80 or newer (`sm_major` >= 8), else the scalar one:
/// its entry point for `dtype` and its launch for `dims`.
fn choose_attention_kernel(
    [tensor_core_kernel, scalar_kernel]: [&AttentionKernel; 2],
    dtype: KernelDType,
    sm_major: i32,
    tensor_core: bool,
    dims: [usize; 5],
) -> Result<(String, LaunchConfig), KernelError> {
    let kernel = if tensor_core && dtype == KernelDType::Bf16 && sm_major >= 8 {
        tensor_core_kernel
    } else {
        scalar_kernel
    };
    Ok((entry_name(kernel.name, dtype), kernel.launch(dims)?))
}

/// Split-KV (flash-decoding) attention, `attention_decode.cu`: taken only when the ordinary
/// grid has fewer blocks than this many per SM (it leaves SMs idle)...
pub const SPLIT_KV_MAX_BLOCKS_PER_SM: usize = 2;
/// ... and the KV sequence has at least this many keys (shorter walks are cheap anyway).
pub const SPLIT_KV_MIN_KEYS: usize = 1024;
/// Fewest keys per split: below this the combine and the per-split setup outweigh the walk.
pub const SPLIT_KV_MIN_SPLIT_KEYS: usize = 256;
/// Blocks per SM the split grid aims for (about 3 waves of one block per SM).
pub const SPLIT_KV_TARGET_BLOCKS_PER_SM: usize = 3;

/// Why [`split_kv_splits`] keeps the ordinary (non-split) attention kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SplitKvFallback {
    /// The caller turned split-KV off.
    Disabled,
    /// The SM count is unknown (0).
    UnknownSmCount,
    /// The ordinary grid already has `blocks` >= [`SPLIT_KV_MAX_BLOCKS_PER_SM`] x `sm_count`.
    GridFull {
        /// Blocks of the ordinary launch.
        blocks: usize,
        /// SMs of the device.
        sm_count: usize,
    },
    /// Fewer than [`SPLIT_KV_MIN_KEYS`] keys.
    ShortKeys {
        /// The KV sequence length.
        seq_k: usize,
    },
    /// Fewer than 2 splits would reach the target grid with [`SPLIT_KV_MIN_SPLIT_KEYS`] keys
    /// each.
    OneSplit,
}

/// Blocks per split of `attention_decode_*`: `B x Hkv x ceil(Tq x G / 16)` (G = Hq / Hkv), the
/// query heads of a GQA group packed in one block. `dims = [batch, seq_q, seq_k, heads_q,
/// heads_kv, head_dim]`; 0 for an invalid head split.
fn split_kv_blocks_per_split(dims: [usize; 6]) -> usize {
    let [batch, seq_q, _, heads_q, heads_kv, _] = dims;
    if heads_kv == 0 || heads_q % heads_kv != 0 {
        return 0;
    }
    let rows = seq_q.saturating_mul(heads_q / heads_kv);
    batch
        .saturating_mul(heads_kv)
        .saturating_mul(rows.div_ceil(ATTENTION_BLOCK_Q))
}

/// The split-KV heuristic: the number of key splits for an attention call with
/// `dims = [batch, seq_q, seq_k, heads_q, heads_kv, head_dim]` whose ordinary launch has
/// `ordinary_blocks` blocks, on a device with `sm_count` SMs, or why the ordinary kernel stays.
/// Split when the ordinary grid is below [`SPLIT_KV_MAX_BLOCKS_PER_SM`] x SMs and S >=
/// [`SPLIT_KV_MIN_KEYS`]; take enough splits for the split grid to reach
/// [`SPLIT_KV_TARGET_BLOCKS_PER_SM`] x SMs, but no more than leave each split
/// [`SPLIT_KV_MIN_SPLIT_KEYS`] keys; fewer than 2 splits is no split.
pub fn split_kv_splits(
    enabled: bool,
    sm_count: usize,
    ordinary_blocks: usize,
    dims: [usize; 6],
) -> Result<usize, SplitKvFallback> {
    let seq_k = dims[2];
    if !enabled {
        return Err(SplitKvFallback::Disabled);
    }
    if sm_count == 0 {
        return Err(SplitKvFallback::UnknownSmCount);
    }
    if ordinary_blocks >= SPLIT_KV_MAX_BLOCKS_PER_SM.saturating_mul(sm_count) {
        return Err(SplitKvFallback::GridFull {
            blocks: ordinary_blocks,
            sm_count,
        });
    }
    if seq_k < SPLIT_KV_MIN_KEYS {
        return Err(SplitKvFallback::ShortKeys { seq_k });
    }
    let per_split = split_kv_blocks_per_split(dims).max(1);
    let target = SPLIT_KV_TARGET_BLOCKS_PER_SM.saturating_mul(sm_count);
    let splits = target
        .div_ceil(per_split)
        .min(seq_k / SPLIT_KV_MIN_SPLIT_KEYS);
    if splits < 2 {
        return Err(SplitKvFallback::OneSplit);
    }
    Ok(splits)
}

/// Bytes of the f32 workspace of `attention_decode_*` with `num_splits` splits: unnormalised
/// output rows plus row max and sum, `4 x B x num_splits x Tq x Hq x (D + 2)`.
pub fn split_kv_workspace_bytes(dims: [usize; 6], num_splits: usize) -> usize {
    let [batch, seq_q, _, heads_q, _, head_dim] = dims;
    [batch, num_splits, seq_q, heads_q, head_dim + 2, 4]
        .into_iter()
        .fold(1usize, usize::saturating_mul)
}

/// The workspace to reserve at plan time for an attention call with these `dims` on a device
/// with `sm_count` SMs: enough for whatever [`attention_plan`] picks (0 when it can never
/// split, since the split count does not depend on the ordinary kernel).
pub fn split_kv_reserve_bytes(dims: [usize; 6], sm_count: usize) -> usize {
    split_kv_splits(true, sm_count, 0, dims).map_or(0, |n| split_kv_workspace_bytes(dims, n))
}

/// The two launches of the split-KV path: `attention_decode_{dtype}` then
/// `attention_decode_combine_{dtype}`, both with attention's argument list plus the workspace
/// pointer and `num_splits`.
#[derive(Debug, Clone)]
pub struct SplitKvLaunch {
    /// `attention_decode_{dtype}`: partial results of each split into the workspace.
    pub partial: String,
    /// Its launch: grid (num_splits, Hkv x ceil(Tq x G / 16), B), 128 threads.
    pub partial_cfg: LaunchConfig,
    /// `attention_decode_combine_{dtype}`: merges the splits into the output.
    pub combine: String,
    /// Its launch: one block per output row (block-stride).
    pub combine_cfg: LaunchConfig,
    /// Key splits.
    pub num_splits: usize,
    /// f32 workspace bytes the pair needs ([`split_kv_workspace_bytes`]).
    pub workspace_bytes: usize,
}

/// The split-KV launches for `dims = [batch, seq_q, seq_k, heads_q, heads_kv, head_dim]` with
/// `num_splits` splits, after checking the shape against `attention_decode.cu`'s contract.
pub fn split_kv_launch(
    dtype: KernelDType,
    dims: [usize; 6],
    num_splits: usize,
) -> Result<SplitKvLaunch, KernelError> {
    let [batch, seq_q, _, heads_q, heads_kv, head_dim] = dims;
    let k = &SPLIT_KV_ATTENTION;
    k.check_heads(head_dim, heads_q, heads_kv)?;
    let per_split = split_kv_blocks_per_split(dims) / batch.max(1);
    let partial_cfg = LaunchConfig {
        grid_dim: (
            k.grid_dim("num_splits", num_splits, i32::MAX as usize, "1..=2^31")?,
            k.grid_dim(
                "heads_kv",
                per_split,
                65_535,
                "Hkv x query tiles in 1..=65535",
            )?,
            k.grid_dim("batch", batch, 65_535, "1..=65535")?,
        ),
        block_dim: (ATTENTION_THREADS, 1, 1),
        shared_mem_bytes: k.shared_bytes_u32(head_dim),
    };
    let out_rows = batch.saturating_mul(seq_q).saturating_mul(heads_q);
    if out_rows == 0 {
        return Err(k.bad("seq_q", seq_q, "batch x seq_q x heads_q >= 1"));
    }
    Ok(SplitKvLaunch {
        partial: entry_name(k.name, dtype),
        partial_cfg,
        combine: entry_name("attention_decode_combine", dtype),
        combine_cfg: rows_launch(out_rows, head_dim),
        num_splits,
        workspace_bytes: split_kv_workspace_bytes(dims, num_splits),
    })
}

/// How one attention call runs: one ordinary kernel, or the split-KV pair.
#[derive(Debug, Clone)]
pub enum AttentionPlan {
    /// [`attention_kernel`]'s entry point and launch.
    Single(String, LaunchConfig),
    /// The split-KV pair ([`split_kv_launch`]).
    SplitKv(SplitKvLaunch),
}

/// [`attention_kernel`]'s choice, replaced by the split-KV pair when `workspace_bytes` (the
/// workspace the caller has, 0 for none) holds it and [`split_kv_splits`] says so for a device
/// with `sm_count` SMs. `dims = [batch, seq_q, seq_k, heads_q, heads_kv, head_dim]`.
pub fn attention_plan(
    dtype: KernelDType,
    (sm_major, sm_count): (i32, usize),
    tensor_core: bool,
    workspace_bytes: usize,
    dims: [usize; 6],
    qkv: [u64; 3],
) -> Result<AttentionPlan, KernelError> {
    let [batch, seq_q, _, heads_q, heads_kv, head_dim] = dims;
    let (entry, cfg) = attention_kernel(
        dtype,
        sm_major,
        tensor_core,
        false,
        [batch, seq_q, heads_q, heads_kv, head_dim],
        qkv,
    )?;
    let (x, y, z) = cfg.grid_dim;
    let blocks = [x, y, z].iter().map(|&n| n as usize).product();
    match split_kv_splits(workspace_bytes > 0, sm_count, blocks, dims) {
        Ok(n) if split_kv_workspace_bytes(dims, n) <= workspace_bytes => {
            Ok(AttentionPlan::SplitKv(split_kv_launch(dtype, dims, n)?))
        }
        _ => Ok(AttentionPlan::Single(entry, cfg)),
    }
}

/// The dynamic shared memory to opt kernel `entry` in to when it is loaded
/// (`CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`), for kernels whose launches may ask for
/// more than [`DEFAULT_MAX_DYNAMIC_SHARED`]; `None` for every other kernel.
pub fn opt_in_shared_bytes(entry: &str) -> Option<usize> {
    let most = |dims: &[usize], bytes: fn(usize) -> usize| dims.iter().map(|&d| bytes(d)).max();
    match entry {
        "attention_tc_bf16" | "attention_tc_lse_bf16" => {
            most(&ATTENTION_TC_HEAD_DIMS, attention_tc_shared_bytes)
        }
        "attention_bwd_tc_bf16" => most(&ATTENTION_BWD_TC_HEAD_DIMS, attention_bwd_tc_shared_bytes),
        _ => None,
    }
}

/// What an attention kernel's blocks own: a tile of queries of one query head (the forwards,
/// grid (ceil(Tq / tile), Hq, B)) or a tile of keys of one KV head (the backwards, grid
/// (ceil(S / tile), Hkv, B)).
#[derive(Clone, Copy)]
enum AttentionTiles {
    Queries,
    Keys,
}

/// One attention kernel's launch contract: its [`AttentionTiles`] grid of `threads` threads and
/// `shared_bytes(head_dim)` of dynamic shared memory.
struct AttentionKernel {
    /// Entry point family.
    name: &'static str,
    tiles: AttentionTiles,
    /// Queries or keys per block.
    tile: usize,
    threads: u32,
    head_dim_ok: fn(usize) -> bool,
    /// The head widths `head_dim_ok` accepts, for the error.
    head_dims: &'static str,
    /// Dynamic shared memory for a head_dim that passed the check.
    shared_bytes: fn(usize) -> usize,
}

/// `attention_{f32,bf16}` (attention.cu).
const SCALAR_ATTENTION: AttentionKernel = AttentionKernel {
    name: "attention",
    tiles: AttentionTiles::Queries,
    tile: ATTENTION_BLOCK_Q,
    threads: ATTENTION_THREADS,
    head_dim_ok: |d| (1..=ATTENTION_MAX_HEAD_DIM).contains(&d),
    head_dims: "1..=256",
    shared_bytes: attention_shared_bytes,
};

/// `attention_decode_{f32,bf16}` (attention_decode.cu): the scalar kernel's tiles and head
/// widths; its grid is [`split_kv_launch`]'s.
const SPLIT_KV_ATTENTION: AttentionKernel = AttentionKernel {
    name: "attention_decode",
    ..SCALAR_ATTENTION
};

/// `attention_tc_bf16` (attention_tc.cu).
const TENSOR_CORE_ATTENTION: AttentionKernel = AttentionKernel {
    name: "attention_tc",
    tiles: AttentionTiles::Queries,
    tile: ATTENTION_TC_BLOCK_Q,
    threads: ATTENTION_THREADS,
    head_dim_ok: |d| ATTENTION_TC_HEAD_DIMS.contains(&d),
    head_dims: "64 or 128",
    shared_bytes: attention_tc_shared_bytes,
};

/// `attention_lse_{f32,bf16}` (attention.cu): the scalar forward that also writes the lse.
const SCALAR_ATTENTION_LSE: AttentionKernel = AttentionKernel {
    name: "attention_lse",
    ..SCALAR_ATTENTION
};

/// `attention_tc_lse_bf16` (attention_tc.cu): the tensor-core forward that also writes the lse.
const TENSOR_CORE_ATTENTION_LSE: AttentionKernel = AttentionKernel {
    name: "attention_tc_lse",
    ..TENSOR_CORE_ATTENTION
};

/// `attention_bwd_{f32,bf16}` (attention_bwd.cu).
const SCALAR_ATTENTION_BWD: AttentionKernel = AttentionKernel {
    name: "attention_bwd",
    tiles: AttentionTiles::Keys,
    tile: ATTENTION_BWD_BLOCK_K,
    threads: ATTENTION_BWD_THREADS,
    head_dim_ok: |d| (1..=ATTENTION_BWD_MAX_HEAD_DIM).contains(&d),
    head_dims: "1..=128",
    shared_bytes: attention_bwd_shared_bytes,
};

/// `attention_bwd_tc_bf16` (attention_bwd_tc.cu).
const TENSOR_CORE_ATTENTION_BWD: AttentionKernel = AttentionKernel {
    name: "attention_bwd_tc",
    tiles: AttentionTiles::Keys,
    tile: ATTENTION_BWD_TC_BLOCK_K,
    threads: ATTENTION_BWD_THREADS,
    head_dim_ok: |d| ATTENTION_BWD_TC_HEAD_DIMS.contains(&d),
    head_dims: "64 or 128",
    shared_bytes: attention_bwd_tc_shared_bytes,
};

impl AttentionKernel {
    /// The launch for `dims = [batch, seq, heads_q, heads_kv, head_dim]` (seq: Tq for a
    /// forward, S for a backward), after checking the shape.
    fn launch(&self, dims: [usize; 5]) -> Result<LaunchConfig, KernelError> {
        let [batch, seq, heads_q, heads_kv, head_dim] = dims;
        self.check_heads(head_dim, heads_q, heads_kv)?;
        let (seq_param, tiles_allowed, heads_param, heads) = match self.tiles {
            AttentionTiles::Queries => ("seq_q", "1..=2^31 query tiles", "heads_q", heads_q),
            AttentionTiles::Keys => ("seq_k", "1..=2^31 key tiles", "heads_kv", heads_kv),
        };
        let tiles = seq.div_ceil(self.tile);
        Ok(LaunchConfig {
            grid_dim: (
                self.grid_dim(seq_param, tiles, i32::MAX as usize, tiles_allowed)?,
                self.grid_dim(heads_param, heads, 65_535, "1..=65535")?,
                self.grid_dim("batch", batch, 65_535, "1..=65535")?,
            ),
            block_dim: (self.threads, 1, 1),
            shared_mem_bytes: self.shared_bytes_u32(head_dim),
        })
    }

    fn bad(&self, param: &'static str, value: usize, allowed: &'static str) -> KernelError {
        KernelError::InvalidLaunch {
            kernel: self.name,
            param,
            value,
            allowed,
        }
    }

    /// Checks `head_dim` and that `heads_kv` divides `heads_q`.
    fn check_heads(
        &self,
        head_dim: usize,
        heads_q: usize,
        heads_kv: usize,
    ) -> Result<(), KernelError> {
        if !(self.head_dim_ok)(head_dim) {
            return Err(self.bad("head_dim", head_dim, self.head_dims));
        }
        if heads_kv == 0 || heads_q % heads_kv != 0 {
            return Err(self.bad("heads_kv", heads_kv, "a divisor of heads_q"));
        }
        Ok(())
    }

    /// One grid dimension, `1..=max`.
    fn grid_dim(
        &self,
        param: &'static str,
        value: usize,
        max: usize,
        allowed: &'static str,
    ) -> Result<u32, KernelError> {
        if value == 0 || value > max {
            Err(self.bad(param, value, allowed))
        } else {
            Ok(u32::try_from(value).expect("invariant: value <= max <= u32::MAX"))
        }
    }

    /// Dynamic shared memory for a `head_dim` that passed [`Self::check_heads`].
    fn shared_bytes_u32(&self, head_dim: usize) -> u32 {
        u32::try_from((self.shared_bytes)(head_dim))
            .expect("invariant: at most 80 KiB for a valid head_dim")
    }
}

/// Keys per block of `attention_bwd_*` (`ABWD_BLOCK_K` in attention_bwd.cu).
pub const ATTENTION_BWD_BLOCK_K: usize = 32;
/// Queries per tile of `attention_bwd_*` (`ABWD_BLOCK_Q`).
pub const ATTENTION_BWD_BLOCK_Q: usize = 8;
/// Threads per block of `attention_bwd_*` (`ABWD_THREADS`); the kernel traps on any other size.
pub const ATTENTION_BWD_THREADS: u32 = 128;
/// Largest head width the attention backward supports (`ABWD_MAX_CHUNKS` * 32).
pub const ATTENTION_BWD_MAX_HEAD_DIM: usize = 128;

/// Dynamic shared memory of `attention_bwd_*` for `head_dim`: a 32-key K and V tile and an
/// 8-query q and dO tile of f32, rows padded to a multiple of 32, plus the tile's P and dS
/// (8 x 32 f32 each). 42 KiB at head_dim 128, so no opt-in.
pub fn attention_bwd_shared_bytes(head_dim: usize) -> usize {
    let dp = head_dim.div_ceil(32) * 32;
    let (k, q) = (ATTENTION_BWD_BLOCK_K, ATTENTION_BWD_BLOCK_Q);
    ((2 * k + 2 * q) * dp + 2 * q * k) * 4
}

/// `attention_bwd_prep_*` over `rows = B * Tq * Hq`: one warp per row, 4 warps per block,
/// warp-stride beyond the grid cap.
pub fn attention_bwd_prep_launch(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks(rows, 4), 1, 1),
        block_dim: (ATTENTION_BWD_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `attention_bwd_*`: grid (ceil(S / 32), Hkv, B) of [`ATTENTION_BWD_THREADS`] threads, one
/// block per 32 keys of one (batch, KV head), and [`attention_bwd_shared_bytes`]. The shape is
/// checked first: head_dim in 1..=128, heads_kv a divisor of heads_q, no empty or oversized
/// grid dimension.
pub fn attention_bwd_launch(
    batch: usize,
    seq_k: usize,
    heads_q: usize,
    heads_kv: usize,
    head_dim: usize,
) -> Result<LaunchConfig, KernelError> {
    SCALAR_ATTENTION_BWD.launch([batch, seq_k, heads_q, heads_kv, head_dim])
}

/// Keys per block of `attention_bwd_tc_bf16` (`ABTC_BLOCK_K` in attention_bwd_tc.cu), 16 per
/// warp.
pub const ATTENTION_BWD_TC_BLOCK_K: usize = 64;
/// The head widths `attention_bwd_tc_bf16` supports; others go to `attention_bwd_bf16`.
pub const ATTENTION_BWD_TC_HEAD_DIMS: [usize; 2] = [64, 128];

/// Queries per tile of `attention_bwd_tc_bf16` for a supported `head_dim` (`AbtcTile<D>::BQ`):
/// 64 at head_dim 64, 32 at 128, so a warp's dK and dV rows and its scores stay in registers.
pub fn attention_bwd_tc_block_q(head_dim: usize) -> usize {
    if head_dim <= 64 {
        64
    } else {
        32
    }
}

/// Dynamic shared memory of `attention_bwd_tc_bf16` for a supported `head_dim`: the block's
/// 64-key K and V tiles, two buffers each of a query tile's Q and dO, the tile's dSᵀ (64 keys x
/// [`attention_bwd_tc_block_q`] queries), all bf16, and two buffers of its lse and delta rows
/// (f32). 57 KiB for 64, 68.5 KiB for 128: above [`DEFAULT_MAX_DYNAMIC_SHARED`], so the
/// function must be opted in ([`opt_in_shared_bytes`]).
pub fn attention_bwd_tc_shared_bytes(head_dim: usize) -> usize {
    let (k, q) = (ATTENTION_BWD_TC_BLOCK_K, attention_bwd_tc_block_q(head_dim));
    (2 * k * head_dim + 4 * q * head_dim + k * q) * 2 + 2 * 2 * q * 4
}

/// Whether `attention_bwd_tc_bf16` can run this call: a supported `head_dim` and q, k, v and
/// dout (device addresses) aligned to [`ATTENTION_TC_ALIGN`] (16-byte `cp.async` rows).
/// Otherwise use `attention_bwd_bf16`.
pub fn attention_bwd_tc_supported(head_dim: usize, q: u64, k: u64, v: u64, dout: u64) -> bool {
    ATTENTION_BWD_TC_HEAD_DIMS.contains(&head_dim)
        && [q, k, v, dout].iter().all(|p| p % ATTENTION_TC_ALIGN == 0)
}

/// `attention_bwd_tc_bf16`: grid (ceil(S / 64), Hkv, B) of [`ATTENTION_BWD_THREADS`] threads,
/// one block per 64 keys of one (batch, KV head), and [`attention_bwd_tc_shared_bytes`]. The
/// shape is checked first: head_dim 64 or 128, heads_kv a divisor of heads_q, no empty or
/// oversized grid dimension. The other two launches of the backward are the forward with its
/// lse ([`attention_kernel`] with `lse`) and `attention_bwd_prep_bf16`.
pub fn attention_bwd_tc_launch(
    batch: usize,
    seq_k: usize,
    heads_q: usize,
    heads_kv: usize,
    head_dim: usize,
) -> Result<LaunchConfig, KernelError> {
    TENSOR_CORE_ATTENTION_BWD.launch([batch, seq_k, heads_q, heads_kv, head_dim])
}

/// The attention backward's entry point for one call and its launch configuration:
/// `attention_bwd_tc_bf16` when `tensor_core` is allowed, the dtype is bf16, the device is
/// sm_80 or newer (`sm_major` >= 8) and [`attention_bwd_tc_supported`] holds; otherwise
/// `attention_bwd_{dtype}` ([`attention_bwd_launch`]). `dims = [batch, seq_k, heads_q,
/// heads_kv, head_dim]`; `ptrs` are the device addresses of q, k, v and dout. Both kernels take
/// the same argument list and follow the same three-launch protocol.
pub fn attention_bwd_kernel(
    dtype: KernelDType,
    sm_major: i32,
    tensor_core: bool,
    dims: [usize; 5],
    ptrs: [u64; 4],
) -> Result<(String, LaunchConfig), KernelError> {
    let [q, k, v, dout] = ptrs;
    let supported = attention_bwd_tc_supported(dims[4], q, k, v, dout);
    let pair = [&TENSOR_CORE_ATTENTION_BWD, &SCALAR_ATTENTION_BWD];
    choose_attention_kernel(pair, dtype, sm_major, tensor_core && supported, dims)
}

/// Keys an `attention_probs_*` / `attention_grad_ds_*` thread keeps in registers between the
/// passes over its row (`SHARDC_ROW_CACHE` in common.cuh); keys beyond are recomputed.
pub const ATTENTION_ROWS_KEYS_PER_THREAD: usize = 8;
/// Fewest threads per block of the attention row kernels.
pub const ATTENTION_ROWS_MIN_THREADS: u32 = 64;
/// Most threads per block of the attention row kernels (their block reductions' limit).
pub const ATTENTION_ROWS_MAX_THREADS: u32 = 1024;

/// `attention_probs_*` and `attention_grad_ds_*` (attention_grad.cu) over `rows = B * Hq * Tq`
/// rows of `seq_k` keys: one block per row (block-stride beyond the grid cap), with enough
/// threads (a multiple of 32, 64..=1024) that each holds at most
/// [`ATTENTION_ROWS_KEYS_PER_THREAD`] keys in registers, up to 8192 keys; longer rows
/// recompute the keys past the cache. No shared memory beyond the kernels' static reduction
/// scratch; any head_dim.
pub fn attention_rows_launch(rows: usize, seq_k: usize) -> LaunchConfig {
    let per_thread = seq_k.div_ceil(ATTENTION_ROWS_KEYS_PER_THREAD);
    let threads = u32::try_from(per_thread.div_ceil(32) * 32)
        .unwrap_or(u32::MAX)
        .clamp(ATTENTION_ROWS_MIN_THREADS, ATTENTION_ROWS_MAX_THREADS);
    LaunchConfig {
        grid_dim: (blocks(rows, 1), 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `combine_grad_gates_*` (moe_grad.cu): one warp per (token, expert) pair, 4 warps per block,
/// warp-stride beyond the grid cap.
pub fn combine_grad_gates_launch(tokens: usize, experts: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks(tokens.saturating_mul(experts), 4), 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Threads per block of `moe_route_index_*` (moe_gemm.cu; any multiple of 32 works).
pub const MOE_ROUTE_INDEX_THREADS: u32 = 256;

/// `moe_route_index_*`: one block per expert (a block-wide prefix scan over its tokens),
/// [`MOE_ROUTE_INDEX_THREADS`] threads, no dynamic shared memory. Zero experts still launch one
/// block, which returns at once.
pub fn moe_route_index_launch(experts: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (u32::try_from(experts.max(1)).unwrap_or(u32::MAX), 1, 1),
        block_dim: (MOE_ROUTE_INDEX_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Threads per block of `routed_gemm_*` (`RG_THREADS` in moe_gemm.cu); the kernels trap on any
/// other size.
pub const ROUTED_GEMM_THREADS: u32 = 256;
/// K per shared-memory tile of `routed_gemm_bf16` (`RG_BK`).
pub const ROUTED_GEMM_BF16_BLOCK_K: usize = 32;
/// K per shared-memory tile of `routed_gemm_f32` (`RGF_BK`).
pub const ROUTED_GEMM_F32_BLOCK_K: usize = 16;
/// Alignment in bytes `routed_gemm_bf16` needs of a, w and out (16-byte `cp.async` rows).
pub const ROUTED_GEMM_ALIGN: u64 = 16;

/// The output tile of one `routed_gemm_*` block (routed rows x columns) and of one
/// `routed_weight_grad_*` block (k rows x n columns of `dw[e]`): 128 x 128 for bf16 (tensor
/// cores, 8 warps of 64 x 32), 64 x 64 for f32 (FMA, 4 x 4 a thread). The weight gradient
/// contracts over the routed rows in chunks of [`ROUTED_GEMM_BF16_BLOCK_K`] (bf16) or
/// [`ROUTED_GEMM_F32_BLOCK_K`] (f32) rows.
pub fn routed_gemm_tile(dtype: KernelDType) -> (usize, usize) {
    match dtype {
        KernelDType::Bf16 => (128, 128),
        KernelDType::F32 => (64, 64),
    }
}

/// Dynamic shared memory of `routed_gemm_*`, plus the tile's token rows (`i32`): bf16, two
/// buffers of a 128 x 32 A tile and a 32 x 128 (or 128 x 32) W tile (33 280 bytes); f32, a
/// 16 x 64 A and W tile with rows padded to 65 floats (8 576 bytes). Both under
/// [`DEFAULT_MAX_DYNAMIC_SHARED`], so no opt-in.
pub fn routed_gemm_shared_bytes(dtype: KernelDType) -> usize {
    let (bm, bn) = routed_gemm_tile(dtype);
    match dtype {
        KernelDType::Bf16 => 2 * (bm + bn) * ROUTED_GEMM_BF16_BLOCK_K * 2 + bm * 4,
        KernelDType::F32 => ROUTED_GEMM_F32_BLOCK_K * 2 * (bm + 1) * 4 + bm * 4,
    }
}

/// Whether `routed_gemm_{dtype}` (operands a, w, out) or `routed_weight_grad_{dtype}` (a, dy,
/// dw) can run this call: always for f32; for bf16, `k` and `n` multiples of 8 and the three
/// device addresses aligned to [`ROUTED_GEMM_ALIGN`] (both bf16 kernels move 16-byte row
/// chunks and trap on `k` or `n` off 8). Otherwise the caller keeps another path (the dense
/// expert GEMMs).
pub fn routed_gemm_supported(dtype: KernelDType, k: usize, n: usize, ptrs: [u64; 3]) -> bool {
    match dtype {
        KernelDType::F32 => true,
        KernelDType::Bf16 => {
            k % 8 == 0 && n % 8 == 0 && ptrs.iter().all(|p| p % ROUTED_GEMM_ALIGN == 0)
        }
    }
}

/// `routed_gemm_*` over `experts` experts of `tokens` tokens with `n` output columns: grid
/// (ceil(n / BN), ceil(tokens / BM), experts) with the [`routed_gemm_tile`] of `dtype` (each
/// dimension at least 1), [`ROUTED_GEMM_THREADS`] threads, [`routed_gemm_shared_bytes`].
/// Blocks beyond an expert's routed tiles return at once, so the cost follows the routed rows.
/// The grid's y dimension limits `tokens` to 65 535 x BM (8.4 M for bf16, 4.2 M for f32).
pub fn routed_gemm_launch(
    dtype: KernelDType,
    tokens: usize,
    n: usize,
    experts: usize,
) -> LaunchConfig {
    routed_tiles_launch(dtype, tokens, n, experts, routed_gemm_shared_bytes(dtype))
}

/// The grid of both routed families: (ceil(n / BN), ceil(rows / BM), experts) tiles of
/// [`routed_gemm_tile`] (each dimension at least 1), [`ROUTED_GEMM_THREADS`] threads, `shared`
/// bytes (under 48 KiB).
fn routed_tiles_launch(
    dtype: KernelDType,
    rows: usize,
    n: usize,
    experts: usize,
    shared: usize,
) -> LaunchConfig {
    let (bm, bn) = routed_gemm_tile(dtype);
    let dim =
        |count: usize, per: usize| u32::try_from(count.div_ceil(per).max(1)).unwrap_or(u32::MAX);
    LaunchConfig {
        grid_dim: (dim(n, bn), dim(rows, bm), dim(experts, 1)),
        block_dim: (ROUTED_GEMM_THREADS, 1, 1),
        shared_mem_bytes: u32::try_from(shared).expect("invariant: under 48 KiB"),
    }
}

/// Token rows per staged window of `routed_weight_grad_*` (`RWG_WINDOW`, one per thread): the
/// routed list's row indices are read into shared memory this many at a time.
pub const ROUTED_WEIGHT_GRAD_ROW_WINDOW: usize = 256;

/// Dynamic shared memory of `routed_weight_grad_*`, plus the staged window of token rows
/// ([`ROUTED_WEIGHT_GRAD_ROW_WINDOW`] `i32`): bf16, two buffers of a 32-row chunk of a (x 128
/// k) and of dy (x 128 n), reused for the bf16 output tile (33 792 bytes); f32, one 16-row chunk
/// of a and of dy x 64 (9 216 bytes). Both under [`DEFAULT_MAX_DYNAMIC_SHARED`], so no opt-in.
pub fn routed_weight_grad_shared_bytes(dtype: KernelDType) -> usize {
    let (bk, bn) = routed_gemm_tile(dtype);
    let rows = ROUTED_WEIGHT_GRAD_ROW_WINDOW * 4;
    match dtype {
        KernelDType::Bf16 => 2 * (bk + bn) * ROUTED_GEMM_BF16_BLOCK_K * 2 + rows,
        KernelDType::F32 => ROUTED_GEMM_F32_BLOCK_K * (bk + bn) * 4 + rows,
    }
}

/// `routed_weight_grad_*` for `dw` `[experts, k, n]` (or `[experts, n, k]`): grid
/// (ceil(n / BN), ceil(k / BK), experts) with the [`routed_gemm_tile`] (BK x BN) of
/// `dtype` (each dimension at least 1), [`ROUTED_GEMM_THREADS`] threads,
/// [`routed_weight_grad_shared_bytes`]. Every block writes its whole tile of `dw[e]` (zeros for
/// an expert without routed rows), its cost following `counts[e]`. The grid's y dimension
/// limits `k` to 65 535 x BK (8.4 M for bf16, 4.2 M for f32).
pub fn routed_weight_grad_launch(
    dtype: KernelDType,
    k: usize,
    n: usize,
    experts: usize,
) -> LaunchConfig {
    routed_tiles_launch(dtype, k, n, experts, routed_weight_grad_shared_bytes(dtype))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A launch over (batch, seq, heads_q, heads_kv, head_dim).
    type AttentionLaunch =
        fn(usize, usize, usize, usize, usize) -> Result<LaunchConfig, KernelError>;

    /// Each shape of `bad` makes `launch` fail with an InvalidLaunch of `kernel` naming the
    /// parameter given with it.
    fn assert_invalid_launches(kernel: &str, launch: AttentionLaunch, bad: &[([usize; 5], &str)]) {
        for &([b, s, hq, hkv, d], want) in bad {
            match launch(b, s, hq, hkv, d) {
                Err(KernelError::InvalidLaunch {
                    kernel: k, param, ..
                }) => assert_eq!((k, param), (kernel, want), "{b} {s} {hq} {hkv} {d}"),
                other => panic!("{b} {s} {hq} {hkv} {d}: want an InvalidLaunch, got {other:?}"),
            }
        }
    }

    #[test]
    fn attention_config() {
        let c = attention_launch(2, 33, 32, 8, 128).expect("valid shape");
        assert_eq!(c.grid_dim, (3, 32, 2));
        assert_eq!(c.block_dim, (128, 1, 1));
        assert_eq!(c.shared_mem_bytes, 48 * 128 * 4);
        assert_eq!(attention_shared_bytes(256), 48 * 1024);
        assert_eq!(attention_shared_bytes(80), 48 * 96 * 4);
        assert!(attention_launch(1, 1, 32, 8, 257).is_err());
        assert!(attention_launch(1, 1, 32, 6, 64).is_err());
        assert!(attention_launch(1, 0, 32, 8, 64).is_err());
    }

    #[test]
    fn tensor_core_attention_config() {
        let aligned = [256, 4096, 1 << 20];
        let (entry, c) = attention_kernel(
            KernelDType::Bf16,
            9,
            true,
            false,
            [2, 65, 32, 8, 128],
            aligned,
        )
        .expect("valid shape");
        assert_eq!(entry, "attention_tc_bf16");
        assert_eq!(c.grid_dim, (2, 32, 2));
        assert_eq!(c.block_dim, (128, 1, 1));
        assert_eq!(c.shared_mem_bytes, 80 * 1024);
        assert_eq!(attention_tc_shared_bytes(64), 40 * 1024);
        assert!(attention_tc_shared_bytes(64) <= DEFAULT_MAX_DYNAMIC_SHARED);
        assert!(attention_tc_shared_bytes(128) > DEFAULT_MAX_DYNAMIC_SHARED);
        for d in [32, 80, 96, 256] {
            assert!(
                TENSOR_CORE_ATTENTION.launch([1, 1, 32, 8, d]).is_err(),
                "head_dim {d}"
            );
            assert!(!attention_tc_supported(d, 0, 0, 0), "head_dim {d}");
        }
        assert!(TENSOR_CORE_ATTENTION.launch([1, 1, 32, 6, 64]).is_err());
        assert!(attention_tc_supported(64, 256, 4096, 1 << 20));
        assert!(!attention_tc_supported(128, 256, 4096 + 8, 1 << 20));
    }

    #[test]
    fn attention_kernel_choice() {
        let aligned = [256, 4096, 1 << 20];
        let pick = |dt, sm, tc, d, qkv| {
            attention_kernel(dt, sm, tc, false, [1, 100, 32, 8, d], qkv)
                .map(|(entry, cfg)| (entry, cfg.grid_dim.0))
                .expect("valid shape")
        };
        let (bf16, f32) = (KernelDType::Bf16, KernelDType::F32);
        let (tc, scalar) = ("attention_tc_bf16", "attention_bf16");
        // (dtype, sm major, allowed, head_dim, q/k/v, entry, query blocks); the fallbacks:
        // not allowed, f32, pre-Ampere, head_dim, alignment.
        let cases = [
            (bf16, 9, true, 128, aligned, tc, 2),
            (bf16, 8, true, 64, aligned, tc, 2),
            (bf16, 9, false, 128, aligned, scalar, 7),
            (f32, 9, true, 128, aligned, "attention_f32", 7),
            (bf16, 7, true, 128, aligned, scalar, 7),
            (bf16, 9, true, 96, aligned, scalar, 7),
            (bf16, 9, true, 128, [256, 4098, 1 << 20], scalar, 7),
        ];
        for (dt, sm, allowed, d, qkv, entry, blocks) in cases {
            let case = format!("{dt:?} sm {sm} allowed {allowed} d {d} {qkv:?}");
            assert_eq!(
                pick(dt, sm, allowed, d, qkv),
                (entry.into(), blocks),
                "{case}"
            );
        }
        let bf16 = KernelDType::Bf16;
        assert!(attention_kernel(bf16, 9, true, false, [1, 1, 32, 8, 300], aligned).is_err());
        assert_eq!(opt_in_shared_bytes("attention_tc_bf16"), Some(80 * 1024));
        assert_eq!(
            opt_in_shared_bytes("attention_tc_lse_bf16"),
            Some(80 * 1024)
        );
        assert_eq!(opt_in_shared_bytes("attention_bf16"), None);
    }

    #[test]
    fn attention_lse_kernel_follows_the_forward_choice() {
        let aligned = [256, 4096, 1 << 20];
        let (bf16, f32) = (KernelDType::Bf16, KernelDType::F32);
        // (dtype, sm major, allowed, head_dim, q/k/v, entry).
        let cases = [
            (bf16, 9, true, 128, aligned, "attention_tc_lse_bf16"),
            (bf16, 9, false, 128, aligned, "attention_lse_bf16"),
            (bf16, 7, true, 64, aligned, "attention_lse_bf16"),
            (bf16, 9, true, 96, aligned, "attention_lse_bf16"),
            (
                bf16,
                9,
                true,
                128,
                [256, 4098, 1 << 20],
                "attention_lse_bf16",
            ),
            (f32, 9, true, 128, aligned, "attention_lse_f32"),
        ];
        for (dt, sm, allowed, d, qkv, entry) in cases {
            let dims = [2, 100, 32, 8, d];
            let (got, cfg) = attention_kernel(dt, sm, allowed, true, dims, qkv).expect("valid");
            let (plain, plain_cfg) =
                attention_kernel(dt, sm, allowed, false, dims, qkv).expect("valid");
            assert_eq!(got, entry, "{dt:?} sm {sm} allowed {allowed} d {d}");
            // The same kernel family and launch as the plain forward.
            assert_eq!(got.replace("_lse", ""), plain);
            assert_eq!(
                (cfg.grid_dim, cfg.block_dim, cfg.shared_mem_bytes),
                (
                    plain_cfg.grid_dim,
                    plain_cfg.block_dim,
                    plain_cfg.shared_mem_bytes
                )
            );
        }
    }

    #[test]
    fn split_kv_heuristic_and_fallbacks() {
        // Llama-3-8B decode: Hq 32, Hkv 8, D 128, Tq 1 on an H100 (132 SMs).
        let llama = |b, t, s| [b, t, s, 32, 8, 128];
        let sms = 132;
        // Ordinary grids: scalar 1 x 32 x 1 = 32 blocks; the split grid has 8 blocks per split.
        assert_eq!(split_kv_splits(true, sms, 32, llama(1, 1, 4096)), Ok(16));
        // 3 x 132 / 8 = 49.5 -> 50 splits, 16384 / 256 = 64 allowed.
        assert_eq!(split_kv_splits(true, sms, 32, llama(1, 1, 16384)), Ok(50));
        // Short: capped by 256 keys per split (1280 / 256 = 5).
        assert_eq!(split_kv_splits(true, sms, 32, llama(1, 1, 1280)), Ok(5));
        // Tq 16 packs 4 query heads x 16 = 64 rows = 4 tiles per KV head: 32 blocks per split.
        assert_eq!(split_kv_splits(true, sms, 32, llama(1, 16, 8192)), Ok(13));
        let fallbacks = [
            (false, sms, 32, llama(1, 1, 4096), SplitKvFallback::Disabled),
            (
                true,
                0,
                32,
                llama(1, 1, 4096),
                SplitKvFallback::UnknownSmCount,
            ),
            (
                true,
                sms,
                264,
                llama(1, 1, 4096),
                SplitKvFallback::GridFull {
                    blocks: 264,
                    sm_count: sms,
                },
            ),
            (
                true,
                sms,
                32,
                llama(1, 1, 1023),
                SplitKvFallback::ShortKeys { seq_k: 1023 },
            ),
            // 8 batches x 8 KV heads x 16 tiles = 1024 blocks per split: past the target.
            (
                true,
                sms,
                263,
                llama(8, 64, 4096),
                SplitKvFallback::OneSplit,
            ),
        ];
        for (enabled, sm, blocks, dims, why) in fallbacks {
            assert_eq!(
                split_kv_splits(enabled, sm, blocks, dims),
                Err(why),
                "{dims:?}"
            );
        }
        assert_eq!(split_kv_splits(true, sms, 263, llama(1, 1, 4096)), Ok(16));
        assert_eq!(
            split_kv_workspace_bytes(llama(1, 1, 4096), 16),
            16 * 32 * 130 * 4
        );
        assert_eq!(
            split_kv_reserve_bytes(llama(1, 1, 4096), sms),
            16 * 32 * 130 * 4
        );
        assert_eq!(split_kv_reserve_bytes(llama(1, 1, 512), sms), 0);
    }

    #[test]
    fn split_kv_launch_config() {
        let l =
            split_kv_launch(KernelDType::Bf16, [2, 4, 4096, 32, 8, 128], 16).expect("valid shape");
        assert_eq!(l.partial, "attention_decode_bf16");
        assert_eq!(l.combine, "attention_decode_combine_bf16");
        // 4 queries x 4 heads = 16 rows: one tile per KV head.
        assert_eq!(l.partial_cfg.grid_dim, (16, 8, 2));
        assert_eq!(l.partial_cfg.block_dim, (128, 1, 1));
        assert_eq!(l.partial_cfg.shared_mem_bytes, 48 * 128 * 4);
        assert_eq!(l.combine_cfg.grid_dim, (2 * 4 * 32, 1, 1));
        assert_eq!(l.combine_cfg.block_dim.0 % 32, 0);
        assert_eq!(l.workspace_bytes, 2 * 16 * 4 * 32 * 130 * 4);
        let f32 = KernelDType::F32;
        let l = split_kv_launch(f32, [1, 5, 900, 8, 2, 80], 3).expect("valid shape");
        assert_eq!(l.partial, "attention_decode_f32");
        assert_eq!(
            l.partial_cfg.grid_dim,
            (3, 2 * 2, 1),
            "20 rows: 2 tiles per KV head"
        );
        assert!(split_kv_launch(f32, [1, 1, 4096, 32, 8, 257], 4).is_err());
        assert!(split_kv_launch(f32, [1, 1, 4096, 32, 6, 128], 4).is_err());
        assert!(split_kv_launch(f32, [1, 1, 4096, 32, 8, 128], 0).is_err());
        assert!(split_kv_launch(f32, [1, 0, 4096, 32, 8, 128], 4).is_err());
    }

    #[test]
    fn attention_plan_choice() {
        let aligned = [256, 4096, 1 << 20];
        let dims = [1, 1, 4096, 32, 8, 128];
        let ws = split_kv_reserve_bytes(dims, 132);
        let plan = |dt, tc, ws, dims| {
            attention_plan(dt, (9, 132), tc, ws, dims, aligned).expect("valid shape")
        };
        let bf16 = KernelDType::Bf16;
        match plan(bf16, true, ws, dims) {
            AttentionPlan::SplitKv(l) => {
                assert_eq!(
                    (l.partial.as_str(), l.num_splits),
                    ("attention_decode_bf16", 16)
                );
                assert_eq!(l.workspace_bytes, ws);
            }
            other => panic!("expected split-KV, got {other:?}"),
        }
        // No workspace, too small a workspace, a long prefill (full grid), a short cache.
        let single = [
            (0, dims, "attention_tc_bf16"),
            (ws - 4, dims, "attention_tc_bf16"),
            (ws, [1, 4096, 4096, 32, 8, 128], "attention_tc_bf16"),
            (ws, [1, 1, 512, 32, 8, 128], "attention_tc_bf16"),
            (0, [1, 1, 4096, 32, 8, 96], "attention_bf16"),
        ];
        for (ws, dims, entry) in single {
            match plan(bf16, true, ws, dims) {
                AttentionPlan::Single(e, _) => assert_eq!(e, entry, "{dims:?} ws {ws}"),
                other => panic!("{dims:?} ws {ws}: expected {entry}, got {other:?}"),
            }
        }
        // The split path takes any head_dim the scalar kernel does.
        let d96 = [1, 1, 4096, 32, 8, 96];
        let d96_plan = plan(bf16, true, split_kv_reserve_bytes(d96, 132), d96);
        assert!(
            matches!(&d96_plan, AttentionPlan::SplitKv(l) if l.num_splits == 16),
            "{d96_plan:?}"
        );
        let f32_plan = plan(KernelDType::F32, false, ws, dims);
        assert!(
            matches!(&f32_plan, AttentionPlan::SplitKv(l) if l.partial == "attention_decode_f32"),
            "{f32_plan:?}"
        );
        assert!(
            attention_plan(bf16, (9, 132), true, ws, [1, 1, 4096, 32, 8, 300], aligned).is_err()
        );
    }

    #[test]
    fn attention_bwd_config() {
        let c = attention_bwd_launch(2, 512, 32, 8, 128).expect("valid shape");
        assert_eq!(c.grid_dim, (16, 8, 2));
        assert_eq!(c.block_dim, (128, 1, 1));
        assert_eq!(c.shared_mem_bytes, (80 * 128 + 512) * 4);
        assert!(attention_bwd_shared_bytes(128) <= DEFAULT_MAX_DYNAMIC_SHARED);
        assert_eq!(attention_bwd_shared_bytes(40), (80 * 64 + 512) * 4);
        let c = attention_bwd_launch(1, 33, 4, 2, 40).expect("valid shape");
        assert_eq!(c.grid_dim, (2, 2, 1));
        // (batch, seq_k, heads_q, heads_kv, head_dim) and the parameter the error names.
        let bad = [
            ([1, 64, 32, 8, 129], "head_dim"),
            ([1, 64, 32, 8, 0], "head_dim"),
            ([1, 64, 32, 6, 64], "heads_kv"),
            ([1, 64, 32, 0, 64], "heads_kv"),
            ([1, 0, 32, 8, 64], "seq_k"),
            ([0, 64, 32, 8, 64], "batch"),
            ([70_000, 64, 32, 8, 64], "batch"),
        ];
        assert_invalid_launches("attention_bwd", attention_bwd_launch, &bad);
        let p = attention_bwd_prep_launch(9);
        assert_eq!((p.grid_dim, p.block_dim), ((3, 1, 1), (128, 1, 1)));
        assert_eq!(
            attention_bwd_prep_launch(1 << 40).grid_dim.0,
            MAX_GRID_STRIDE_BLOCKS
        );
    }

    #[test]
    fn tensor_core_attention_bwd_config() {
        let c = attention_bwd_tc_launch(2, 512, 32, 8, 128).expect("valid shape");
        assert_eq!(c.grid_dim, (8, 8, 2));
        assert_eq!(c.block_dim, (128, 1, 1));
        // K, V: 2 x 64 x 128; Q, dO: 4 x 32 x 128; dSᵀ 64 x 32 (bf16); lse, delta 4 x 32 (f32).
        assert_eq!(c.shared_mem_bytes, (16_384 + 16_384 + 2_048) * 2 + 512);
        assert_eq!(
            attention_bwd_tc_shared_bytes(64),
            (8_192 + 16_384 + 4_096) * 2 + 1_024
        );
        assert_eq!(
            (attention_bwd_tc_block_q(64), attention_bwd_tc_block_q(128)),
            (64, 32)
        );
        for d in ATTENTION_BWD_TC_HEAD_DIMS {
            assert!(attention_bwd_tc_shared_bytes(d) > DEFAULT_MAX_DYNAMIC_SHARED);
        }
        let c = attention_bwd_tc_launch(2, 130, 4, 2, 64).expect("valid shape");
        assert_eq!((c.grid_dim, c.shared_mem_bytes), ((3, 2, 2), 58_368));
        // (batch, seq_k, heads_q, heads_kv, head_dim) and the parameter the error names.
        let bad = [
            ([1, 64, 32, 8, 96], "head_dim"),
            ([1, 64, 32, 8, 40], "head_dim"),
            ([1, 64, 32, 8, 256], "head_dim"),
            ([1, 64, 32, 6, 64], "heads_kv"),
            ([1, 64, 32, 0, 128], "heads_kv"),
            ([1, 0, 32, 8, 64], "seq_k"),
            ([0, 64, 32, 8, 64], "batch"),
            ([1, 64, 32 * 70_000, 70_000, 64], "heads_kv"),
        ];
        assert_invalid_launches("attention_bwd_tc", attention_bwd_tc_launch, &bad);
        let aligned = [256, 4096, 1 << 20, 1 << 30];
        assert!(attention_bwd_tc_supported(64, 256, 4096, 1 << 20, 1 << 30));
        for i in 0..4 {
            let mut p = aligned;
            p[i] += 8;
            assert!(
                !attention_bwd_tc_supported(128, p[0], p[1], p[2], p[3]),
                "{p:?}"
            );
        }
        for d in [32, 40, 80, 96, 256] {
            assert!(!attention_bwd_tc_supported(d, 0, 0, 0, 0), "head_dim {d}");
        }
        assert_eq!(
            opt_in_shared_bytes("attention_bwd_tc_bf16"),
            Some(attention_bwd_tc_shared_bytes(128))
        );
        assert_eq!(opt_in_shared_bytes("attention_bwd_bf16"), None);
    }

    #[test]
    fn attention_bwd_kernel_choice() {
        let aligned = [256, 4096, 1 << 20, 1 << 30];
        let pick = |dt, sm, tc, d, ptrs| {
            attention_bwd_kernel(dt, sm, tc, [1, 100, 32, 8, d], ptrs)
                .map(|(entry, cfg)| (entry, cfg.grid_dim.0, cfg.shared_mem_bytes))
                .expect("valid shape")
        };
        let (bf16, f32) = (KernelDType::Bf16, KernelDType::F32);
        let (tc, scalar) = ("attention_bwd_tc_bf16", "attention_bwd_bf16");
        let tc_bytes = |d| attention_bwd_tc_shared_bytes(d) as u32;
        let scalar_bytes = |d| attention_bwd_shared_bytes(d) as u32;
        // (dtype, sm major, allowed, head_dim, q/k/v/dout, entry, key blocks, shared bytes); the
        // fallbacks: not allowed, f32, pre-Ampere, head_dim, alignment of q and of dout.
        let cases = [
            (bf16, 9, true, 128, aligned, tc, 2, tc_bytes(128)),
            (bf16, 8, true, 64, aligned, tc, 2, tc_bytes(64)),
            (bf16, 9, false, 128, aligned, scalar, 4, scalar_bytes(128)),
            (
                f32,
                9,
                true,
                128,
                aligned,
                "attention_bwd_f32",
                4,
                scalar_bytes(128),
            ),
            (bf16, 7, true, 64, aligned, scalar, 4, scalar_bytes(64)),
            (bf16, 9, true, 96, aligned, scalar, 4, scalar_bytes(96)),
            (
                bf16,
                9,
                true,
                128,
                [258, 4096, 1 << 20, 1 << 30],
                scalar,
                4,
                scalar_bytes(128),
            ),
            (
                bf16,
                9,
                true,
                64,
                [256, 4096, 1 << 20, (1 << 30) + 2],
                scalar,
                4,
                scalar_bytes(64),
            ),
        ];
        for (dt, sm, allowed, d, ptrs, entry, blocks, bytes) in cases {
            let case = format!("{dt:?} sm {sm} allowed {allowed} d {d} {ptrs:?}");
            assert_eq!(
                pick(dt, sm, allowed, d, ptrs),
                (entry.into(), blocks, bytes),
                "{case}"
            );
        }
        // Past the scalar kernel's head widths there is no kernel at all.
        assert!(attention_bwd_kernel(bf16, 9, true, [1, 64, 32, 8, 256], aligned).is_err());
        assert!(attention_bwd_kernel(bf16, 9, true, [1, 64, 32, 6, 128], aligned).is_err());
    }

    #[test]
    fn attention_grad_configs() {
        // One block per row; threads for at most 8 keys each, a multiple of 32 in 64..=1024.
        let c = attention_rows_launch(2 * 4 * 37, 37);
        assert_eq!((c.grid_dim, c.block_dim), ((296, 1, 1), (64, 1, 1)));
        assert_eq!(c.shared_mem_bytes, 0);
        assert_eq!(attention_rows_launch(1, 0).block_dim.0, 64);
        assert_eq!(attention_rows_launch(1, 512).block_dim.0, 64);
        assert_eq!(attention_rows_launch(1, 513).block_dim.0, 96);
        assert_eq!(attention_rows_launch(1, 4096).block_dim.0, 512);
        assert_eq!(attention_rows_launch(1, 8192).block_dim.0, 1024);
        assert_eq!(attention_rows_launch(1, 1 << 20).block_dim.0, 1024);
        for s in [1, 37, 300, 513, 2049, 8191, 8192, 100_000] {
            let t = attention_rows_launch(3, s).block_dim.0 as usize;
            assert_eq!(t % 32, 0, "S={s}");
            assert!(
                s > 8192 || t * ATTENTION_ROWS_KEYS_PER_THREAD >= s,
                "S={s}: {t} threads"
            );
        }
        // Rows beyond the grid cap are walked block-stride.
        assert_eq!(
            attention_rows_launch(8 * 32 * 4096, 4096).grid_dim.0,
            MAX_GRID_STRIDE_BLOCKS
        );
        assert_eq!(attention_rows_launch(0, 37).grid_dim.0, 1);
    }

    #[test]
    fn combine_grad_gates_config() {
        // A warp per (token, expert) pair, 4 per block.
        let g = combine_grad_gates_launch(6, 8);
        assert_eq!((g.grid_dim, g.block_dim), ((12, 1, 1), (128, 1, 1)));
        assert_eq!(combine_grad_gates_launch(0, 8).grid_dim.0, 1);
        assert_eq!(
            combine_grad_gates_launch(1 << 40, 8).grid_dim.0,
            MAX_GRID_STRIDE_BLOCKS
        );
    }

    #[test]
    fn moe_gemm_configs() {
        let r = moe_route_index_launch(8);
        assert_eq!((r.grid_dim, r.block_dim), ((8, 1, 1), (256, 1, 1)));
        assert_eq!(r.shared_mem_bytes, 0);
        assert_eq!(moe_route_index_launch(0).grid_dim, (1, 1, 1));

        let (bf16, f32) = (KernelDType::Bf16, KernelDType::F32);
        // Mixtral: 16384 tokens, w1 [8, 4096, 14336].
        let c = routed_gemm_launch(bf16, 16_384, 14_336, 8);
        assert_eq!(c.grid_dim, (112, 128, 8));
        assert_eq!(c.block_dim, (256, 1, 1));
        assert_eq!(c.shared_mem_bytes, 2 * 256 * 32 * 2 + 128 * 4);
        // Partial tiles round up; f32 tiles are 64 x 64.
        assert_eq!(routed_gemm_launch(bf16, 70, 136, 3).grid_dim, (2, 1, 3));
        let c = routed_gemm_launch(f32, 70, 136, 3);
        assert_eq!(c.grid_dim, (3, 2, 3));
        assert_eq!(c.shared_mem_bytes, 16 * 2 * 65 * 4 + 64 * 4);
        assert_eq!(routed_gemm_launch(f32, 0, 0, 0).grid_dim, (1, 1, 1));
        for dt in KernelDType::ALL {
            assert!(routed_gemm_shared_bytes(dt) <= DEFAULT_MAX_DYNAMIC_SHARED);
            assert_eq!(opt_in_shared_bytes(&entry_name("routed_gemm", dt)), None);
        }

        let aligned = [256, 4096, 1 << 20];
        assert!(routed_gemm_supported(bf16, 4096, 14_336, aligned));
        assert!(routed_gemm_supported(bf16, 40, 24, aligned));
        // k or n off 8, or any of a, w, out off 16 bytes: bf16 refuses, f32 takes anything.
        for (k, n) in [(4100, 14_336), (4096, 14_340), (7, 8)] {
            assert!(!routed_gemm_supported(bf16, k, n, aligned), "k {k} n {n}");
            assert!(routed_gemm_supported(f32, k, n, aligned), "k {k} n {n}");
        }
        for i in 0..3 {
            let mut p = aligned;
            p[i] += 8;
            assert!(!routed_gemm_supported(bf16, 4096, 4096, p), "{p:?}");
            assert!(routed_gemm_supported(f32, 4096, 4096, p), "{p:?}");
        }
    }

    #[test]
    fn routed_weight_grad_configs() {
        let (bf16, f32) = (KernelDType::Bf16, KernelDType::F32);
        // Mixtral's w1 gradient: dw1 [8, 4096, 14336], tiles of 128 x 128.
        let c = routed_weight_grad_launch(bf16, 4096, 14_336, 8);
        assert_eq!(c.grid_dim, (112, 32, 8));
        assert_eq!(c.block_dim, (256, 1, 1));
        assert_eq!(c.shared_mem_bytes, 2 * 256 * 32 * 2 + 256 * 4);
        // Partial tiles round up; f32 tiles are 64 x 64 with 16-row chunks.
        let launch = routed_weight_grad_launch;
        assert_eq!(launch(bf16, 72, 136, 4).grid_dim, (2, 1, 4));
        let c = launch(f32, 72, 136, 4);
        assert_eq!((c.grid_dim, c.block_dim), ((3, 2, 4), (256, 1, 1)));
        assert_eq!(c.shared_mem_bytes, 16 * 128 * 4 + 256 * 4);
        assert_eq!(launch(f32, 0, 0, 0).grid_dim, (1, 1, 1));
        for dt in KernelDType::ALL {
            assert!(routed_weight_grad_shared_bytes(dt) <= DEFAULT_MAX_DYNAMIC_SHARED);
            assert_eq!(
                opt_in_shared_bytes(&entry_name("routed_weight_grad", dt)),
                None
            );
        }
        // Which calls the kernel takes: `routed_gemm_supported`, tested in `moe_gemm_configs`.
    }

    #[test]
    fn grid_stride_configs() {
        assert_eq!(elementwise_launch(0).grid_dim, (1, 1, 1));
        assert_eq!(elementwise_launch(1000).grid_dim, (4, 1, 1));
        assert_eq!(
            elementwise_launch(1 << 40).grid_dim.0,
            MAX_GRID_STRIDE_BLOCKS
        );
        let r = rows_launch(7, 4096);
        assert_eq!((r.grid_dim.0, r.block_dim.0 % 32), (7, 0));
        assert!(router_launch(10, 2000).is_err());
        assert_eq!(vector_launch(1000, KernelDType::F32).grid_dim, (1, 1, 1));
        assert_eq!(vector_launch(2049, KernelDType::Bf16).grid_dim, (2, 1, 1));
        assert_eq!(vector_launch(0, KernelDType::Bf16).grid_dim, (1, 1, 1));
        assert_eq!(rope_launch(2048, KernelDType::Bf16).grid_dim, (2, 1, 1));
        assert_eq!(rope_launch(2048, KernelDType::F32).grid_dim, (4, 1, 1));
        assert_eq!(router_launch(10, 8).map(|c| c.grid_dim.0).ok(), Some(3));
    }

    #[test]
    fn column_reduction_configs() {
        // (rows, cols) -> (blocks, threads): a block per 32 columns, a warp per 16 rows.
        let cases = [
            ((5, 300), (10, 32)),
            ((0, 0), (1, 32)),
            ((17, 32), (1, 64)),
            ((8192, 4096), (128, 1024)),
            ((1 << 30, 33), (2, 1024)),
            ((4, 1 << 40), (MAX_GRID_STRIDE_BLOCKS, 32)),
        ];
        for ((rows, cols), (grid, threads)) in cases {
            let c = columns_launch(rows, cols);
            assert_eq!(
                (c.grid_dim, c.block_dim, c.shared_mem_bytes),
                ((grid, 1, 1), (threads, 1, 1), 0),
                "{rows} x {cols}"
            );
        }
    }
}
