//! Every hand-written kernel source, embedded with `include_str!`, and its entry points.
//!
//! Post-condition: [`KernelSource::source`] is self-contained (the shared `common.cuh` pasted in
//! place of its `#include`), so NVRTC needs no include path. The entry lists are checked
//! against the sources by a unit test, and against the compiled PTX by `tests/ptx.rs`.

use crate::{compile, CompiledPtx, KernelError};

/// The shared header every `.cu` source includes: bf16 bit casts, typed load/store, grid-stride
/// helpers, the scalar activation functions and warp/block reductions.
pub const COMMON_CUH: &str = include_str!("cu/common.cuh");

/// The tensor-core header (after `common.cuh`): `mma.sync` m16n8k16 bf16, `ldmatrix` and
/// `cp.async` wrappers around inline PTX, with their fragment layouts.
pub const MMA_CUH: &str = include_str!("cu/mma.cuh");

/// The scalar attention core (after `common.cuh`) that `attention.cu` and `attention_decode.cu`
/// share: the 16-row block over 32-key tiles with online softmax.
pub const ATTENTION_CUH: &str = include_str!("cu/attention.cuh");

/// The include line of [`COMMON_CUH`].
const COMMON_INCLUDE: &str = "#include \"common.cuh\"";

/// Each include line [`expand_includes`] replaces, with the header's text.
const HEADERS: &[(&str, &str)] = &[
    (COMMON_INCLUDE, COMMON_CUH),
    ("#include \"mma.cuh\"", MMA_CUH),
    ("#include \"attention.cuh\"", ATTENTION_CUH),
];

/// One `.cu` file: an op family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelSource {
    /// Family name, e.g. `norm`.
    pub name: &'static str,
    /// File name under `kernels/src/cu/`, used as the NVRTC program name (e.g. `norm.cu`).
    pub file: &'static str,
    /// Every `extern "C" __global__` entry point the file defines.
    pub entries: &'static [&'static str],
    raw: &'static str,
}

impl KernelSource {
    /// The file as written (with its `#include "common.cuh"` line).
    pub fn raw(&self) -> &'static str {
        self.raw
    }

    /// The self-contained source handed to NVRTC.
    pub fn source(&self) -> String {
        expand_includes(self.raw)
    }

    /// Whether this file defines `entry`.
    pub fn has_entry(&self, entry: &str) -> bool {
        self.entries.contains(&entry)
    }

    /// Compiles the family for `arch` (e.g. `sm_90`) through the on-disk cache
    /// (see [`compile`](crate::compile)).
    pub fn compile(&self, arch: &'static str) -> Result<CompiledPtx, KernelError> {
        compile(self.file, &self.source(), arch, &[])
    }
}

/// Replaces each `#include "common.cuh"` / `"mma.cuh"` / `"attention.cuh"` line with the
/// header's text. Other lines are kept.
pub fn expand_includes(raw: &str) -> String {
    let mut out = String::with_capacity(raw.len() + COMMON_CUH.len());
    for line in raw.lines() {
        match HEADERS.iter().find(|(include, _)| line.trim() == *include) {
            Some((_, header)) => {
                out.push_str(header);
                if !header.ends_with('\n') {
                    out.push('\n');
                }
            }
            None => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    out
}

macro_rules! kernel_source {
    ($name:literal, [$($entry:literal),* $(,)?]) => {
        KernelSource {
            name: $name,
            file: concat!($name, ".cu"),
            entries: &[$($entry),*],
            raw: include_str!(concat!("cu/", $name, ".cu")),
        }
    };
}

/// Every kernel family, in a fixed order.
pub static KERNELS: &[KernelSource] = &[
    kernel_source!("embedding", ["embedding_f32", "embedding_bf16"]),
    kernel_source!(
        "norm",
        [
            "rmsnorm_f32",
            "rmsnorm_bf16",
            "layernorm_f32",
            "layernorm_bf16",
            "add_rmsnorm_f32",
            "add_rmsnorm_bf16",
        ]
    ),
    kernel_source!(
        "rope",
        [
            "rope_half_f32",
            "rope_half_bf16",
            "rope_interleaved_f32",
            "rope_interleaved_bf16",
        ]
    ),
    kernel_source!("softmax", ["softmax_f32", "softmax_bf16"]),
    kernel_source!(
        "elementwise",
        [
            "gelu_tanh_f32",
            "gelu_tanh_bf16",
            "gelu_erf_f32",
            "gelu_erf_bf16",
            "silu_f32",
            "silu_bf16",
            "relu_f32",
            "relu_bf16",
            "exp_f32",
            "exp_bf16",
            "neg_f32",
            "neg_bf16",
            "scale_f32",
            "scale_bf16",
            "add_f32",
            "add_bf16",
            "mul_f32",
            "mul_bf16",
            "swiglu_f32",
            "swiglu_bf16",
        ]
    ),
    kernel_source!("cast", ["cast_f32_bf16", "cast_bf16_f32"]),
    kernel_source!(
        "attention",
        [
            "attention_f32",
            "attention_bf16",
            "attention_lse_f32",
            "attention_lse_bf16",
        ]
    ),
    kernel_source!(
        "attention_tc",
        ["attention_tc_bf16", "attention_tc_lse_bf16"]
    ),
    kernel_source!(
        "attention_decode",
        [
            "attention_decode_f32",
            "attention_decode_bf16",
            "attention_decode_combine_f32",
            "attention_decode_combine_bf16",
        ]
    ),
    kernel_source!(
        "attention_bwd",
        [
            "attention_bwd_prep_f32",
            "attention_bwd_prep_bf16",
            "attention_bwd_f32",
            "attention_bwd_bf16",
        ]
    ),
    kernel_source!("attention_bwd_tc", ["attention_bwd_tc_bf16"]),
    kernel_source!(
        "moe",
        [
            "router_f32",
            "router_bf16",
            "dispatch_f32",
            "dispatch_bf16",
            "combine_f32",
            "combine_bf16",
        ]
    ),
    kernel_source!(
        "moe_gemm",
        [
            "moe_route_index_f32",
            "moe_route_index_bf16",
            "moe_route_positions_f32",
            "moe_route_positions_bf16",
            "routed_gemm_f32",
            "routed_gemm_bf16",
            "routed_weight_grad_f32",
            "routed_weight_grad_bf16",
        ]
    ),
    kernel_source!(
        "reduce",
        [
            "reduce_add_f32",
            "reduce_add_bf16",
            "reduce_accumulate_f32",
            "reduce_accumulate_bf16",
            "reduce_average_f32",
            "reduce_average_bf16",
        ]
    ),
    kernel_source!(
        "loss",
        [
            "cross_entropy_f32",
            "cross_entropy_bf16",
            "loss_sum_f32",
            "cross_entropy_stats_f32",
            "cross_entropy_stats_bf16",
            "cross_entropy_from_stats_f32",
            "cross_entropy_from_stats_bf16",
            "cross_entropy_shard_grad_f32",
            "cross_entropy_shard_grad_bf16",
        ]
    ),
    kernel_source!(
        "norm_grad",
        [
            "norm_stats_f32",
            "norm_stats_bf16",
            "norm_grad_dx_f32",
            "norm_grad_dx_bf16",
            "norm_grad_dw_f32",
            "norm_grad_dw_bf16",
            "bias_grad_f32",
            "bias_grad_bf16",
        ]
    ),
    kernel_source!(
        "grad",
        [
            "unary_grad_gelu_tanh_f32",
            "unary_grad_gelu_tanh_bf16",
            "unary_grad_gelu_erf_f32",
            "unary_grad_gelu_erf_bf16",
            "unary_grad_silu_f32",
            "unary_grad_silu_bf16",
            "unary_grad_relu_f32",
            "unary_grad_relu_bf16",
            "unary_grad_exp_f32",
            "unary_grad_exp_bf16",
            "unary_grad_neg_f32",
            "unary_grad_neg_bf16",
            "repeat_grad_f32",
            "repeat_grad_bf16",
            "embedding_grad_f32",
            "embedding_grad_bf16",
        ]
    ),
    kernel_source!(
        "optim",
        [
            "adam_moment_f32",
            "adam_moment_bf16",
            "adamw_update_f32",
            "adamw_update_bf16",
        ]
    ),
    kernel_source!(
        "attention_grad",
        [
            "attention_probs_f32",
            "attention_probs_bf16",
            "attention_grad_ds_f32",
            "attention_grad_ds_bf16",
            "attention_grad_dq_f32",
            "attention_grad_dq_bf16",
            "attention_grad_dk_f32",
            "attention_grad_dk_bf16",
            "attention_grad_dv_f32",
            "attention_grad_dv_bf16",
        ]
    ),
    kernel_source!(
        "moe_grad",
        [
            "router_grad_f32",
            "router_grad_bf16",
            "dispatch_grad_f32",
            "dispatch_grad_bf16",
            "combine_grad_y_f32",
            "combine_grad_y_bf16",
            "combine_grad_gates_f32",
            "combine_grad_gates_bf16",
        ]
    ),
];

/// The family named `name` (`"norm"`), if registered.
pub fn kernel_source(name: &str) -> Result<&'static KernelSource, KernelError> {
    KERNELS
        .iter()
        .find(|k| k.name == name)
        .ok_or_else(|| KernelError::UnknownKernel {
            name: name.to_owned(),
        })
}

/// The family that defines entry point `entry` (`"rmsnorm_bf16"` gives `norm`).
pub fn source_for_entry(entry: &str) -> Result<&'static KernelSource, KernelError> {
    KERNELS
        .iter()
        .find(|k| k.has_entry(entry))
        .ok_or_else(|| KernelError::UnknownKernel {
            name: entry.to_owned(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// The first argument of every `SHARDC_[A-Z0-9_]+(` macro invocation: the entry point a
    /// wrapper macro defines (`SHARDC_UNARY_GRAD(unary_grad_silu_f32, float, dop_silu)`). The
    /// macro definitions themselves, whose first parameter is `NAME`, are skipped, as are
    /// object-like names (`SHARDC_INF`) and longer identifiers that merely contain `SHARDC_`.
    fn macro_entries<'a>(src: &'a str, out: &mut BTreeSet<&'a str>) {
        let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
        for (i, prefix) in src.match_indices("SHARDC_") {
            if src[..i].ends_with(ident) {
                continue;
            }
            let tail = &src[i + prefix.len()..];
            let end = tail
                .find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
                .unwrap_or(tail.len());
            let Some(args) = tail[end..].strip_prefix('(').filter(|_| end > 0) else {
                continue;
            };
            let args = args.trim_start();
            let name = &args[..args.find(|c: char| !ident(c)).unwrap_or(args.len())];
            if name != "NAME" {
                out.insert(name);
            }
        }
    }

    /// The entry points a source defines, found textually: `extern "C" __global__ void NAME(`
    /// (possibly with `__launch_bounds__(..)` and a line break) and the first argument of
    /// `SHARDC_XXX(NAME, ...)` macro invocations ([`macro_entries`]).
    fn defined_entries(src: &str) -> BTreeSet<&str> {
        let mut found = BTreeSet::new();
        for (i, _) in src.match_indices("extern \"C\" __global__") {
            let decl = &src[i..];
            let paren = decl
                .find('(')
                .expect("invariant: a declaration has a parameter list");
            let head = &decl[..paren];
            let head = if head.contains("__launch_bounds__") {
                // skip `__launch_bounds__(N)` and take the identifier before the next '('
                let after = &decl[decl.find(')').expect("invariant: closed") + 1..];
                &after[..after.find('(').expect("invariant: parameter list")]
            } else {
                head
            };
            let name = head.split_whitespace().last().expect("invariant: a name");
            if name != "NAME" {
                found.insert(name);
            }
        }
        macro_entries(src, &mut found);
        found
    }

    #[test]
    fn entries_match_sources() {
        for k in KERNELS {
            let listed: BTreeSet<&str> = k.entries.iter().copied().collect();
            assert_eq!(listed.len(), k.entries.len(), "{}: duplicate entry", k.name);
            assert_eq!(
                defined_entries(k.raw),
                listed,
                "{}: registry out of sync",
                k.file
            );
        }
    }

    #[test]
    fn defined_entries_reads_wrapper_macros() {
        let src = "#define SHARDC_OP(NAME, T) \\\n\
                   extern \"C\" __global__ void __launch_bounds__(128) \\\n\
                   NAME(const T* x) { f(x, -SHARDC_INF); }\n\
                   SHARDC_OP(op_f32, float)\n\
                   SHARDC_OP( op_bf16, bf16)\n\
                   MY_SHARDC_OP(not_an_entry, float)\n\
                   extern \"C\" __global__ void plain_f32(float* x) {}\n";
        assert_eq!(
            defined_entries(src),
            BTreeSet::from(["op_f32", "op_bf16", "plain_f32"])
        );
    }

    #[test]
    fn entries_are_unique_across_families() {
        let mut seen = BTreeSet::new();
        for k in KERNELS {
            for e in k.entries {
                assert!(seen.insert(*e), "{e} defined twice");
            }
        }
    }

    #[test]
    fn dtype_entries_come_in_pairs() {
        // Every `_f32` op has a `_bf16` twin, except the listed f32-only ones.
        let f32_only = ["loss_sum_f32", "cast_f32_bf16", "cast_bf16_f32"];
        for k in KERNELS {
            for e in k.entries.iter().filter(|e| !f32_only.contains(e)) {
                if let Some(op) = e.strip_suffix("_f32") {
                    assert!(k.has_entry(&format!("{op}_bf16")), "{e} has no bf16 twin");
                }
            }
        }
    }

    fn has_include(src: &str) -> bool {
        src.lines().any(|l| l.trim_start().starts_with("#include"))
    }

    #[test]
    fn expanded_sources_need_no_include_path() {
        for k in KERNELS {
            let src = k.source();
            assert!(
                !has_include(&src),
                "{}: include left after expansion",
                k.file
            );
            assert!(src.contains("bf16_to_f32"), "{}: header not pasted", k.file);
            assert!(
                k.raw().contains(COMMON_INCLUDE),
                "{} must include common.cuh",
                k.file
            );
        }
        assert!(!has_include(COMMON_CUH));
        assert!(!has_include(MMA_CUH));
        assert!(!has_include(ATTENTION_CUH));
        let with_mma = expand_includes("#include \"common.cuh\"\n#include \"mma.cuh\"\n");
        assert!(with_mma.contains("mma_bf16_16816"), "mma.cuh not pasted");
        assert!(!has_include(&with_mma));
    }

    #[test]
    fn lookup_by_name_and_entry() {
        assert_eq!(kernel_source("norm").map(|k| k.file).ok(), Some("norm.cu"));
        assert_eq!(
            source_for_entry("rmsnorm_bf16").map(|k| k.name).ok(),
            Some("norm")
        );
        assert!(matches!(
            source_for_entry("nope_f32"),
            Err(KernelError::UnknownKernel { .. })
        ));
    }
}
