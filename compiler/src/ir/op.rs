//! The op set and each op's type rule. The CPU reference kernel of each op (in `shardc-runtime`)
//! is its one definition of semantics; the comments here state it in words.

use super::{
    AdamWSpec, AttnWrt, CombineWrt, DType, Dim, EwExpr, Float, IrError, NormWrt, Role, TensorType,
};
use serde::{Deserialize, Serialize};

/// A mesh axis named by a collective (`tp`, `dp`, ...).
pub type AxisName = String;

/// Values per row and vocabulary shard of [`Op::CrossEntropyStats`]: the row's max, its sum
/// of exponentials shifted by that max, and the label's logit.
pub const CROSS_ENTROPY_STATS: usize = 3;

/// Elementwise unary functions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UnaryOp {
    /// GeLU, tanh approximation (`gelu_new`, `gelu_pytorch_tanh`).
    GeluTanh,
    /// GeLU, exact (erf).
    GeluErf,
    /// x·sigmoid(x).
    Silu,
    /// max(x, 0).
    Relu,
    /// eˣ.
    Exp,
    /// −x.
    Neg,
}

text_names!(UnaryOp {
    GeluTanh => "gelu_tanh", GeluErf => "gelu_erf", Silu => "silu", Relu => "relu", Exp => "exp",
    Neg => "neg",
});

/// How rotary embedding pairs the elements of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RopeStyle {
    /// HF / GPT-NeoX `rotate_half`: element i pairs with i + d/2.
    Half,
    /// GPT-J / Meta original: element 2i pairs with 2i+1.
    Interleaved,
}

/// Rotary-frequency scaling (HF `rope_scaling` / `rope_parameters`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum RopeScaling {
    /// Llama 3.1 "llama3": wavelength-dependent interpolation.
    Llama3 {
        /// `factor`.
        factor: Float,
        /// `low_freq_factor`.
        low_freq_factor: Float,
        /// `high_freq_factor`.
        high_freq_factor: Float,
        /// `original_max_position_embeddings`.
        original_max_positions: usize,
    },
    /// "linear": positions divided by `factor`.
    Linear {
        /// `factor`.
        factor: Float,
    },
}

/// Rotary position embedding parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RopeSpec {
    /// Base θ.
    pub theta: Float,
    /// Pairing convention.
    pub style: RopeStyle,
    /// Frequency scaling, if any.
    pub scaling: Option<RopeScaling>,
}

impl RopeSpec {
    /// Inverse frequencies for a head of width `head_dim` (length `head_dim / 2`), HF semantics.
    pub fn inv_freq(&self, head_dim: usize) -> Vec<f32> {
        let half = head_dim / 2;
        let mut inv: Vec<f64> = (0..half)
            .map(|i| 1.0 / (self.theta.0 as f64).powf((2 * i) as f64 / head_dim as f64))
            .collect();
        // HF computes inv_freq in float32: round once to match it.
        for f in &mut inv {
            *f = *f as f32 as f64;
        }
        match self.scaling {
            None => {}
            Some(RopeScaling::Linear { factor }) => {
                for f in &mut inv {
                    *f /= factor.0 as f64;
                }
            }
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_positions,
            }) => {
                let (factor, lo, hi) = (
                    factor.0 as f64,
                    low_freq_factor.0 as f64,
                    high_freq_factor.0 as f64,
                );
                let old = original_max_positions as f64;
                let low_wavelen = old / lo;
                let high_wavelen = old / hi;
                for f in &mut inv {
                    let wavelen = 2.0 * std::f64::consts::PI / *f;
                    if wavelen > low_wavelen {
                        *f /= factor;
                    } else if wavelen >= high_wavelen {
                        let smooth = (old / wavelen - lo) / (hi - lo);
                        *f = (1.0 - smooth) * *f / factor + smooth * *f;
                    }
                }
            }
        }
        inv.into_iter().map(|f| f as f32).collect()
    }
}

/// A collective matmul ([`Op::AgMatMul`] when `gather`, else [`Op::MatMulRs`]) as the ring
/// that runs it: the mesh axis, the ring dim, the axis size and whether `w` is transposed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingMatMul<'a> {
    /// `AgMatMul`: the input is gathered (else the product is reduce-scattered).
    pub gather: bool,
    /// The mesh axis.
    pub axis: &'a str,
    /// The ring dim.
    pub dim: usize,
    /// The axis size.
    pub parts: usize,
    /// The weight is stored transposed.
    pub transpose_b: bool,
}

impl RingMatMul<'_> {
    /// The collective the ring decomposes: the input's all-gather (`gather`) or the product's
    /// reduce-scatter, over the ring's axis, dim and parts.
    pub fn collective(&self) -> Op {
        let (axis, dim, parts) = (self.axis.to_string(), self.dim, self.parts);
        if self.gather {
            Op::AllGather { axis, dim, parts }
        } else {
            Op::ReduceScatter { axis, dim, parts }
        }
    }
}

/// Attention parameters. Heads and head width come from the operand shapes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct AttnSpec {
    /// Query t sees keys s ≤ t only.
    pub causal: bool,
    /// Sliding window: query t sees keys s with t − s < window.
    pub window: Option<usize>,
    /// Score scale (usually 1/√head_dim).
    pub scale: Float,
    /// The last two operands are `qidx` i32[T] and `kidx` i32[S], the sequence index of each
    /// query and key (context parallelism: a rank's queries are a chunk of the sequence,
    /// possibly permuted): the causal and window masks compare them instead of the default
    /// positions (query `t` at `t + S − T`, key `s` at `s`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub indexed: bool,
}

impl AttnSpec {
    /// The optional operands after `q, k, v` (attention) or `q, k` (its probabilities): the key
    /// mask, and with [`AttnSpec::indexed`] the query and key indices (the last two).
    pub fn extra<T: Copy>(&self, rest: &[T]) -> (Option<T>, Option<(T, T)>) {
        if self.indexed && rest.len() >= 2 {
            let n = rest.len() - 2;
            (rest[..n].first().copied(), Some((rest[n], rest[n + 1])))
        } else {
            (rest.first().copied(), None)
        }
    }
}

/// The order of a sequence axis (context parallelism's causal load balancing).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum SeqOrder {
    /// Natural order.
    Contiguous,
    /// Megatron's / Llama 3's head-tail ("zigzag") order: the sequence cut into `2·parts`
    /// chunks laid out `0, 2p−1, 1, 2p−2, ..`, so contiguous part `i` of the permuted
    /// sequence holds chunks `i` and `2p−1−i` and every part does the same causal work.
    HeadTail {
        /// Ranks the sequence is split over.
        parts: usize,
    },
}

impl SeqOrder {
    /// Whether a sequence of `len` tokens can be laid out so.
    pub fn divides(self, len: usize) -> bool {
        match self {
            SeqOrder::Contiguous => true,
            SeqOrder::HeadTail { parts } => parts > 0 && len % (2 * parts) == 0,
        }
    }

    /// The original index of position `j` of a `len`-token sequence in this order.
    pub fn original(self, len: usize, j: usize) -> usize {
        match self {
            SeqOrder::Contiguous => j,
            SeqOrder::HeadTail { parts } => {
                let c = len / (2 * parts);
                let (k, off) = (j / c, j % c);
                let chunk = if k % 2 == 0 {
                    k / 2
                } else {
                    2 * parts - 1 - k / 2
                };
                chunk * c + off
            }
        }
    }

    /// The position of original index `t` in this order.
    pub fn position_of(self, len: usize, t: usize) -> usize {
        match self {
            SeqOrder::Contiguous => t,
            SeqOrder::HeadTail { parts } => {
                let c = len / (2 * parts);
                let (chunk, off) = (t / c, t % c);
                let k = if chunk < parts {
                    2 * chunk
                } else {
                    2 * (2 * parts - 1 - chunk) + 1
                };
                k * c + off
            }
        }
    }

    /// Text name: `contiguous` or `headtail` (torchtitan's name).
    pub fn name(self) -> &'static str {
        match self {
            SeqOrder::Contiguous => "contiguous",
            SeqOrder::HeadTail { .. } => "headtail",
        }
    }
}

/// A sub-block of a stored tensor: `len` elements from `start` along `dim`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ParamView {
    /// Dim of the stored tensor.
    pub dim: usize,
    /// First index.
    pub start: usize,
    /// Number of indices.
    pub len: usize,
}

/// One split of a tensor over a mesh axis: this rank holds chunk `coord(axis)` of `parts`
/// along `dim`. A list of them applies major to minor.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ShardSpec {
    /// Tensor dim.
    pub dim: usize,
    /// Mesh axis.
    pub axis: AxisName,
    /// Axis size.
    pub parts: usize,
}

/// Where a parameter's data lives in the checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ParamSource {
    /// Stored tensor name. With `stack`, a template where `{}` stands for the stack index.
    pub name: String,
    /// Only this sub-block of the stored tensor (fused QKV, fused gate/up). With `stack`, the
    /// view's dim is a dim of each stored tensor (before stacking).
    pub view: Option<ParamView>,
    /// Stack this many stored tensors along a new dim 0 (MoE experts stored one per tensor).
    pub stack: Option<usize>,
    /// Stored layout is the transpose of the graph's layout: the last two dims of each stored
    /// tensor are swapped (after `view`, before stacking).
    pub transposed: bool,
    /// After sharding: the chunk of the (global, graph-layout) tensor this rank holds.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shards: Vec<ShardSpec>,
}

impl ParamSource {
    /// A whole stored tensor.
    pub fn whole(name: impl Into<String>) -> ParamSource {
        ParamSource {
            name: name.into(),
            view: None,
            stack: None,
            transposed: false,
            shards: Vec::new(),
        }
    }
    /// The stored name of stack entry `i` (the name itself when not stacked).
    pub fn stored_name(&self, i: usize) -> String {
        if self.stack.is_some() {
            self.name.replace("{}", &i.to_string())
        } else {
            self.name.clone()
        }
    }
}

/// A pattern matching the training ops that need no rank context: the gradients and the
/// optimizer's steps (`CrossEntropyShardGrad`, which reads its vocabulary shard's coordinate,
/// aside). One list for every exhaustive match that treats them apart: the type rules, the
/// sharding rules and the CPU kernels.
#[macro_export]
macro_rules! training_ops {
    () => {
        $crate::ir::Op::UnaryGrad(_)
            | $crate::ir::Op::BiasGrad
            | $crate::ir::Op::WeightGrad { .. }
            | $crate::ir::Op::RmsNormGrad { .. }
            | $crate::ir::Op::LayerNormGrad { .. }
            | $crate::ir::Op::RopeGrad(_)
            | $crate::ir::Op::AttentionProbs(_)
            | $crate::ir::Op::AttentionGrad { .. }
            | $crate::ir::Op::EmbeddingGrad
            | $crate::ir::Op::RouterGrad { .. }
            | $crate::ir::Op::DispatchGrad
            | $crate::ir::Op::CombineGrad { .. }
            | $crate::ir::Op::CrossEntropyGrad { .. }
            | $crate::ir::Op::RepeatGrad { .. }
            | $crate::ir::Op::AdamMoment { .. }
            | $crate::ir::Op::AdamWUpdate(_)
    };
}

/// The ops of the IR. Every op produces one value.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Op {
    /// A graph input, fed by the caller (`input_ids`, `position_ids`, `attention_mask`).
    Input {
        /// Input name.
        name: String,
        /// After sharding: the chunk of the caller's (global) tensor this rank holds.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        shards: Vec<ShardSpec>,
    },
    /// A parameter, loaded from the checkpoint.
    Param(ParamSource),
    /// `(table[V,H], ids[..]) -> [.., H]`: row lookup. Ids outside `[0, V)` give zero rows
    /// (so a vocabulary shard contributes only its own rows).
    Embedding,
    /// `(a[.., M, K], b) -> [.., M, N]` with `b` `[K, N]` (or `[N, K]` when `transpose_b`),
    /// or batched: `b` `[E, K, N]` with `a` `[E, .., M, K]`.
    MatMul {
        /// `b` is stored `[.., N, K]` (a PyTorch `nn.Linear` weight).
        transpose_b: bool,
    },
    /// `a + b`, `b`'s shape a suffix of `a`'s (bias broadcast) or equal.
    Add,
    /// `a · b`, broadcast as `Add`.
    Mul,
    /// `f(x)` elementwise.
    Unary(UnaryOp),
    /// `x · c`.
    Scale(Float),
    /// Change of dtype. Float → bf16/f16 rounds to nearest even; float → i32 truncates toward
    /// zero and saturates (NaN → 0).
    Cast(DType),
    /// `(x[.., H], w[H]) -> x / rms(x) · w`, over the last dim, in f32.
    RmsNorm {
        /// ε added to the mean square.
        eps: Float,
    },
    /// `(x[.., H], w[H], b[H])`: (x − mean) / √(var + ε) · w + b over the last dim.
    LayerNorm {
        /// ε added to the variance.
        eps: Float,
    },
    /// `(x[B, T, N, D], pos[B, T] i32) -> [B, T, N, D]`: rotary embedding of each head.
    Rope(RopeSpec),
    /// `(q[B,T,Hq,D], k[B,S,Hkv,D], v[B,S,Hkv,D] [, mask[B,S]] [, qidx[T], kidx[S]]) ->
    /// [B,T,Hq,D]`: softmax(q·kᵀ·scale + masks)·v per head; query head h reads KV head
    /// h / (Hq/Hkv). Query t sits at position t + S − T (the last query aligns with the last
    /// key), or at `qidx[t]` against keys at `kidx[s]` when the spec is
    /// [`AttnSpec::indexed`]. `mask` (f32; nonzero keeps, 0 drops) masks keys. The window
    /// applies with or without `causal` (without it, later keys stay visible). A query with
    /// no visible key gives zeros.
    Attention(AttnSpec),
    /// `(q[B,T,Hq,D], k[B,S/parts,Hkv,D], v [, mask[B,S]] [, qidx[T], kidx[S]]) -> [B,T,Hq,D]`:
    /// `Attention(spec)` of `q` against the keys and values of every rank of `axis` (`k` and
    /// `v` are this rank's blocks, rank `i` holding keys `[i·S/parts, (i+1)·S/parts)`),
    /// without gathering them: the blocks travel round the ring of `axis` by send/recv, each
    /// step's block attention running while the next block is in flight, and the partial
    /// results merged by their log-sum-exp (Ring Attention). Equals `Attention(spec)(q,
    /// all_gather(k), all_gather(v), ..)` up to the order of the softmax sums.
    RingAttention {
        /// The attention's parameters.
        spec: AttnSpec,
        /// Mesh axis of the ring.
        axis: AxisName,
        /// Axis size.
        parts: usize,
    },
    /// `(q[B,T,Hq,D], k[B,c,Hkv,D], v, o[B,T,Hq,D], dy[B,T,Hq,D] [, mask[B,S]] [, qidx[T],
    /// kidx[S]]) -> f32[|q| + |k| + |v|]`: the gradients of `RingAttention { spec, axis, parts }`
    /// (output `o`, upstream gradient `dy`) wrt `q`, this rank's `k` block and its `v` block,
    /// packed in that order (each row-major in its operand's shape), computed without
    /// gathering the keys: a first pass round the ring takes each query's softmax statistics
    /// from every K block, a second passes the K/V blocks again with their dK/dV accumulators,
    /// which each rank adds its queries' contributions to and which arrive back at the
    /// block's owner after the last hop (the backward of Ring Attention, FlashAttention-style:
    /// no probabilities beyond one block's are held). Equals the `AttentionGrad`s of the
    /// gathered attention, dK/dV reduce-scattered back to the blocks, up to summation order.
    RingAttentionGrad {
        /// The forward attention's parameters.
        spec: AttnSpec,
        /// Mesh axis of the ring.
        axis: AxisName,
        /// Axis size.
        parts: usize,
    },
    /// `-> i32[len]`: the original index of each position of a sequence laid out in `order`
    /// (the query and key indices of context-parallel attention).
    SeqIndex {
        /// Sequence length.
        len: usize,
        /// The layout.
        order: SeqOrder,
    },
    /// `x -> x` with dim `dim` reordered from natural order into `order` (`inverse`: back).
    SeqPermute {
        /// The sequence dim.
        dim: usize,
        /// The order.
        order: SeqOrder,
        /// Back to natural order.
        inverse: bool,
    },
    /// Softmax over the last dim.
    Softmax,
    /// Same elements, new shape (the node's declared type).
    Reshape,
    /// Permutes dims: output dim i is input dim `perm[i]`.
    Transpose {
        /// The permutation.
        perm: Vec<usize>,
    },
    /// `len` indices from `start` along `dim`.
    Slice {
        /// Dim.
        dim: usize,
        /// First index.
        start: usize,
        /// Count.
        len: usize,
    },
    /// Concatenation along `dim`.
    Concat {
        /// Dim.
        dim: usize,
    },
    /// Each index along `dim` repeated `times` times in place (`repeat_interleave`).
    Repeat {
        /// Dim.
        dim: usize,
        /// Repeat count.
        times: usize,
    },
    /// `(logits[.., E]) -> gates[.., E]`: softmax over experts, keep the `top_k` largest (ties to
    /// the lower index), others 0; with `normalize`, the kept ones rescaled to sum 1 (summed
    /// in descending order, as torch sums `topk`'s output).
    Router {
        /// Experts per token.
        top_k: usize,
        /// Renormalise the kept gates.
        normalize: bool,
    },
    /// `(x[B,T,H], gates[B,T,E]) -> [E,B,T,H]`: row (b,t) copied into expert e's slot where
    /// `gates[b,t,e] != 0`, zeros elsewhere.
    Dispatch,
    /// `(y[E,B,T,H], gates[B,T,E]) -> [B,T,H]`: Σₑ gates[b,t,e] · y[e,b,t] over the experts with
    /// a nonzero gate, in expert order (as HF's `index_add_`), so unrouted slots never leak in.
    Combine,
    /// `(logits[B,T,V], labels[B,T] i32) -> f32[]`: Σ over positions with label ≥ 0 of
    /// −log softmax(logits)[label], divided by `denom`. Negative labels (−100) are ignored; a
    /// label ≥ V is an error.
    CrossEntropy {
        /// Normaliser (number of predicted tokens in the whole batch).
        denom: usize,
    },
    /// `(logits[.., Vl], labels[..] i32) -> f32[.., 3]`: this rank's part of a cross-entropy
    /// whose logits are split over the vocabulary on `axis` (the rank holds columns
    /// `coord(axis)·Vl ..` of the `parts·Vl`). Per row, [`CROSS_ENTROPY_STATS`] values: the
    /// row's max `m`, `Σ exp(x − m)` (in f64, rounded once), and the label's logit when the
    /// label falls in this shard (0 otherwise, and for negative labels). A label ≥ `parts·Vl`
    /// is an error. Made by the partitioner (Megatron's vocabulary-parallel cross-entropy).
    CrossEntropyStats {
        /// Mesh axis the vocabulary is split over.
        axis: AxisName,
        /// Axis size.
        parts: usize,
    },
    /// `(stats[.., 3·P], labels[..] i32) -> f32[]`: `CrossEntropy { denom }` from the
    /// `CrossEntropyStats` of the `P` vocabulary shards, gathered in rank order. Per row with
    /// label ≥ 0: with `M = maxᵢ mᵢ`, `M + ln Σᵢ sᵢ·exp(mᵢ − M) − Σᵢ tᵢ`; the sum over rows
    /// divided by `denom`, in f64, rounded once.
    CrossEntropyFromStats {
        /// Normaliser (number of predicted tokens in the whole batch).
        denom: usize,
    },
    /// Sum over the ranks of `axis` (every rank gets the sum).
    AllReduce {
        /// Mesh axis.
        axis: AxisName,
    },
    /// Sum over the ranks of `axis`, each keeping its `1/parts` chunk of `dim`.
    ReduceScatter {
        /// Mesh axis.
        axis: AxisName,
        /// Scattered dim.
        dim: usize,
        /// Axis size.
        parts: usize,
    },
    /// Concatenation of every rank's value along `dim`, in rank order.
    AllGather {
        /// Mesh axis.
        axis: AxisName,
        /// Gathered dim.
        dim: usize,
        /// Axis size.
        parts: usize,
    },
    /// Chunk j of `split_dim` goes to rank j; received chunks concatenated along `concat_dim`.
    AllToAll {
        /// Mesh axis.
        axis: AxisName,
        /// Dim split into `parts` chunks and sent.
        split_dim: usize,
        /// Dim the received chunks are concatenated along.
        concat_dim: usize,
        /// Axis size.
        parts: usize,
    },
    /// The value of rank `root` of `axis` on every rank.
    Broadcast {
        /// Mesh axis.
        axis: AxisName,
        /// Root coordinate on the axis.
        root: usize,
    },
    /// `ids − coord(axis) · stride` on i32 values: token ids made local to a vocabulary shard.
    RankOffset {
        /// Mesh axis.
        axis: AxisName,
        /// Rows per shard.
        stride: usize,
    },
    /// This rank's `1/parts` chunk of `dim` (replicated → sharded; no communication).
    LocalSlice {
        /// Mesh axis.
        axis: AxisName,
        /// Sliced dim.
        dim: usize,
        /// Axis size.
        parts: usize,
    },
    /// `(x₀, x₁, ..) -> expr(x₀, x₁, ..)`: an elementwise program run as one kernel, each
    /// step with the semantics of its unfused op (see [`EwExpr`]). Made by the rewriter.
    FusedElementwise {
        /// The program.
        expr: EwExpr,
    },
    /// `(a, b, x₁, ..) -> epilogue(a·b, x₁, ..)`: a GEMM (as `MatMul`) whose result is
    /// operand 0 of an elementwise epilogue (bias, activation, gating). Made by the rewriter.
    FusedMatMul {
        /// `b` is stored transposed, as in `MatMul`.
        transpose_b: bool,
        /// The epilogue; its operand 0 is the GEMM result, operands 1.. are `x₁, ..`.
        epilogue: EwExpr,
    },
    /// `(a, b, w) -> rms_norm(a + b, w)`: residual add and RMSNorm in one kernel (the sum
    /// as `Add`, the norm as `RmsNorm`). Made by the rewriter.
    AddRmsNorm {
        /// ε added to the mean square.
        eps: Float,
    },
    /// `(x, w) -> matmul(all_gather(x), w)`: the gather along row dim `dim` (not the last)
    /// decomposed into a ring of partial GEMMs with send/recv, so communication overlaps
    /// compute (collective matmul). Made by the rewriter.
    AgMatMul {
        /// Mesh axis.
        axis: AxisName,
        /// Gathered row dim of `x` (and of the result).
        dim: usize,
        /// Axis size.
        parts: usize,
        /// `w` is stored transposed, as in `MatMul`.
        transpose_b: bool,
    },
    /// `(x, w) -> reduce_scatter(matmul(x, w))`: the scatter along row dim `dim` (not the
    /// last) decomposed into a ring of partial GEMMs whose partial sums travel with
    /// send/recv. Made by the rewriter.
    MatMulRs {
        /// Mesh axis.
        axis: AxisName,
        /// Scattered row dim of the product.
        dim: usize,
        /// Axis size.
        parts: usize,
        /// `w` is stored transposed, as in `MatMul`.
        transpose_b: bool,
    },
    // Training ops (attribute types and type rules in `grad.rs`). A `…Grad` op is the
    // gradient of one operand of its forward op given `dy`, the gradient of the forward result.
    /// `(x, dy) -> dy · f'(x)`: the gradient of `Unary(f)` (f' in f64, rounded once).
    UnaryGrad(UnaryOp),
    /// `(dy[.., N], b[N]) -> [N]`: Σ of `dy` over every leading dim, the gradient of a bias
    /// added by `Add`. `b` only gives the result's shape and layout.
    BiasGrad,
    /// `(a, dy, b) -> db`: the gradient of `MatMul { transpose_b }(a, b)` wrt `b`: aᵀ·dy
    /// summed over every leading dim of `a` and `dy` (2-D `b`), or per leading index `E`
    /// (batched 3-D `b`), laid out like `b`. `b` only gives the shape and layout.
    WeightGrad {
        /// As in the forward `MatMul`.
        transpose_b: bool,
    },
    /// `(x, w, dy) -> dx` or `dw`: the gradient of `RmsNorm { eps }(x, w)`; `dw` sums over
    /// every leading dim.
    RmsNormGrad {
        /// As in the forward op.
        eps: Float,
        /// The differentiated operand.
        wrt: NormWrt,
    },
    /// `(x, w, dy) -> dx` or `dw`: the gradient of `LayerNorm { eps }(x, w, b)` (the bias
    /// gradient is a `BiasGrad`).
    LayerNormGrad {
        /// As in the forward op.
        eps: Float,
        /// The differentiated operand.
        wrt: NormWrt,
    },
    /// `(dy[B,T,N,D], pos[B,T]) -> dx`: the gradient of `Rope(spec)`, the rotation by the
    /// negated angle.
    RopeGrad(RopeSpec),
    /// `(q[B,T,Hq,D], k[B,S,Hkv,D] [, mask[B,S]]) -> [B,Hq,T,S]`: the probabilities
    /// `softmax(q·kᵀ·scale + masks)` of `Attention(spec)` exactly as it computes them
    /// (masked keys 0; a query with no visible key a row of zeros). Saved by the forward pass
    /// or recomputed in the backward pass.
    AttentionProbs(AttnSpec),
    /// `(q, k, v, dy, probs) -> dq | dk | dv`: the gradient of `Attention(spec)(q, k, v ..)`
    /// given its probabilities (`AttentionProbs`); `dk`, `dv` sum over the query heads that
    /// share a KV head.
    AttentionGrad {
        /// The forward attention's parameters.
        spec: AttnSpec,
        /// The differentiated operand.
        wrt: AttnWrt,
    },
    /// `(ids[..], dy[.., H], table[V, H]) -> [V, H]`: row `i` is the sum of the rows of `dy`
    /// whose id is `i` (ids outside `[0, V)` add nothing), the gradient of `Embedding` wrt its
    /// table. `table` only gives the shape and layout.
    EmbeddingGrad,
    /// `(logits[.., E], dgates[.., E]) -> [.., E]`: the gradient of `Router { top_k,
    /// normalize }` (through the softmax and the renormalisation of the kept gates; dropped
    /// experts pass nothing back).
    RouterGrad {
        /// As in the forward op.
        top_k: usize,
        /// As in the forward op.
        normalize: bool,
    },
    /// `(dxe[E,B,T,H], gates[B,T,E]) -> [B,T,H]`: Σₑ of `dxe[e,b,t]` over the experts with
    /// `gates[b,t,e] != 0`, the gradient of `Dispatch` wrt `x`.
    DispatchGrad,
    /// `(y[E,B,T,H], gates[B,T,E], dy[B,T,H])`: the gradient of `Combine(y, gates)` wrt `y`
    /// (`gates[b,t,e]·dy[b,t]` where the gate is non-zero, else 0) or wrt `gates`
    /// (`dy[b,t]·y[e,b,t]` where the gate is non-zero, else 0).
    CombineGrad {
        /// The differentiated operand.
        wrt: CombineWrt,
    },
    /// `(logits[.., V], labels[..]) -> [.., V]`: the gradient of `CrossEntropy { denom }`
    /// wrt the logits, `(softmax(logits) − onehot(label)) / denom` on rows with label ≥ 0 and
    /// zero rows elsewhere.
    CrossEntropyGrad {
        /// As in the forward op.
        denom: usize,
    },
    /// `(logits[.., Vl], labels[..], stats[.., 3·P]) -> [.., Vl]`: `CrossEntropyGrad { denom }`
    /// on this rank's vocabulary shard (columns `coord(axis)·Vl ..`): `(exp(x − lse) −
    /// onehot(label)) / denom` on rows with label ≥ 0, zero rows elsewhere, where `lse` is the
    /// row's log-sum-exp over every shard from the gathered stats (as in
    /// `CrossEntropyFromStats`). A label ≥ `P·Vl` is an error. Made by the partitioner.
    CrossEntropyShardGrad {
        /// Mesh axis the vocabulary is split over.
        axis: AxisName,
        /// As in the forward op.
        denom: usize,
    },
    /// `(dy) -> dx`: the gradient of `Repeat { dim, times }`: each run of `times` consecutive
    /// indices along `dim` summed.
    RepeatGrad {
        /// As in the forward op.
        dim: usize,
        /// As in the forward op.
        times: usize,
    },
    /// `(m, g) -> m + (1 − β)·(g − m)`, or with `squared` `β·m + (1 − β)·g·g`: an Adam moment
    /// update in f32 (PyTorch's `lerp_` and `mul_(β).addcmul_`).
    AdamMoment {
        /// Decay β.
        beta: Float,
        /// Second moment (of `g²`).
        squared: bool,
    },
    /// `(w, m, v, step[]) -> w·(1 − lr·λ) − lr/(1 − β₁ᵗ) · m / (√v / √(1 − β₂ᵗ) + ε)` with
    /// `t = step` (PyTorch's AdamW; the updated moments `m`, `v` come from `AdamMoment`).
    /// Computed in f64, rounded once.
    AdamWUpdate(AdamWSpec),
}

fn mul(op: &'static str, a: usize, b: usize) -> Result<usize, IrError> {
    a.checked_mul(b)
        .ok_or_else(|| shape_err(op, format!("size {a} × {b} overflows")))
}

/// `x` with dim `dim` `by` times larger; an error described by `bad()` when `x` has no dim
/// `dim` or `by` is 0.
fn times_dim(
    op: &'static str,
    x: &TensorType,
    dim: usize,
    by: usize,
    bad: impl FnOnce() -> String,
) -> Result<TensorType, IrError> {
    if dim >= x.rank() || by == 0 {
        return Err(shape_err(op, bad()));
    }
    let mut t = x.clone();
    t.dims[dim].size = mul(op, x.dim(dim), by)?;
    Ok(t)
}

fn shape_err(op: &'static str, detail: String) -> IrError {
    IrError::Shape { op, detail }
}

fn arity(op: &Op, inputs: &[&TensorType], n: usize, expected: &'static str) -> Result<(), IrError> {
    if inputs.len() == n {
        Ok(())
    } else {
        Err(IrError::Arity {
            op: op.mnemonic(),
            expected,
            found: inputs.len(),
        })
    }
}

fn want_dtype(op: &Op, inputs: &[&TensorType], i: usize, dt: DType) -> Result<(), IrError> {
    if inputs[i].dtype == dt {
        Ok(())
    } else {
        Err(IrError::DType {
            op: op.mnemonic(),
            operand: i,
            expected: dt,
            found: inputs[i].dtype,
        })
    }
}

impl Op {
    /// The text-form mnemonic.
    pub fn mnemonic(&self) -> &'static str {
        match self {
            Op::Input { .. } => "input",
            Op::Param(_) => "param",
            Op::Embedding => "embedding",
            Op::MatMul { .. } => "matmul",
            Op::Add => "add",
            Op::Mul => "mul",
            Op::Unary(_) => "unary",
            Op::Scale(_) => "scale",
            Op::Cast(_) => "cast",
            Op::RmsNorm { .. } => "rms_norm",
            Op::LayerNorm { .. } => "layer_norm",
            Op::Rope(_) => "rope",
            Op::Attention(_) => "attention",
            Op::SeqIndex { .. } => "seq_index",
            Op::RingAttention { .. } => "ring_attention",
            Op::RingAttentionGrad { .. } => "ring_attention_grad",
            Op::SeqPermute { .. } => "seq_permute",
            Op::Softmax => "softmax",
            Op::Reshape => "reshape",
            Op::Transpose { .. } => "transpose",
            Op::Slice { .. } => "slice",
            Op::Concat { .. } => "concat",
            Op::Repeat { .. } => "repeat",
            Op::Router { .. } => "router",
            Op::Dispatch => "dispatch",
            Op::Combine => "combine",
            Op::CrossEntropy { .. } => "cross_entropy",
            Op::CrossEntropyStats { .. } => "cross_entropy_stats",
            Op::CrossEntropyFromStats { .. } => "cross_entropy_from_stats",
            Op::AllReduce { .. } => "all_reduce",
            Op::ReduceScatter { .. } => "reduce_scatter",
            Op::AllGather { .. } => "all_gather",
            Op::AllToAll { .. } => "all_to_all",
            Op::Broadcast { .. } => "broadcast",
            Op::LocalSlice { .. } => "local_slice",
            Op::RankOffset { .. } => "rank_offset",
            Op::FusedElementwise { .. } => "fused_elementwise",
            Op::FusedMatMul { .. } => "fused_matmul",
            Op::AddRmsNorm { .. } => "add_rms_norm",
            Op::AgMatMul { .. } => "ag_matmul",
            Op::MatMulRs { .. } => "matmul_rs",
            Op::UnaryGrad(_) => "unary_grad",
            Op::BiasGrad => "bias_grad",
            Op::WeightGrad { .. } => "weight_grad",
            Op::RmsNormGrad { .. } => "rms_norm_grad",
            Op::LayerNormGrad { .. } => "layer_norm_grad",
            Op::RopeGrad(_) => "rope_grad",
            Op::AttentionProbs(_) => "attention_probs",
            Op::AttentionGrad { .. } => "attention_grad",
            Op::EmbeddingGrad => "embedding_grad",
            Op::RouterGrad { .. } => "router_grad",
            Op::DispatchGrad => "dispatch_grad",
            Op::CombineGrad { .. } => "combine_grad",
            Op::CrossEntropyGrad { .. } => "cross_entropy_grad",
            Op::CrossEntropyShardGrad { .. } => "cross_entropy_shard_grad",
            Op::RepeatGrad { .. } => "repeat_grad",
            Op::AdamMoment { .. } => "adam_moment",
            Op::AdamWUpdate(_) => "adamw_update",
        }
    }

    /// True for ops that move data between ranks.
    pub fn is_collective(&self) -> bool {
        matches!(
            self,
            Op::AllReduce { .. }
                | Op::ReduceScatter { .. }
                | Op::AllGather { .. }
                | Op::AllToAll { .. }
                | Op::Broadcast { .. }
        )
    }

    /// The mesh axis of a collective or local slice.
    pub fn axis(&self) -> Option<&str> {
        match self {
            Op::AllReduce { axis }
            | Op::ReduceScatter { axis, .. }
            | Op::AllGather { axis, .. }
            | Op::AllToAll { axis, .. }
            | Op::Broadcast { axis, .. }
            | Op::LocalSlice { axis, .. }
            | Op::RankOffset { axis, .. }
            | Op::CrossEntropyStats { axis, .. }
            | Op::CrossEntropyShardGrad { axis, .. }
            | Op::AgMatMul { axis, .. }
            | Op::MatMulRs { axis, .. }
            | Op::RingAttention { axis, .. }
            | Op::RingAttentionGrad { axis, .. } => Some(axis),
            _ => None,
        }
    }

    /// The ring of a collective matmul (`AgMatMul`, `MatMulRs`).
    pub fn ring_matmul(&self) -> Option<RingMatMul<'_>> {
        match self {
            Op::AgMatMul {
                axis,
                dim,
                parts,
                transpose_b,
            }
            | Op::MatMulRs {
                axis,
                dim,
                parts,
                transpose_b,
            } => Some(RingMatMul {
                gather: matches!(self, Op::AgMatMul { .. }),
                axis,
                dim: *dim,
                parts: *parts,
                transpose_b: *transpose_b,
            }),
            _ => None,
        }
    }

    /// True for ops that exchange data between ranks: the collectives and the fused GEMMs
    /// with communication inside (`AgMatMul`, `MatMulRs`), which are not collectives.
    pub fn communicates(&self) -> bool {
        self.is_collective()
            || matches!(
                self,
                Op::AgMatMul { .. }
                    | Op::MatMulRs { .. }
                    | Op::RingAttention { .. }
                    | Op::RingAttentionGrad { .. }
            )
    }

    /// True for ops whose type must be declared (it does not follow from the operands).
    pub fn needs_declared_type(&self) -> bool {
        matches!(self, Op::Input { .. } | Op::Param(_) | Op::Reshape)
    }

    /// The result type from operand types. `declared` is the node's own type, required by ops
    /// for which [`Op::needs_declared_type`] holds.
    pub fn infer(
        &self,
        inputs: &[&TensorType],
        declared: Option<&TensorType>,
    ) -> Result<TensorType, IrError> {
        let m = self.mnemonic();
        if let Some(r) = super::grad::infer(self, inputs) {
            return r;
        }
        match self {
            Op::Input { .. } | Op::Param(_) => {
                arity(self, inputs, 0, "0")?;
                declared
                    .cloned()
                    .ok_or_else(|| shape_err(m, "needs a declared type".into()))
            }
            Op::Reshape => {
                arity(self, inputs, 1, "1")?;
                let d = declared.ok_or_else(|| shape_err(m, "needs a declared type".into()))?;
                if d.checked_numel() != inputs[0].checked_numel() || d.dtype != inputs[0].dtype {
                    return Err(shape_err(
                        m,
                        format!("cannot reshape {} to {}", inputs[0], d),
                    ));
                }
                Ok(d.clone())
            }
            Op::Embedding => {
                arity(self, inputs, 2, "2")?;
                want_dtype(self, inputs, 1, DType::I32)?;
                let (t, ids) = (inputs[0], inputs[1]);
                if t.rank() != 2 {
                    return Err(shape_err(m, format!("table must be 2-D, got {t}")));
                }
                let mut dims = ids.dims.clone();
                dims.push(t.dims[1]);
                Ok(TensorType::new(t.dtype, dims))
            }
            Op::MatMul { transpose_b } => {
                arity(self, inputs, 2, "2")?;
                let (a, b) = (inputs[0], inputs[1]);
                if a.rank() < 2 || !(b.rank() == 2 || b.rank() == 3) {
                    return Err(shape_err(m, format!("bad ranks: {a} × {b}")));
                }
                let br = b.rank();
                let (kb, nd) = if *transpose_b {
                    (b.dims[br - 1], b.dims[br - 2])
                } else {
                    (b.dims[br - 2], b.dims[br - 1])
                };
                let ka = a.last();
                if ka != kb.size {
                    return Err(shape_err(
                        m,
                        format!("contracted dims differ: {a} × {b} (K {ka} vs {})", kb.size),
                    ));
                }
                if br == 3 && (a.rank() < 3 || a.dims[0].size != b.dims[0].size) {
                    return Err(shape_err(
                        m,
                        format!("batched operands need the same leading dim: {a} × {b}"),
                    ));
                }
                if a.dtype != b.dtype {
                    return Err(shape_err(m, format!("dtypes differ: {a} × {b}")));
                }
                let mut dims = a.dims.clone();
                *dims.last_mut().expect("invariant: rank >= 2") = nd;
                Ok(TensorType::new(a.dtype, dims))
            }
            Op::Add | Op::Mul => {
                arity(self, inputs, 2, "2")?;
                let (a, b) = (inputs[0], inputs[1]);
                let ok = b.rank() <= a.rank()
                    && a.dims[a.rank() - b.rank()..]
                        .iter()
                        .zip(&b.dims)
                        .all(|(x, y)| x.size == y.size);
                if !ok || a.dtype != b.dtype {
                    return Err(shape_err(m, format!("cannot broadcast {b} onto {a}")));
                }
                Ok(a.clone())
            }
            Op::RankOffset { .. } => {
                arity(self, inputs, 1, "1")?;
                want_dtype(self, inputs, 0, DType::I32)?;
                Ok(inputs[0].clone())
            }
            Op::Unary(_) | Op::Scale(_) | Op::Softmax => {
                arity(self, inputs, 1, "1")?;
                Ok(inputs[0].clone())
            }
            Op::Cast(dt) => {
                arity(self, inputs, 1, "1")?;
                Ok(inputs[0].with_dtype(*dt))
            }
            Op::RmsNorm { .. } | Op::LayerNorm { .. } => {
                let n = if matches!(self, Op::RmsNorm { .. }) {
                    2
                } else {
                    3
                };
                arity(self, inputs, n, if n == 2 { "2" } else { "3" })?;
                let h = inputs[0].last();
                for w in &inputs[1..] {
                    if w.rank() != 1 || w.dims[0].size != h {
                        return Err(shape_err(
                            m,
                            format!("weight {w} does not match last dim of {}", inputs[0]),
                        ));
                    }
                }
                Ok(inputs[0].clone())
            }
            Op::Rope(_) => {
                arity(self, inputs, 2, "2")?;
                want_dtype(self, inputs, 1, DType::I32)?;
                let (x, p) = (inputs[0], inputs[1]);
                if x.rank() != 4 || p.rank() != 2 || x.shape()[..2] != p.shape()[..] {
                    return Err(shape_err(
                        m,
                        format!("expects x[B,T,N,D] and pos[B,T], got {x} and {p}"),
                    ));
                }
                if x.last() % 2 != 0 {
                    return Err(shape_err(m, format!("head dim of {x} is odd")));
                }
                Ok(x.clone())
            }
            Op::Attention(spec) => {
                let idx = if spec.indexed { 2 } else { 0 };
                if inputs.len() != 3 + idx && inputs.len() != 4 + idx {
                    return Err(IrError::Arity {
                        op: m,
                        expected: if spec.indexed { "5 or 6" } else { "3 or 4" },
                        found: inputs.len(),
                    });
                }
                let (q, k, v) = (inputs[0], inputs[1], inputs[2]);
                let (mask, index) = spec.extra(&inputs[3..]);
                let qs = q.shape();
                let ks = k.shape();
                if q.rank() != 4 || k.rank() != 4 || !k.same_shape(v) {
                    return Err(shape_err(
                        m,
                        format!("expects q,k,v of rank 4: {q}, {k}, {v}"),
                    ));
                }
                if qs[0] != ks[0] || qs[3] != ks[3] || ks[2] == 0 || qs[2] % ks[2] != 0 {
                    return Err(shape_err(
                        m,
                        format!("q {q} and k {k}: batch/head_dim differ or heads not a multiple of kv heads"),
                    ));
                }
                if let Some(mask) = mask {
                    if mask.shape() != [ks[0], ks[1]] {
                        return Err(shape_err(m, format!("mask {mask} must be [B, S] of k {k}")));
                    }
                }
                if let Some((qi, ki)) = index {
                    for (t, n, what) in [(qi, q.dim(1), "qidx"), (ki, k.dim(1), "kidx")] {
                        if t.dtype != DType::I32 || t.shape() != [n] {
                            return Err(shape_err(
                                m,
                                format!("{what} {t} must be i32[{n}] (the sequence dim)"),
                            ));
                        }
                    }
                }
                Ok(q.clone())
            }
            Op::RingAttention { spec, parts, .. } => {
                if inputs.len() < 3 || *parts == 0 {
                    return Err(IrError::Arity {
                        op: m,
                        expected: "at least 3",
                        found: inputs.len(),
                    });
                }
                // The attention over the gathered blocks.
                let gathered = |t: &TensorType| {
                    let mut g = t.clone();
                    if let Some(d) = g.dims.get_mut(1) {
                        d.size *= *parts;
                    }
                    g
                };
                let (k, v) = (gathered(inputs[1]), gathered(inputs[2]));
                let mut all = vec![inputs[0], &k, &v];
                all.extend(&inputs[3..]);
                Op::Attention(*spec)
                    .infer(&all, None)
                    .map_err(|e| shape_err(m, e.to_string()))
            }
            Op::RingAttentionGrad { spec, axis, parts } => {
                if inputs.len() < 5 {
                    return Err(IrError::Arity {
                        op: m,
                        expected: "at least 5",
                        found: inputs.len(),
                    });
                }
                // The forward's operands (o and dy left out) give the forward's type.
                let mut fwd = vec![inputs[0], inputs[1], inputs[2]];
                fwd.extend(&inputs[5..]);
                let ring = Op::RingAttention {
                    spec: *spec,
                    axis: axis.clone(),
                    parts: *parts,
                };
                let o = ring
                    .infer(&fwd, None)
                    .map_err(|e| shape_err(m, e.to_string()))?;
                for (t, what) in [(inputs[3], "o"), (inputs[4], "dy")] {
                    if t.shape() != o.shape() {
                        return Err(shape_err(
                            m,
                            format!("{what} {t} must have the attention output's shape {o}"),
                        ));
                    }
                }
                let n = inputs[0].numel() + inputs[1].numel() + inputs[2].numel();
                Ok(TensorType::new(o.dtype, vec![Dim::new(Role::Other, n)]))
            }
            Op::SeqIndex { len, order } => {
                arity(self, inputs, 0, "0")?;
                if !order.divides(*len) {
                    return Err(shape_err(
                        m,
                        format!("{} order of {len} tokens", order.name()),
                    ));
                }
                Ok(TensorType::new(DType::I32, vec![Dim::new(Role::Seq, *len)]))
            }
            Op::SeqPermute { dim, order, .. } => {
                arity(self, inputs, 1, "1")?;
                let x = inputs[0];
                if *dim >= x.rank() || !order.divides(x.dim(*dim)) {
                    return Err(shape_err(
                        m,
                        format!("dim {dim} of {x} cannot take the {} order", order.name()),
                    ));
                }
                Ok(x.clone())
            }
            Op::Transpose { perm } => {
                arity(self, inputs, 1, "1")?;
                let x = inputs[0];
                let mut seen = vec![false; x.rank()];
                if perm.len() != x.rank()
                    || perm
                        .iter()
                        .any(|&p| p >= x.rank() || std::mem::replace(&mut seen[p], true))
                {
                    return Err(shape_err(m, format!("bad permutation {perm:?} of {x}")));
                }
                Ok(TensorType::new(
                    x.dtype,
                    perm.iter().map(|&p| x.dims[p]).collect(),
                ))
            }
            Op::Slice { dim, start, len } => {
                arity(self, inputs, 1, "1")?;
                let x = inputs[0];
                if *dim >= x.rank() || start.checked_add(*len).is_none_or(|e| e > x.dim(*dim)) {
                    return Err(shape_err(
                        m,
                        format!("slice {start}+{len} of dim {dim} out of range for {x}"),
                    ));
                }
                let mut t = x.clone();
                t.dims[*dim].size = *len;
                Ok(t)
            }
            Op::Concat { dim } => {
                if inputs.is_empty() {
                    return Err(IrError::Arity {
                        op: m,
                        expected: "at least 1",
                        found: 0,
                    });
                }
                let x = inputs[0];
                if *dim >= x.rank() {
                    return Err(shape_err(m, format!("dim {dim} out of range for {x}")));
                }
                let mut t = x.clone();
                t.dims[*dim].size = 0;
                for y in inputs {
                    let same = y.rank() == x.rank()
                        && y.dtype == x.dtype
                        && (0..x.rank()).all(|i| i == *dim || y.dim(i) == x.dim(i));
                    if !same {
                        return Err(shape_err(m, format!("cannot concat {y} with {x}")));
                    }
                    t.dims[*dim].size = t.dims[*dim]
                        .size
                        .checked_add(y.dim(*dim))
                        .ok_or_else(|| shape_err(m, "concatenated size overflows".into()))?;
                }
                Ok(t)
            }
            Op::Repeat { dim, times } => {
                arity(self, inputs, 1, "1")?;
                let x = inputs[0];
                times_dim(m, x, *dim, *times, || {
                    format!("bad repeat of dim {dim} ×{times} of {x}")
                })
            }
            Op::Router { top_k, .. } => {
                arity(self, inputs, 1, "1")?;
                if *top_k == 0 || *top_k > inputs[0].last() {
                    return Err(shape_err(
                        m,
                        format!("top_k {top_k} out of range for {}", inputs[0]),
                    ));
                }
                Ok(inputs[0].clone())
            }
            Op::Dispatch => {
                arity(self, inputs, 2, "2")?;
                let (x, g) = (inputs[0], inputs[1]);
                if x.rank() != 3 || g.rank() != 3 || x.shape()[..2] != g.shape()[..2] {
                    return Err(shape_err(
                        m,
                        format!("expects x[B,T,H], gates[B,T,E]: {x}, {g}"),
                    ));
                }
                let mut dims = vec![g.dims[2]];
                dims.extend_from_slice(&x.dims);
                Ok(TensorType::new(x.dtype, dims))
            }
            Op::Combine => {
                arity(self, inputs, 2, "2")?;
                let (y, g) = (inputs[0], inputs[1]);
                if y.rank() != 4
                    || g.rank() != 3
                    || y.shape()[1..3] != g.shape()[..2]
                    || y.dim(0) != g.dim(2)
                {
                    return Err(shape_err(
                        m,
                        format!("expects y[E,B,T,H], gates[B,T,E]: {y}, {g}"),
                    ));
                }
                Ok(TensorType::new(y.dtype, y.dims[1..].to_vec()))
            }
            Op::CrossEntropy { .. } => {
                arity(self, inputs, 2, "2")?;
                want_dtype(self, inputs, 1, DType::I32)?;
                let (l, y) = (inputs[0], inputs[1]);
                if l.rank() != y.rank() + 1 || l.shape()[..y.rank()] != y.shape()[..] {
                    return Err(shape_err(m, format!("logits {l} and labels {y} differ")));
                }
                Ok(TensorType::new(DType::F32, vec![]))
            }
            Op::CrossEntropyStats { parts, .. } => {
                arity(self, inputs, 2, "2")?;
                want_dtype(self, inputs, 1, DType::I32)?;
                let (l, y) = (inputs[0], inputs[1]);
                if l.rank() != y.rank() + 1 || l.shape()[..y.rank()] != y.shape()[..] {
                    return Err(shape_err(m, format!("logits {l} and labels {y} differ")));
                }
                if *parts == 0 {
                    return Err(shape_err(m, "the vocabulary splits into 0 parts".into()));
                }
                let mut dims = inputs[1].dims.clone();
                dims.push(Dim::new(Role::Other, CROSS_ENTROPY_STATS));
                Ok(TensorType::new(DType::F32, dims))
            }
            Op::CrossEntropyFromStats { .. } => {
                arity(self, inputs, 2, "2")?;
                want_dtype(self, inputs, 1, DType::I32)?;
                super::grad::check_stats(m, inputs[0], inputs[1])?;
                Ok(TensorType::new(DType::F32, vec![]))
            }
            Op::AllReduce { .. } | Op::Broadcast { .. } => {
                arity(self, inputs, 1, "1")?;
                Ok(inputs[0].clone())
            }
            Op::ReduceScatter { dim, parts, .. } | Op::LocalSlice { dim, parts, .. } => {
                arity(self, inputs, 1, "1")?;
                let x = inputs[0];
                x.part(*dim, *parts).ok_or_else(|| {
                    shape_err(
                        m,
                        format!("dim {dim} of {x} does not divide into {parts} parts"),
                    )
                })
            }
            Op::AllGather { dim, parts, .. } => {
                arity(self, inputs, 1, "1")?;
                let x = inputs[0];
                times_dim(m, x, *dim, *parts, || {
                    format!("bad gather of dim {dim} into {parts} parts of {x}")
                })
            }
            Op::AllToAll {
                split_dim,
                concat_dim,
                parts,
                ..
            } => {
                arity(self, inputs, 1, "1")?;
                let x = inputs[0];
                let bad = || {
                    shape_err(
                        m,
                        format!("cannot split dim {split_dim} of {x} into {parts}"),
                    )
                };
                if *concat_dim >= x.rank() {
                    return Err(bad());
                }
                let mut t = x.part(*split_dim, *parts).ok_or_else(bad)?;
                t.dims[*concat_dim].size = mul(m, t.dims[*concat_dim].size, *parts)?;
                Ok(t)
            }
            Op::FusedElementwise { expr } => expr.infer(m, inputs),
            Op::FusedMatMul {
                transpose_b,
                epilogue,
            } => {
                if inputs.len() < 2 {
                    return Err(IrError::Arity {
                        op: m,
                        expected: "at least 2",
                        found: inputs.len(),
                    });
                }
                let mm = Op::MatMul {
                    transpose_b: *transpose_b,
                }
                .infer(&inputs[..2], None)
                .map_err(|e| shape_err(m, e.to_string()))?;
                let mut ep: Vec<&TensorType> = vec![&mm];
                ep.extend_from_slice(&inputs[2..]);
                epilogue.infer(m, &ep)
            }
            Op::AddRmsNorm { eps } => {
                arity(self, inputs, 3, "3")?;
                let sum = Op::Add
                    .infer(&inputs[..2], None)
                    .map_err(|e| shape_err(m, e.to_string()))?;
                Op::RmsNorm { eps: *eps }
                    .infer(&[&sum, inputs[2]], None)
                    .map_err(|e| shape_err(m, e.to_string()))
            }
            Op::AgMatMul {
                dim, transpose_b, ..
            } => {
                arity(self, inputs, 2, "2")?;
                if *dim + 1 >= inputs[0].rank() {
                    return Err(shape_err(
                        m,
                        format!("dim {dim} of {} is not a row dim", inputs[0]),
                    ));
                }
                let ring = self.ring_matmul().expect("invariant: a collective matmul");
                let g = ring
                    .collective()
                    .infer(&inputs[..1], None)
                    .map_err(|e| shape_err(m, e.to_string()))?;
                Op::MatMul {
                    transpose_b: *transpose_b,
                }
                .infer(&[&g, inputs[1]], None)
                .map_err(|e| shape_err(m, e.to_string()))
            }
            Op::MatMulRs {
                dim, transpose_b, ..
            } => {
                arity(self, inputs, 2, "2")?;
                let p = Op::MatMul {
                    transpose_b: *transpose_b,
                }
                .infer(inputs, None)
                .map_err(|e| shape_err(m, e.to_string()))?;
                if *dim + 1 >= p.rank() {
                    return Err(shape_err(m, format!("dim {dim} of {p} is not a row dim")));
                }
                let ring = self.ring_matmul().expect("invariant: a collective matmul");
                ring.collective()
                    .infer(&[&p], None)
                    .map_err(|e| shape_err(m, e.to_string()))
            }
            // Typed by `grad::infer` above.
            crate::training_ops!() | Op::CrossEntropyShardGrad { .. } => {
                Err(IrError::Invalid(format!("{m}: untyped training op")))
            }
        }
    }
}

/// A 1-D dim helper for builders.
pub fn dims(spec: &[(Role, usize)]) -> Vec<Dim> {
    spec.iter().map(|&(r, s)| Dim::new(r, s)).collect()
}
