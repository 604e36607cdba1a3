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
/// cross_entropy_from_stats (n = rows), the runtime's layout kernels.
pub fn elementwise_launch(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks(n, ELEMENTWISE_THREADS as usize), 1, 1),
        block_dim: (ELEMENTWISE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Grid-stride kernels that move 16-byte vectors (`dtype.vector_lanes()` elements per thread
/// and step) over `n` elements: unary, scale, add/mul, swiglu, reduce_*, embedding (n =
/// ids·hidden), generated fused kernels. One
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
/// cross_entropy_stats, cross_entropy_shard_grad.
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

/// `router_*`: one warp per token, 4 warps per block.
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
/// `dims = [batch, seq_q, heads_q, heads_kv, head_dim]`; `qkv` are the device addresses of q,
/// k and v. Both kernels take the same argument list.
pub fn attention_kernel(
    dtype: KernelDType,
    sm_major: i32,
    tensor_core: bool,
    dims: [usize; 5],
    qkv: [u64; 3],
) -> Result<(String, LaunchConfig), KernelError> {
    let head_dim = dims[4];
    let [q, k, v] = qkv;
    if tensor_core
        && dtype == KernelDType::Bf16
        && sm_major >= 8
        && attention_tc_supported(head_dim, q, k, v)
    {
        let cfg = TENSOR_CORE_ATTENTION.launch(dims)?;
        return Ok((entry_name(TENSOR_CORE_ATTENTION.name, dtype), cfg));
    }
    let cfg = SCALAR_ATTENTION.launch(dims)?;
    Ok((entry_name(SCALAR_ATTENTION.name, dtype), cfg))
}

/// The dynamic shared memory to opt kernel `entry` in to when it is loaded
/// (`CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`), for kernels whose launches may ask for
/// more than [`DEFAULT_MAX_DYNAMIC_SHARED`]; `None` for every other kernel.
pub fn opt_in_shared_bytes(entry: &str) -> Option<usize> {
    let widest = ATTENTION_TC_HEAD_DIMS.iter().copied().max().unwrap_or(0);
    (entry == "attention_tc_bf16").then(|| attention_tc_shared_bytes(widest))
}

/// One attention kernel's launch contract: grid (ceil(Tq / block_q), Hq, B) of
/// [`ATTENTION_THREADS`] threads and `shared_bytes(head_dim)` of dynamic shared memory.
struct AttentionKernel {
    /// Entry point family.
    name: &'static str,
    block_q: usize,
    head_dim_ok: fn(usize) -> bool,
    /// The head widths `head_dim_ok` accepts, for the error.
    head_dims: &'static str,
    /// Dynamic shared memory for a head_dim that passed the check.
    shared_bytes: fn(usize) -> usize,
}

/// `attention_{f32,bf16}` (attention.cu).
const SCALAR_ATTENTION: AttentionKernel = AttentionKernel {
    name: "attention",
    block_q: ATTENTION_BLOCK_Q,
    head_dim_ok: |d| (1..=ATTENTION_MAX_HEAD_DIM).contains(&d),
    head_dims: "1..=256",
    shared_bytes: attention_shared_bytes,
};

/// `attention_tc_bf16` (attention_tc.cu).
const TENSOR_CORE_ATTENTION: AttentionKernel = AttentionKernel {
    name: "attention_tc",
    block_q: ATTENTION_TC_BLOCK_Q,
    head_dim_ok: |d| ATTENTION_TC_HEAD_DIMS.contains(&d),
    head_dims: "64 or 128",
    shared_bytes: attention_tc_shared_bytes,
};

impl AttentionKernel {
    /// The launch for `dims = [batch, seq_q, heads_q, heads_kv, head_dim]`, after checking
    /// the shape.
    fn launch(&self, dims: [usize; 5]) -> Result<LaunchConfig, KernelError> {
        let [batch, seq_q, heads_q, heads_kv, head_dim] = dims;
        let bad = |param, value, allowed| KernelError::InvalidLaunch {
            kernel: self.name,
            param,
            value,
            allowed,
        };
        if !(self.head_dim_ok)(head_dim) {
            return Err(bad("head_dim", head_dim, self.head_dims));
        }
        if heads_kv == 0 || heads_q % heads_kv != 0 {
            return Err(bad("heads_kv", heads_kv, "a divisor of heads_q"));
        }
        let dim = |param, value: usize, max: usize, allowed| {
            if value == 0 || value > max {
                Err(bad(param, value, allowed))
            } else {
                Ok(u32::try_from(value).expect("invariant: value <= max <= u32::MAX"))
            }
        };
        let tiles = seq_q.div_ceil(self.block_q);
        Ok(LaunchConfig {
            grid_dim: (
                dim("seq_q", tiles, i32::MAX as usize, "1..=2^31 query tiles")?,
                dim("heads_q", heads_q, 65_535, "1..=65535")?,
                dim("batch", batch, 65_535, "1..=65535")?,
            ),
            block_dim: (ATTENTION_THREADS, 1, 1),
            shared_mem_bytes: u32::try_from((self.shared_bytes)(head_dim))
                .expect("invariant: at most 80 KiB for a valid head_dim"),
        })
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
    let bad = |param, value, allowed| KernelError::InvalidLaunch {
        kernel: "attention_bwd",
        param,
        value,
        allowed,
    };
    if !(1..=ATTENTION_BWD_MAX_HEAD_DIM).contains(&head_dim) {
        return Err(bad("head_dim", head_dim, "1..=128"));
    }
    if heads_kv == 0 || heads_q % heads_kv != 0 {
        return Err(bad("heads_kv", heads_kv, "a divisor of heads_q"));
    }
    let grid = |param, value: usize, max: usize, allowed| match u32::try_from(value) {
        Ok(v) if value > 0 && value <= max => Ok(v),
        _ => Err(bad(param, value, allowed)),
    };
    let key_tiles = seq_k.div_ceil(ATTENTION_BWD_BLOCK_K);
    Ok(LaunchConfig {
        grid_dim: (
            grid("seq_k", key_tiles, i32::MAX as usize, "1..=2^31 key tiles")?,
            grid("heads_kv", heads_kv, 65_535, "1..=65535")?,
            grid("batch", batch, 65_535, "1..=65535")?,
        ),
        block_dim: (ATTENTION_BWD_THREADS, 1, 1),
        shared_mem_bytes: u32::try_from(attention_bwd_shared_bytes(head_dim))
            .expect("invariant: at most 42 KiB for a valid head_dim"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let (entry, c) = attention_kernel(KernelDType::Bf16, 9, true, [2, 65, 32, 8, 128], aligned)
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
            attention_kernel(dt, sm, tc, [1, 100, 32, 8, d], qkv)
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
        assert!(attention_kernel(bf16, 9, true, [1, 1, 32, 8, 300], aligned).is_err());
        assert_eq!(opt_in_shared_bytes("attention_tc_bf16"), Some(80 * 1024));
        assert_eq!(opt_in_shared_bytes("attention_bf16"), None);
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
        for ([b, s, hq, hkv, d], want) in bad {
            match attention_bwd_launch(b, s, hq, hkv, d) {
                Err(KernelError::InvalidLaunch { kernel, param, .. }) => {
                    assert_eq!(
                        (kernel, param),
                        ("attention_bwd", want),
                        "{b} {s} {hq} {hkv} {d}"
                    )
                }
                other => panic!("{b} {s} {hq} {hkv} {d}: want an InvalidLaunch, got {other:?}"),
            }
        }
        let p = attention_bwd_prep_launch(9);
        assert_eq!((p.grid_dim, p.block_dim), ((3, 1, 1), (128, 1, 1)));
        assert_eq!(
            attention_bwd_prep_launch(1 << 40).grid_dim.0,
            MAX_GRID_STRIDE_BLOCKS
        );
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
}
