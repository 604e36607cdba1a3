//! Printing: `Display` for [`Op`] and [`Graph`] in the text form of [`super`]. Output is a
//! function of the graph alone, so equal graphs print equal text.

use crate::ir::{
    EwExpr, EwStep, Float, Graph, Op, ParamView, RopeScaling, RopeStyle, SeqOrder, ShardSpec,
};
use std::fmt::{self, Write as _};

/// A string, always quoted.
pub(super) struct Quoted<'a>(pub(super) &'a str);

impl fmt::Display for Quoted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_char('"')?;
        for c in self.0.chars() {
            match c {
                '"' => f.write_str("\\\"")?,
                '\\' => f.write_str("\\\\")?,
                '\n' => f.write_str("\\n")?,
                '\r' => f.write_str("\\r")?,
                '\t' => f.write_str("\\t")?,
                c if c.is_control() => write!(f, "\\u{{{:x}}}", c as u32)?,
                c => f.write_char(c)?,
            }
        }
        f.write_char('"')
    }
}

/// A string, bare when it is an identifier (`tp`), else quoted.
struct Word<'a>(&'a str);

impl fmt::Display for Word<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut cs = self.0.chars();
        let ident = cs
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && cs.all(|c| c.is_ascii_alphanumeric() || c == '_');
        if ident {
            f.write_str(self.0)
        } else {
            Quoted(self.0).fmt(f)
        }
    }
}

/// A float constant: [`Float`]'s Display, or the bits of a non-canonical NaN.
pub(super) struct Lit(pub(super) Float);

impl fmt::Display for Lit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let bits = self.0 .0.to_bits();
        if self.0 .0.is_nan() && bits != f32::NAN.to_bits() {
            write!(f, "NaN:0x{bits:08x}")
        } else {
            self.0.fmt(f)
        }
    }
}

/// A sequence order: `contiguous` or `headtail{parts=N}`.
struct SeqOrderText(SeqOrder);

impl fmt::Display for SeqOrderText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            SeqOrder::Contiguous => f.write_str("contiguous"),
            SeqOrder::HeadTail { parts } => write!(f, "headtail{{parts={parts}}}"),
        }
    }
}

struct Shard<'a>(&'a ShardSpec);

impl fmt::Display for Shard<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.0;
        write!(
            f,
            "{{dim={}, axis={}, parts={}}}",
            s.dim,
            Word(&s.axis),
            s.parts
        )
    }
}

/// A list `[a, b]` of displayed items.
struct List<I>(I);

impl<I: Clone + Iterator<Item = T>, T: fmt::Display> fmt::Display for List<I> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_char('[')?;
        for (i, x) in self.0.clone().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{x}")?;
        }
        f.write_char(']')
    }
}

/// Writes `{k=v, ...}`, opening the braces at the first attribute.
struct Rec<'a, 'b> {
    f: &'a mut fmt::Formatter<'b>,
    open: bool,
}

impl Rec<'_, '_> {
    fn kv(&mut self, k: &str, v: impl fmt::Display) -> fmt::Result {
        self.f.write_str(if self.open { ", " } else { "{" })?;
        self.open = true;
        write!(self.f, "{k}={v}")
    }
    fn shards(&mut self, shards: &[ShardSpec]) -> fmt::Result {
        if shards.is_empty() {
            return Ok(());
        }
        self.kv("shards", List(shards.iter().map(Shard)))
    }
    fn close(self) -> fmt::Result {
        if self.open {
            self.f.write_char('}')?;
        }
        Ok(())
    }
}

/// The steps of an elementwise program: `[add{a=0, b=1}, unary{fn=silu, x=2}]`.
struct Steps<'a>(&'a EwExpr);

impl fmt::Display for Steps<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_char('[')?;
        for (i, s) in self.0.steps.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            match s {
                EwStep::Add { a, b } => write!(f, "add{{a={a}, b={b}}}")?,
                EwStep::Mul { a, b } => write!(f, "mul{{a={a}, b={b}}}")?,
                EwStep::Unary { f: u, x } => write!(f, "unary{{fn={}, x={x}}}", u.name())?,
                EwStep::Scale { c, x } => write!(f, "scale{{c={}, x={x}}}", Lit(*c))?,
                EwStep::Cast { to, x } => write!(f, "cast{{to={to}, x={x}}}")?,
            }
        }
        f.write_char(']')
    }
}

fn style_name(s: RopeStyle) -> &'static str {
    match s {
        RopeStyle::Half => "half",
        RopeStyle::Interleaved => "interleaved",
    }
}

/// `mnemonic{attrs}`: the op with every attribute, without operands.
impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.mnemonic())?;
        let mut r = Rec { f, open: false };
        match self {
            Op::Input { name, shards } => {
                r.kv("name", Quoted(name))?;
                r.shards(shards)?;
            }
            Op::Param(p) => {
                r.kv("name", Quoted(&p.name))?;
                if let Some(v) = p.view {
                    let ParamView { dim, start, len } = v;
                    r.kv(
                        "view",
                        format_args!("{{dim={dim}, start={start}, len={len}}}"),
                    )?;
                }
                if let Some(n) = p.stack {
                    r.kv("stack", n)?;
                }
                r.kv("transposed", p.transposed)?;
                r.shards(&p.shards)?;
            }
            Op::Embedding
            | Op::Add
            | Op::Mul
            | Op::Softmax
            | Op::Reshape
            | Op::Dispatch
            | Op::Combine
            | Op::BiasGrad
            | Op::EmbeddingGrad
            | Op::DispatchGrad => {}
            Op::MatMul { transpose_b } | Op::WeightGrad { transpose_b } => {
                r.kv("transpose_b", transpose_b)?
            }
            Op::Unary(u) | Op::UnaryGrad(u) => r.kv("fn", u.name())?,
            Op::Scale(c) => r.kv("c", Lit(*c))?,
            Op::Cast(dt) => r.kv("to", dt)?,
            Op::RmsNorm { eps } | Op::LayerNorm { eps } => r.kv("eps", Lit(*eps))?,
            Op::RmsNormGrad { eps, wrt } | Op::LayerNormGrad { eps, wrt } => {
                r.kv("eps", Lit(*eps))?;
                r.kv("wrt", wrt.name())?;
            }
            Op::Rope(s) | Op::RopeGrad(s) => {
                r.kv("theta", Lit(s.theta))?;
                r.kv("style", style_name(s.style))?;
                match s.scaling {
                    None => {}
                    Some(RopeScaling::Linear { factor }) => {
                        r.kv("scaling", format_args!("linear{{factor={}}}", Lit(factor)))?
                    }
                    Some(RopeScaling::Llama3 {
                        factor,
                        low_freq_factor: lo,
                        high_freq_factor: hi,
                        original_max_positions: n,
                    }) => r.kv(
                        "scaling",
                        format_args!(
                            "llama3{{factor={}, low_freq_factor={}, high_freq_factor={}, \
                             original_max_positions={n}}}",
                            Lit(factor),
                            Lit(lo),
                            Lit(hi)
                        ),
                    )?,
                }
            }
            Op::Attention(a)
            | Op::AttentionProbs(a)
            | Op::AttentionGrad { spec: a, .. }
            | Op::RingAttention { spec: a, .. }
            | Op::RingAttentionGrad { spec: a, .. } => {
                if let Op::RingAttention { axis, parts, .. }
                | Op::RingAttentionGrad { axis, parts, .. } = self
                {
                    r.kv("axis", Word(axis))?;
                    r.kv("parts", parts)?;
                }
                r.kv("causal", a.causal)?;
                if let Some(w) = a.window {
                    r.kv("window", w)?;
                }
                r.kv("scale", Lit(a.scale))?;
                if a.indexed {
                    r.kv("indexed", true)?;
                }
                if let Op::AttentionGrad { wrt, .. } = self {
                    r.kv("wrt", wrt.name())?;
                }
            }
            Op::SeqIndex { len, order } => {
                r.kv("len", len)?;
                r.kv("order", SeqOrderText(*order))?;
            }
            Op::SeqPermute {
                dim,
                order,
                inverse,
            } => {
                r.kv("dim", dim)?;
                r.kv("order", SeqOrderText(*order))?;
                r.kv("inverse", inverse)?;
            }
            Op::Transpose { perm } => r.kv("perm", List(perm.iter()))?,
            Op::Slice { dim, start, len } => {
                r.kv("dim", dim)?;
                r.kv("start", start)?;
                r.kv("len", len)?;
            }
            Op::Concat { dim } => r.kv("dim", dim)?,
            Op::Repeat { dim, times } | Op::RepeatGrad { dim, times } => {
                r.kv("dim", dim)?;
                r.kv("times", times)?;
            }
            Op::Router { top_k, normalize } | Op::RouterGrad { top_k, normalize } => {
                r.kv("top_k", top_k)?;
                r.kv("normalize", normalize)?;
            }
            Op::CrossEntropy { denom }
            | Op::CrossEntropyGrad { denom }
            | Op::CrossEntropyFromStats { denom } => r.kv("denom", denom)?,
            Op::CrossEntropyStats { axis, parts } => {
                r.kv("axis", Word(axis))?;
                r.kv("parts", parts)?;
            }
            Op::CrossEntropyShardGrad { axis, denom } => {
                r.kv("axis", Word(axis))?;
                r.kv("denom", denom)?;
            }
            Op::CombineGrad { wrt } => r.kv("wrt", wrt.name())?,
            Op::AdamMoment { beta, squared } => {
                r.kv("beta", Lit(*beta))?;
                r.kv("squared", squared)?;
            }
            Op::AdamWUpdate(a) => {
                r.kv("lr", Lit(a.lr))?;
                r.kv("beta1", Lit(a.beta1))?;
                r.kv("beta2", Lit(a.beta2))?;
                r.kv("eps", Lit(a.eps))?;
                r.kv("weight_decay", Lit(a.weight_decay))?;
            }
            Op::AllReduce { axis } => r.kv("axis", Word(axis))?,
            Op::ReduceScatter { axis, dim, parts }
            | Op::AllGather { axis, dim, parts }
            | Op::LocalSlice { axis, dim, parts } => {
                r.kv("axis", Word(axis))?;
                r.kv("dim", dim)?;
                r.kv("parts", parts)?;
            }
            Op::AllToAll {
                axis,
                split_dim,
                concat_dim,
                parts,
            } => {
                r.kv("axis", Word(axis))?;
                r.kv("split_dim", split_dim)?;
                r.kv("concat_dim", concat_dim)?;
                r.kv("parts", parts)?;
            }
            Op::Broadcast { axis, root } => {
                r.kv("axis", Word(axis))?;
                r.kv("root", root)?;
            }
            Op::RankOffset { axis, stride } => {
                r.kv("axis", Word(axis))?;
                r.kv("stride", stride)?;
            }
            Op::FusedElementwise { expr } => r.kv("steps", Steps(expr))?,
            Op::FusedMatMul {
                transpose_b,
                epilogue,
            } => {
                r.kv("transpose_b", transpose_b)?;
                r.kv("epilogue", Steps(epilogue))?;
            }
            Op::AddRmsNorm { eps } => r.kv("eps", Lit(*eps))?,
            Op::AgMatMul { .. } | Op::MatMulRs { .. } => {
                let m = self.ring_matmul().expect("invariant: a collective matmul");
                r.kv("axis", Word(m.axis))?;
                r.kv("dim", m.dim)?;
                r.kv("parts", m.parts)?;
                r.kv("transpose_b", m.transpose_b)?;
            }
        }
        r.close()
    }
}

/// The text form (see [`crate::ir::parse_graph`]); that function reads it back.
impl fmt::Display for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("graph {\n")?;
        for (v, n) in self.ids().zip(&self.nodes) {
            write!(f, "  {v}: {} = {}", n.ty, n.op)?;
            if !n.inputs.is_empty() {
                for (i, x) in n.inputs.iter().enumerate() {
                    f.write_str(if i == 0 { "(" } else { ", " })?;
                    write!(f, "{x}")?;
                }
                f.write_char(')')?;
            }
            if !n.name.is_empty() {
                write!(f, " {}", Quoted(&n.name))?;
            }
            if let Some(l) = n.layer {
                write!(f, " @layer {l}")?;
            }
            if !n.role.is_forward() {
                write!(f, " @role {}", n.role)?;
            }
            f.write_char('\n')?;
        }
        for (name, v) in &self.outputs {
            writeln!(f, "  output {} = {v}", Word(name))?;
        }
        f.write_char('}')
    }
}
