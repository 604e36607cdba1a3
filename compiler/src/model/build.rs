//! Builds the forward graph of a [`ModelConfig`] for a fixed batch and sequence length, with
//! the HF tensor names of each architecture as parameter sources.
//!
//! Inputs: `input_ids` i32[B,T], `position_ids` i32[B,T], `attention_mask` f32[B,T] (1 keep,
//! 0 padding). Outputs: `logits` f32[B,T,V] and `hidden` (after the final norm), or what
//! [`ForwardOutput`] asks (with `loss`, also the input `labels` i32[B,T]).

use super::config::{Arch, ModelConfig, NormKind};
use crate::ir::{
    AttnSpec, DType, Dim, Float, Graph, IrError, Op, ParamSource, ParamView, Role, SeqOrder,
    TensorType, ValueId,
};

/// Batch and sequence length of the graph to build.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BuildOptions {
    /// Sequences per batch.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Each KV head repeated this many times after projection (1: none). Tensor parallelism
    /// with more ranks than KV heads uses it, as Megatron-LM and vLLM replicate KV heads.
    pub kv_repeat: usize,
    /// Build one pipeline chunk instead of the whole model.
    pub stage: Option<StageSpec>,
    /// What the forward pass returns (a chunk with the head only).
    pub output: ForwardOutput,
    /// Context parallelism: attention reads each query's and key's sequence index (a
    /// `SeqIndex` of the order), so the queries' sequence can be split. With the head-tail
    /// order the `[B,T]` inputs are permuted into it on entry and the `[B,T,..]` outputs back
    /// to natural order on exit (a pipeline's stage activations stay permuted).
    pub cp: Option<SeqOrder>,
}

/// What a forward pass returns.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ForwardOutput {
    /// `logits` `[B,T,V]` and the final hidden states `hidden` `[B,T,H]`, every position.
    #[default]
    Logits,
    /// The last position's: `logits` `[B,1,V]` and `hidden` `[B,1,H]` (what generation
    /// reads; the head runs on one position, and a vocabulary-parallel plan gathers `1/T` of
    /// the logits).
    Last,
    /// `hidden` `[B,T,H]` only: no head.
    Hidden,
    /// `loss` (f32 scalar) only: the causal-LM cross-entropy of every position's logits
    /// against the input `labels` i32[B,T] (position `t` predicts token `t + 1`; −100
    /// ignored), averaged over `B·(T−1)` predicted tokens as transformers does. A
    /// vocabulary-parallel plan never gathers the logits (the partitioner's
    /// vocabulary-parallel cross-entropy).
    Loss,
}

text_names!(ForwardOutput {
    Logits => "logits", Last => "last", Hidden => "hidden", Loss => "loss",
});

/// One pipeline chunk of the model: a contiguous range of decoder layers, with the
/// embedding (first chunk) and the final norm and head (last chunk).
///
/// A chunk without the embedding reads its residual stream from the input
/// [`STAGE_INPUT`] (`f32[B,T,H]`); one without the head returns it as the output
/// [`STAGE_OUTPUT`]. Every chunk reads `position_ids` and `attention_mask`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageSpec {
    /// Decoder layers `[start, end)` (may be empty for an embedding- or head-only chunk).
    pub layers: std::ops::Range<usize>,
    /// The chunk starts with the embedding.
    pub embed: bool,
    /// The chunk ends with the final norm and the head.
    pub head: bool,
}

impl StageSpec {
    /// `embedding + layers 0..9`, `layers 71..79 + head`.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if self.embed {
            parts.push("embedding".to_string());
        }
        if !self.layers.is_empty() {
            parts.push(format!(
                "layers {}..{}",
                self.layers.start,
                self.layers.end - 1
            ));
        }
        if self.head {
            parts.push("head".to_string());
        }
        parts.join(" + ")
    }
}

/// The input of a pipeline chunk that does not start with the embedding.
pub const STAGE_INPUT: &str = "pipe.act_in";
/// The output of a pipeline chunk that does not end with the head.
pub const STAGE_OUTPUT: &str = "pipe.act_out";

impl BuildOptions {
    /// Batch × seq, no KV repeat.
    pub fn new(batch: usize, seq: usize) -> BuildOptions {
        BuildOptions {
            batch,
            seq,
            kv_repeat: 1,
            stage: None,
            output: ForwardOutput::Logits,
            cp: None,
        }
    }
}

struct Builder<'a> {
    g: Graph,
    cfg: &'a ModelConfig,
    b: usize,
    t: usize,
    kv_repeat: usize,
    /// Context parallelism: the sequence's order and its `SeqIndex`.
    cp: Option<(SeqOrder, ValueId)>,
}

fn d(role: Role, size: usize) -> Dim {
    Dim::new(role, size)
}

impl Builder<'_> {
    fn param(&mut self, src: ParamSource, dims: Vec<Dim>, label: &str) -> Result<ValueId, IrError> {
        self.g.add_typed(
            Op::Param(src),
            &[],
            Some(TensorType::new(DType::F32, dims)),
            label,
        )
    }

    fn whole(&mut self, name: String, dims: Vec<Dim>, label: &str) -> Result<ValueId, IrError> {
        self.param(ParamSource::whole(name), dims, label)
    }

    fn act(&self, last: Dim) -> TensorType {
        TensorType::new(
            DType::F32,
            vec![d(Role::Batch, self.b), d(Role::Seq, self.t), last],
        )
    }

    /// `x · Wᵀ (+ b)` for a PyTorch Linear weight `[out, in]`.
    fn linear(
        &mut self,
        x: ValueId,
        prefix: &str,
        out: Dim,
        inp: Dim,
        bias: bool,
        label: &str,
    ) -> Result<ValueId, IrError> {
        let w = self.whole(
            format!("{prefix}.weight"),
            vec![out, inp],
            &format!("{label}.weight"),
        )?;
        let mut y = self.g.add_typed(
            Op::MatMul { transpose_b: true },
            &[x, w],
            Some(self.act(out)),
            label,
        )?;
        if bias {
            let bv = self.whole(
                format!("{prefix}.bias"),
                vec![out],
                &format!("{label}.bias"),
            )?;
            y = self.g.add(Op::Add, &[y, bv], format!("{label}.add_bias"))?;
        }
        Ok(y)
    }

    /// `x · W + b` for a GPT-2 `Conv1D` weight `[in, out]` and its bias.
    fn conv1d(
        &mut self,
        x: ValueId,
        prefix: &str,
        inp: Dim,
        out: Dim,
        label: &str,
    ) -> Result<ValueId, IrError> {
        let w = ParamSource::whole(format!("{prefix}.weight"));
        let b = ParamSource::whole(format!("{prefix}.bias"));
        self.conv1d_of(x, [w, b], inp, out, label)
    }

    /// [`Builder::conv1d`] with the weight and bias read from `[w, b]`.
    fn conv1d_of(
        &mut self,
        x: ValueId,
        [w, b]: [ParamSource; 2],
        inp: Dim,
        out: Dim,
        label: &str,
    ) -> Result<ValueId, IrError> {
        let w = self.param(w, vec![inp, out], &format!("{label}.weight"))?;
        let y = self.g.add_typed(
            Op::MatMul { transpose_b: false },
            &[x, w],
            Some(self.act(out)),
            label,
        )?;
        let b = self.param(b, vec![out], &format!("{label}.bias"))?;
        self.g.add(Op::Add, &[y, b], format!("{label}.add_bias"))
    }

    fn norm(&mut self, x: ValueId, prefix: &str, label: &str) -> Result<ValueId, IrError> {
        let h = d(Role::Hidden, self.cfg.hidden);
        let eps = Float(self.cfg.eps);
        let w = self.whole(
            format!("{prefix}.weight"),
            vec![h],
            &format!("{label}.weight"),
        )?;
        match self.cfg.norm {
            NormKind::Rms => self.g.add(Op::RmsNorm { eps }, &[x, w], label),
            NormKind::Layer => {
                let b = self.whole(format!("{prefix}.bias"), vec![h], &format!("{label}.bias"))?;
                self.g.add(Op::LayerNorm { eps }, &[x, w, b], label)
            }
        }
    }

    fn split_heads(&mut self, x: ValueId, heads: Dim, label: &str) -> Result<ValueId, IrError> {
        let ty = TensorType::new(
            DType::F32,
            vec![
                d(Role::Batch, self.b),
                d(Role::Seq, self.t),
                heads,
                d(Role::HeadDim, self.cfg.head_dim),
            ],
        );
        self.g.add_typed(Op::Reshape, &[x], Some(ty), label)
    }

    /// `x` with its sequence dim (1) in the context-parallel order (`inverse`: back to
    /// natural order); `x` itself unless the order permutes.
    fn cp_order(&mut self, x: ValueId, inverse: bool) -> Result<ValueId, IrError> {
        match self.cp {
            Some((order @ SeqOrder::HeadTail { .. }, _)) => {
                let name = format!(
                    "{}.{}",
                    self.g.node(x).name,
                    if inverse { "natural_order" } else { "cp_order" }
                );
                self.g.add(
                    Op::SeqPermute {
                        dim: 1,
                        order,
                        inverse,
                    },
                    &[x],
                    name,
                )
            }
            _ => Ok(x),
        }
    }
}

/// Builds the forward graph.
pub fn build_forward(cfg: &ModelConfig, opts: BuildOptions) -> Result<Graph, IrError> {
    let (b, t) = (opts.batch, opts.seq);
    let opts_output = opts.output;
    let mut bl = Builder {
        g: Graph::new(),
        cfg,
        b,
        t,
        kv_repeat: opts.kv_repeat.max(1),
        cp: None,
    };
    if let Some(order) = opts.cp {
        if !order.divides(t) {
            return Err(IrError::Invalid(format!(
                "seq={t} does not split into the {} order's {} chunks",
                order.name(),
                match order {
                    SeqOrder::HeadTail { parts } => 2 * parts,
                    SeqOrder::Contiguous => 1,
                }
            )));
        }
        let idx =
            bl.g.add(Op::SeqIndex { len: t, order }, &[], "cp.seq_index")?;
        bl.cp = Some((order, idx));
    }
    let bt = |dt: DType| TensorType::new(dt, vec![d(Role::Batch, b), d(Role::Seq, t)]);
    let stage = opts.stage.clone().unwrap_or(StageSpec {
        layers: 0..cfg.layers,
        embed: true,
        head: true,
    });
    if stage.layers.end > cfg.layers || stage.layers.start > stage.layers.end {
        return Err(IrError::Invalid(format!(
            "pipeline chunk layers {}..{} outside the model's {} layers",
            stage.layers.start, stage.layers.end, cfg.layers
        )));
    }
    let hd = d(Role::Hidden, cfg.hidden);
    let vd = d(Role::Vocab, cfg.vocab);
    let gpt2 = cfg.arch == Arch::Gpt2;
    let (embed_name, prefix) = if gpt2 {
        ("transformer.wte.weight", "transformer.h")
    } else {
        ("model.embed_tokens.weight", "model.layers")
    };
    let ids = stage.embed.then(|| bl.g.input("input_ids", bt(DType::I32)));
    let pos = bl.g.input("position_ids", bt(DType::I32));
    let mask = bl.g.input("attention_mask", bt(DType::F32));
    let ids = ids.map(|x| bl.cp_order(x, false)).transpose()?;
    let pos = bl.cp_order(pos, false)?;
    let mask = bl.cp_order(mask, false)?;

    let mut table = None;
    let mut x = match ids {
        Some(ids) => {
            let t = bl.whole(embed_name.into(), vec![vd, hd], "embed")?;
            table = Some(t);
            let mut x = bl.g.add(Op::Embedding, &[t, ids], "embed.lookup")?;
            if gpt2 {
                let wpe = bl.whole(
                    "transformer.wpe.weight".into(),
                    vec![d(Role::Other, cfg.max_positions), hd],
                    "pos_embed",
                )?;
                let p = bl.g.add(Op::Embedding, &[wpe, pos], "pos_embed.lookup")?;
                x = bl.g.add(Op::Add, &[x, p], "embed.add_pos")?;
            }
            x
        }
        None => bl.g.input(STAGE_INPUT, bl.act(hd)),
    };

    for layer in stage.layers.clone() {
        bl.g.current_layer = Some(layer as u32);
        let lp = format!("{prefix}.{layer}");
        let l = format!("layers.{layer}");
        x = attention_block(&mut bl, x, pos, mask, &lp, &l)?;
        x = if cfg.moe.is_some() {
            moe_block(&mut bl, x, &lp, &l)?
        } else {
            mlp_block(&mut bl, x, &lp, &l)?
        };
    }
    bl.g.current_layer = None;

    if !stage.head {
        bl.g.set_output(STAGE_OUTPUT, x);
        crate::ir::verify_if_debug(&bl.g, "build_forward");
        return Ok(bl.g);
    }
    let final_norm = if gpt2 {
        "transformer.ln_f"
    } else {
        "model.norm"
    };
    let h = bl.norm(x, final_norm, "final_norm")?;
    let (h, positions) = match opts_output {
        ForwardOutput::Hidden => {
            let h = bl.cp_order(h, true)?;
            bl.g.set_output("hidden", h);
            crate::ir::verify_if_debug(&bl.g, "build_forward");
            return Ok(bl.g);
        }
        ForwardOutput::Last => {
            let t = bl.t;
            // The last token sits where the context-parallel order put it.
            let start = bl.cp.map_or(t - 1, |(o, _)| o.position_of(t, t - 1));
            let last = bl.g.add(
                Op::Slice {
                    dim: 1,
                    start,
                    len: 1,
                },
                &[h],
                "final_norm.last",
            )?;
            (last, 1)
        }
        ForwardOutput::Logits | ForwardOutput::Loss => (h, bl.t),
    };
    let head = match (cfg.tied, table) {
        (true, Some(t)) => t,
        // A tied head in a chunk without the embedding: its own copy of the table, labelled
        // like it (the pipeline sums the two copies' gradients before the optimizer).
        (true, None) => bl.whole(embed_name.into(), vec![vd, hd], "embed")?,
        _ => bl.whole("lm_head.weight".into(), vec![vd, hd], "lm_head")?,
    };
    let logits = bl.g.add_typed(
        Op::MatMul { transpose_b: true },
        &[h, head],
        Some(TensorType::new(
            DType::F32,
            vec![d(Role::Batch, bl.b), d(Role::Seq, positions), vd],
        )),
        "lm_head.matmul",
    )?;
    if opts_output == ForwardOutput::Loss {
        let labels = bl.g.input("labels", bt(DType::I32));
        let labels = bl.cp_order(labels, false)?;
        let denom = bl.b * bl.t.saturating_sub(1);
        let loss = bl.g.add(
            Op::CrossEntropy {
                denom: denom.max(1),
            },
            &[logits, labels],
            "loss",
        )?;
        bl.g.set_output("loss", loss);
        crate::ir::verify_if_debug(&bl.g, "build_forward");
        return Ok(bl.g);
    }
    let (logits, h) = if positions == bl.t {
        (bl.cp_order(logits, true)?, bl.cp_order(h, true)?)
    } else {
        (logits, h)
    };
    bl.g.set_output("logits", logits);
    bl.g.set_output("hidden", h);
    crate::ir::verify_if_debug(&bl.g, "build_forward");
    Ok(bl.g)
}

fn attention_block(
    bl: &mut Builder,
    x: ValueId,
    pos: ValueId,
    mask: ValueId,
    lp: &str,
    l: &str,
) -> Result<ValueId, IrError> {
    let cfg = bl.cfg;
    let hd = d(Role::Hidden, cfg.hidden);
    let qd = d(Role::Heads, cfg.heads * cfg.head_dim);
    let kd = d(Role::KvHeads, cfg.kv_heads * cfg.head_dim);
    let gpt2 = cfg.arch == Arch::Gpt2;
    let h = if gpt2 {
        bl.norm(x, &format!("{lp}.ln_1"), &format!("{l}.attn_norm"))?
    } else {
        bl.norm(
            x,
            &format!("{lp}.input_layernorm"),
            &format!("{l}.attn_norm"),
        )?
    };
    let (q, k, v) = if gpt2 {
        // Conv1D: weight stored [in, out] = [H, 3H]; q, k, v are column blocks.
        let mut out = Vec::new();
        for (i, name) in ["q", "k", "v"].iter().enumerate() {
            let view = ParamView {
                dim: 1,
                start: i * cfg.hidden,
                len: cfg.hidden,
            };
            let w = ParamSource {
                view: Some(view),
                ..ParamSource::whole(format!("{lp}.attn.c_attn.weight"))
            };
            let b = ParamSource {
                view: Some(ParamView { dim: 0, ..view }),
                ..ParamSource::whole(format!("{lp}.attn.c_attn.bias"))
            };
            let od = if i == 0 { qd } else { kd };
            let label = format!("{l}.attn.{name}_proj");
            out.push(bl.conv1d_of(h, [w, b], hd, od, &label)?);
        }
        (out[0], out[1], out[2])
    } else {
        let sa = format!("{lp}.self_attn");
        let q = bl.linear(
            h,
            &format!("{sa}.q_proj"),
            qd,
            hd,
            cfg.qkv_bias,
            &format!("{l}.attn.q_proj"),
        )?;
        let k = bl.linear(
            h,
            &format!("{sa}.k_proj"),
            kd,
            hd,
            cfg.qkv_bias,
            &format!("{l}.attn.k_proj"),
        )?;
        let v = bl.linear(
            h,
            &format!("{sa}.v_proj"),
            kd,
            hd,
            cfg.qkv_bias,
            &format!("{l}.attn.v_proj"),
        )?;
        (q, k, v)
    };
    let heads = d(Role::Heads, cfg.heads);
    let kv_heads = d(Role::KvHeads, cfg.kv_heads);
    let mut q = bl.split_heads(q, heads, &format!("{l}.attn.q_heads"))?;
    let mut k = bl.split_heads(k, kv_heads, &format!("{l}.attn.k_heads"))?;
    let mut v = bl.split_heads(v, kv_heads, &format!("{l}.attn.v_heads"))?;
    if let Some(rope) = cfg.rope {
        q =
            bl.g.add(Op::Rope(rope), &[q, pos], format!("{l}.attn.q_rope"))?;
        k =
            bl.g.add(Op::Rope(rope), &[k, pos], format!("{l}.attn.k_rope"))?;
    }
    if bl.kv_repeat > 1 {
        let rep = Op::Repeat {
            dim: 2,
            times: bl.kv_repeat,
        };
        k = bl.g.add(rep.clone(), &[k], format!("{l}.attn.k_repeat"))?;
        v = bl.g.add(rep, &[v], format!("{l}.attn.v_repeat"))?;
    }
    let spec = AttnSpec {
        causal: true,
        window: cfg.window,
        scale: Float(1.0 / (cfg.head_dim as f32).sqrt()),
        indexed: bl.cp.is_some(),
    };
    let mut operands = vec![q, k, v, mask];
    if let Some((_, idx)) = bl.cp {
        operands.extend([idx, idx]);
    }
    let a =
        bl.g.add(Op::Attention(spec), &operands, format!("{l}.attn.sdpa"))?;
    let a = bl.g.add_typed(
        Op::Reshape,
        &[a],
        Some(bl.act(qd)),
        format!("{l}.attn.merge_heads"),
    )?;
    let o = if gpt2 {
        bl.conv1d(
            a,
            &format!("{lp}.attn.c_proj"),
            qd,
            hd,
            &format!("{l}.attn.o_proj"),
        )?
    } else {
        bl.linear(
            a,
            &format!("{lp}.self_attn.o_proj"),
            hd,
            qd,
            cfg.o_bias,
            &format!("{l}.attn.o_proj"),
        )?
    };
    bl.g.add(Op::Add, &[x, o], format!("{l}.attn.residual"))
}

fn mlp_block(bl: &mut Builder, x: ValueId, lp: &str, l: &str) -> Result<ValueId, IrError> {
    let cfg = bl.cfg;
    let hd = d(Role::Hidden, cfg.hidden);
    let fd = d(Role::Ffn, cfg.ffn);
    let act = Op::Unary(cfg.act);
    let y = if cfg.arch == Arch::Gpt2 {
        let h = bl.norm(x, &format!("{lp}.ln_2"), &format!("{l}.mlp_norm"))?;
        let u = bl.conv1d(
            h,
            &format!("{lp}.mlp.c_fc"),
            hd,
            fd,
            &format!("{l}.mlp.up_proj"),
        )?;
        let a = bl.g.add(act, &[u], format!("{l}.mlp.act"))?;
        bl.conv1d(
            a,
            &format!("{lp}.mlp.c_proj"),
            fd,
            hd,
            &format!("{l}.mlp.down_proj"),
        )?
    } else {
        let h = bl.norm(
            x,
            &format!("{lp}.post_attention_layernorm"),
            &format!("{l}.mlp_norm"),
        )?;
        let mb = cfg.mlp_bias;
        let g = bl.linear(
            h,
            &format!("{lp}.mlp.gate_proj"),
            fd,
            hd,
            mb,
            &format!("{l}.mlp.gate_proj"),
        )?;
        let u = bl.linear(
            h,
            &format!("{lp}.mlp.up_proj"),
            fd,
            hd,
            mb,
            &format!("{l}.mlp.up_proj"),
        )?;
        let a = bl.g.add(act, &[g], format!("{l}.mlp.act"))?;
        let m = bl.g.add(Op::Mul, &[a, u], format!("{l}.mlp.gate_mul"))?;
        bl.linear(
            m,
            &format!("{lp}.mlp.down_proj"),
            hd,
            fd,
            mb,
            &format!("{l}.mlp.down_proj"),
        )?
    };
    bl.g.add(Op::Add, &[x, y], format!("{l}.mlp.residual"))
}

fn moe_block(bl: &mut Builder, x: ValueId, lp: &str, l: &str) -> Result<ValueId, IrError> {
    let cfg = bl.cfg;
    let moe = cfg.moe.expect("invariant: moe_block only for MoE configs");
    let (b, t) = (bl.b, bl.t);
    let hd = d(Role::Hidden, cfg.hidden);
    let fd = d(Role::Ffn, cfg.ffn);
    let ed = d(Role::Expert, moe.experts);
    let h = bl.norm(
        x,
        &format!("{lp}.post_attention_layernorm"),
        &format!("{l}.mlp_norm"),
    )?;
    let bsm = format!("{lp}.block_sparse_moe");
    let logits = bl.linear(
        h,
        &format!("{bsm}.gate"),
        ed,
        hd,
        false,
        &format!("{l}.moe.router_logits"),
    )?;
    let gates = bl.g.add(
        Op::Router {
            top_k: moe.top_k,
            normalize: true,
        },
        &[logits],
        format!("{l}.moe.router"),
    )?;
    let xe =
        bl.g.add(Op::Dispatch, &[h, gates], format!("{l}.moe.dispatch"))?;
    let ety = |last: Dim| {
        TensorType::new(
            DType::F32,
            vec![ed, d(Role::Batch, b), d(Role::Seq, t), last],
        )
    };
    let expert = |bl: &mut Builder, w: &str, out: Dim, inp: Dim, xin: ValueId, label: &str| {
        let src = ParamSource {
            stack: Some(moe.experts),
            ..ParamSource::whole(format!("{bsm}.experts.{{}}.{w}.weight"))
        };
        let wv = bl.param(src, vec![ed, out, inp], &format!("{l}.moe.{label}.weight"))?;
        bl.g.add_typed(
            Op::MatMul { transpose_b: true },
            &[xin, wv],
            Some(ety(out)),
            format!("{l}.moe.{label}"),
        )
    };
    let g = expert(bl, "w1", fd, hd, xe, "gate_proj")?;
    let u = expert(bl, "w3", fd, hd, xe, "up_proj")?;
    let a = bl.g.add(Op::Unary(cfg.act), &[g], format!("{l}.moe.act"))?;
    let m = bl.g.add(Op::Mul, &[a, u], format!("{l}.moe.gate_mul"))?;
    let y = expert(bl, "w2", hd, fd, m, "down_proj")?;
    let y =
        bl.g.add(Op::Combine, &[y, gates], format!("{l}.moe.combine"))?;
    bl.g.add(Op::Add, &[x, y], format!("{l}.moe.residual"))
}
