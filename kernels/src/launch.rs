//! Launch configurations that satisfy each kernel family's contract (block sizes, grid shape,
//! dynamic shared memory), so the runtime does not re-derive them.

use crate::{KernelDType, KernelError};
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
    let bad = |param, value, allowed| KernelError::InvalidLaunch {
        kernel: "attention",
        param,
        value,
        allowed,
    };
    if head_dim == 0 || head_dim > ATTENTION_MAX_HEAD_DIM {
        return Err(bad("head_dim", head_dim, "1..=256"));
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
    let tiles = seq_q.div_ceil(ATTENTION_BLOCK_Q);
    Ok(LaunchConfig {
        grid_dim: (
            dim("seq_q", tiles, i32::MAX as usize, "1..=2^31 query tiles")?,
            dim("heads_q", heads_q, 65_535, "1..=65535")?,
            dim("batch", batch, 65_535, "1..=65535")?,
        ),
        block_dim: (ATTENTION_THREADS, 1, 1),
        shared_mem_bytes: u32::try_from(attention_shared_bytes(head_dim))
            .expect("invariant: at most 48 KiB"),
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
