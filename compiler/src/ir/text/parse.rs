//! Parsing the text form of [`super`], one line at a time with a cursor. Attribute values are
//! read into a small value tree first, then each op's schema takes its attributes out by name,
//! so unknown, missing and repeated attributes are errors. Nodes are built through
//! [`Graph::add_typed`] after guarding the size arithmetic of [`Op::infer`]: no input panics.

use super::print::Quoted;
use crate::ir::{
    AdamWSpec, AttnSpec, AttnWrt, CombineWrt, DType, Dim, EwExpr, EwStep, Float, Graph, IrError,
    NormWrt, Op, ParamSource, ParamView, Role, RopeScaling, RopeSpec, RopeStyle, SeqOrder,
    ShardSpec, TensorType, UnaryOp, ValueId, ValueRole,
};
use std::str::FromStr;

/// Nesting limit for attribute values (keeps garbage from overflowing the stack).
const MAX_DEPTH: usize = 8;

/// A parsed attribute value, before the op's schema gives it a meaning.
#[derive(Debug)]
pub(super) enum Val {
    /// A bare word or number.
    Atom(String),
    /// A quoted string, unescaped.
    Str(String),
    /// `[a, b]`.
    List(Vec<Val>),
    /// `tag{k=v, ..}`, the tag optional.
    Rec(Option<String>, Vec<(String, Val)>),
}

impl Val {
    fn describe(&self) -> String {
        match self {
            Val::Atom(a) => format!("`{a}`"),
            Val::Str(s) => format!("string {}", Quoted(s)),
            Val::List(_) => "a list".into(),
            Val::Rec(..) => "a record".into(),
        }
    }
}

/// A cursor over one line.
struct Cur<'a> {
    s: &'a str,
    i: usize,
    line: usize,
}

impl<'a> Cur<'a> {
    fn err<T>(&self, msg: impl Into<String>) -> Result<T, IrError> {
        Err(IrError::Parse {
            line: self.line,
            msg: msg.into(),
        })
    }
    fn rest(&self) -> &'a str {
        &self.s[self.i..]
    }
    fn peek(&mut self) -> Option<char> {
        self.ws();
        self.rest().chars().next()
    }
    fn found(&self) -> String {
        let r = self.rest().trim_start_matches([' ', '\t']);
        match r.chars().count() {
            0 => "end of line".into(),
            n if n > 16 => format!("`{}...`", r.chars().take(16).collect::<String>()),
            _ => format!("`{r}`"),
        }
    }
    fn ws(&mut self) {
        let r = self.rest();
        self.i += r.len() - r.trim_start_matches([' ', '\t']).len();
    }
    fn eat(&mut self, c: char) -> bool {
        let hit = self.peek() == Some(c);
        if hit {
            self.i += c.len_utf8();
        }
        hit
    }
    fn expect(&mut self, c: char, what: &str) -> Result<(), IrError> {
        if self.eat(c) {
            return Ok(());
        }
        self.err(format!("expected `{c}` {what}, found {}", self.found()))
    }
    fn take_while(&mut self, p: impl Fn(char) -> bool) -> &'a str {
        self.ws();
        let r = self.rest();
        let n = r.find(|c| !p(c)).unwrap_or(r.len());
        self.i += n;
        &r[..n]
    }
    fn word(&mut self) -> &'a str {
        self.take_while(|c| c.is_ascii_alphanumeric() || c == '_')
    }
    fn atom(&mut self) -> &'a str {
        self.take_while(|c| c.is_ascii_alphanumeric() || "_.+-:".contains(c))
    }
    fn end(&mut self) -> Result<(), IrError> {
        match self.peek() {
            None => Ok(()),
            Some(_) if self.rest().starts_with("//") => Ok(()),
            Some(_) => self.err(format!("unexpected {} at end of line", self.found())),
        }
    }
    fn uint<T: FromStr>(&mut self, what: &str) -> Result<T, IrError> {
        let found = self.found();
        let w = self.word();
        if w.is_empty() || !w.bytes().all(|b| b.is_ascii_digit()) {
            return self.err(format!("expected {what}, found {found}"));
        }
        w.parse()
            .or_else(|_| self.err(format!("{what} `{w}` is out of range")))
    }
    fn value_id(&mut self) -> Result<ValueId, IrError> {
        self.expect('%', "before a value id")?;
        Ok(ValueId(self.uint("a value id")?))
    }
    fn string(&mut self) -> Result<String, IrError> {
        self.expect('"', "to open a string")?;
        let mut out = String::new();
        let mut cs = self.rest().char_indices();
        while let Some((k, c)) = cs.next() {
            match c {
                '"' => {
                    self.i += k + 1;
                    return Ok(out);
                }
                '\\' => match cs.next().map(|(_, e)| e) {
                    Some('n') => out.push('\n'),
                    Some('r') => out.push('\r'),
                    Some('t') => out.push('\t'),
                    Some(e @ ('"' | '\\')) => out.push(e),
                    Some('u') if cs.next().map(|p| p.1) == Some('{') => {
                        let hex: String =
                            cs.by_ref().map(|p| p.1).take_while(|&h| h != '}').collect();
                        match u32::from_str_radix(&hex, 16).ok().and_then(char::from_u32) {
                            Some(ch) if hex.len() <= 6 => out.push(ch),
                            _ => return self.err(format!("bad escape `\\u{{{hex}}}`")),
                        }
                    }
                    Some(e) => return self.err(format!("unknown escape `\\{e}` in a string")),
                    None => break,
                },
                c => out.push(c),
            }
        }
        self.err("unterminated string")
    }
    fn value(&mut self, depth: usize) -> Result<Val, IrError> {
        if depth > MAX_DEPTH {
            return self.err("attribute values nested too deeply");
        }
        match self.peek() {
            Some('"') => Ok(Val::Str(self.string()?)),
            Some('{') => Ok(Val::Rec(None, self.record(depth + 1)?)),
            Some('[') => {
                self.i += 1;
                let mut items = Vec::new();
                if self.eat(']') {
                    return Ok(Val::List(items));
                }
                loop {
                    items.push(self.value(depth + 1)?);
                    if !self.eat(',') {
                        self.expect(']', "to close a list")?;
                        return Ok(Val::List(items));
                    }
                }
            }
            _ => {
                let a = self.atom();
                if a.is_empty() {
                    return self.err(format!("expected a value, found {}", self.found()));
                }
                if self.peek() == Some('{') {
                    return Ok(Val::Rec(Some(a.into()), self.record(depth + 1)?));
                }
                Ok(Val::Atom(a.into()))
            }
        }
    }
    fn record(&mut self, depth: usize) -> Result<Vec<(String, Val)>, IrError> {
        self.expect('{', "to open attributes")?;
        let mut items: Vec<(String, Val)> = Vec::new();
        if self.eat('}') {
            return Ok(items);
        }
        loop {
            let k = self.word();
            if k.is_empty() {
                return self.err(format!(
                    "expected an attribute name, found {}",
                    self.found()
                ));
            }
            if items.iter().any(|(n, _)| n == k) {
                return self.err(format!("attribute `{k}` given twice"));
            }
            self.expect('=', "after an attribute name")?;
            items.push((k.into(), self.value(depth)?));
            if !self.eat(',') {
                self.expect('}', "to close attributes")?;
                return Ok(items);
            }
        }
    }
    fn tensor_type(&mut self) -> Result<TensorType, IrError> {
        let found = self.found();
        let dtype = match DType::from_name(self.word()) {
            Some(d) => d,
            None => return self.err(format!("expected a dtype, found {found}")),
        };
        self.expect('[', "to open the dims of a type")?;
        let mut dims = Vec::new();
        if self.eat(']') {
            return Ok(TensorType::new(dtype, dims));
        }
        loop {
            if self.peek().is_some_and(|c| c.is_ascii_digit()) {
                dims.push(Dim::new(Role::Other, self.uint("a dim size")?));
            } else {
                let found = self.found();
                let Some(role) = Role::from_name(self.word()) else {
                    return self.err(format!("expected a dim role or size, found {found}"));
                };
                self.expect('=', "after a dim role")?;
                dims.push(Dim::new(role, self.uint("a dim size")?));
            }
            if !self.eat(',') {
                self.expect(']', "to close the dims of a type")?;
                return Ok(TensorType::new(dtype, dims));
            }
        }
    }
}

/// The attributes of one op or record; the schema takes them out by name.
struct Attrs(Vec<(String, Val)>);

impl Attrs {
    fn opt<T>(
        &mut self,
        k: &str,
        conv: impl Fn(Val) -> Result<T, String>,
    ) -> Result<Option<T>, String> {
        let Some(i) = self.0.iter().position(|(n, _)| n == k) else {
            return Ok(None);
        };
        conv(self.0.remove(i).1)
            .map(Some)
            .map_err(|m| format!("attribute `{k}`: {m}"))
    }
    fn req<T>(&mut self, k: &str, conv: impl Fn(Val) -> Result<T, String>) -> Result<T, String> {
        self.opt(k, conv)?
            .ok_or_else(|| format!("missing attribute `{k}`"))
    }
    fn shards(&mut self) -> Result<Vec<ShardSpec>, String> {
        Ok(self.opt("shards", |v| list(v, shard))?.unwrap_or_default())
    }
    fn finish<T>(self, x: T) -> Result<T, String> {
        match self.0.first() {
            Some((k, _)) => Err(format!("unknown attribute `{k}`")),
            None => Ok(x),
        }
    }
}

fn atom(v: Val, what: &str) -> Result<String, String> {
    match v {
        Val::Atom(a) => Ok(a),
        v => Err(format!("expected {what}, found {}", v.describe())),
    }
}
fn uint(v: Val) -> Result<usize, String> {
    let a = atom(v, "an integer")?;
    if a.is_empty() || !a.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("expected an integer, found `{a}`"));
    }
    a.parse()
        .map_err(|_| format!("integer `{a}` is out of range"))
}
pub(super) fn float(v: Val) -> Result<Float, String> {
    let a = atom(v, "a float")?;
    let x = if a == "NaN" {
        Some(f32::NAN)
    } else if let Some(h) = a.strip_prefix("NaN:0x") {
        u32::from_str_radix(h, 16)
            .ok()
            .map(f32::from_bits)
            .filter(|x| x.is_nan())
    } else {
        a.parse().ok()
    };
    x.map(Float)
        .ok_or_else(|| format!("expected a float, found `{a}`"))
}
fn boolean(v: Val) -> Result<bool, String> {
    match atom(v, "`true` or `false`")?.as_str() {
        "true" => Ok(true),
        "false" => Ok(false),
        a => Err(format!("expected `true` or `false`, found `{a}`")),
    }
}
fn string(v: Val) -> Result<String, String> {
    match v {
        Val::Atom(s) | Val::Str(s) => Ok(s),
        v => Err(format!("expected a string, found {}", v.describe())),
    }
}
fn named<T>(v: Val, what: &str, f: impl Fn(&str) -> Option<T>) -> Result<T, String> {
    let a = atom(v, what)?;
    f(&a).ok_or_else(|| format!("expected {what}, found `{a}`"))
}
fn list<T>(v: Val, conv: impl Fn(Val) -> Result<T, String>) -> Result<Vec<T>, String> {
    match v {
        Val::List(xs) => xs.into_iter().map(conv).collect(),
        v => Err(format!("expected a list, found {}", v.describe())),
    }
}
fn record(v: Val, tags: &[&str]) -> Result<(String, Attrs), String> {
    match v {
        Val::Rec(tag, items) if tags.contains(&tag.as_deref().unwrap_or("")) => {
            Ok((tag.unwrap_or_default(), Attrs(items)))
        }
        v => Err(format!(
            "expected a record {tags:?}, found {}",
            v.describe()
        )),
    }
}
fn shard(v: Val) -> Result<ShardSpec, String> {
    let (_, mut a) = record(v, &[""])?;
    let s = ShardSpec {
        dim: a.req("dim", uint)?,
        axis: a.req("axis", string)?,
        parts: a.req("parts", uint)?,
    };
    a.finish(s)
}
fn view(v: Val) -> Result<ParamView, String> {
    let (_, mut a) = record(v, &[""])?;
    let p = ParamView {
        dim: a.req("dim", uint)?,
        start: a.req("start", uint)?,
        len: a.req("len", uint)?,
    };
    a.finish(p)
}
fn scaling(v: Val) -> Result<RopeScaling, String> {
    let (tag, mut a) = record(v, &["linear", "llama3"])?;
    let s = if tag == "linear" {
        RopeScaling::Linear {
            factor: a.req("factor", float)?,
        }
    } else {
        RopeScaling::Llama3 {
            factor: a.req("factor", float)?,
            low_freq_factor: a.req("low_freq_factor", float)?,
            high_freq_factor: a.req("high_freq_factor", float)?,
            original_max_positions: a.req("original_max_positions", uint)?,
        }
    };
    a.finish(s)
}

fn ew_index(v: Val) -> Result<u32, String> {
    let n = uint(v)?;
    u32::try_from(n).map_err(|_| format!("value index {n} is out of range"))
}
fn ew_step(v: Val) -> Result<EwStep, String> {
    let (tag, mut a) = record(v, &["add", "mul", "unary", "scale", "cast"])?;
    let s = match tag.as_str() {
        "add" => EwStep::Add {
            a: a.req("a", ew_index)?,
            b: a.req("b", ew_index)?,
        },
        "mul" => EwStep::Mul {
            a: a.req("a", ew_index)?,
            b: a.req("b", ew_index)?,
        },
        "unary" => EwStep::Unary {
            f: a.req("fn", unary_fn)?,
            x: a.req("x", ew_index)?,
        },
        "scale" => EwStep::Scale {
            c: a.req("c", float)?,
            x: a.req("x", ew_index)?,
        },
        _ => EwStep::Cast {
            to: a.req("to", dtype)?,
            x: a.req("x", ew_index)?,
        },
    };
    a.finish(s)
}
fn ew_expr(v: Val) -> Result<EwExpr, String> {
    Ok(EwExpr {
        steps: list(v, ew_step)?,
    })
}

/// The attributes of `rope` and `rope_grad`.
fn rope_spec(a: &mut Attrs) -> Result<RopeSpec, String> {
    Ok(RopeSpec {
        theta: a.req("theta", float)?,
        style: a.req("style", |v| {
            named(v, "`half` or `interleaved`", |s| match s {
                "half" => Some(RopeStyle::Half),
                "interleaved" => Some(RopeStyle::Interleaved),
                _ => None,
            })
        })?,
        scaling: a.opt("scaling", scaling)?,
    })
}

/// The attributes of `attention`, `attention_probs` and `attention_grad`.
fn attn_spec(a: &mut Attrs) -> Result<AttnSpec, String> {
    Ok(AttnSpec {
        causal: a.req("causal", boolean)?,
        window: a.opt("window", uint)?,
        scale: a.req("scale", float)?,
        indexed: a.opt("indexed", boolean)?.unwrap_or(false),
    })
}

/// A sequence order: `contiguous` or `headtail{parts=N}`.
fn seq_order(v: Val) -> Result<SeqOrder, String> {
    let (tag, mut a) = record(v, &["contiguous", "headtail"])?;
    let o = if tag == "contiguous" {
        SeqOrder::Contiguous
    } else {
        SeqOrder::HeadTail {
            parts: a.req("parts", uint)?,
        }
    };
    a.finish(o)
}

/// A unary function by name.
fn unary_fn(v: Val) -> Result<UnaryOp, String> {
    named(v, "a unary function", UnaryOp::from_name)
}

/// A dtype by name.
fn dtype(v: Val) -> Result<DType, String> {
    named(v, "a dtype", DType::from_name)
}

/// The op named `m` from its attributes; `Ok(None)` for an unknown mnemonic.
fn build_op(m: &str, mut a: Attrs) -> Result<Option<Op>, String> {
    let dim_parts = |a: &mut Attrs| -> Result<(String, usize, usize), String> {
        Ok((
            a.req("axis", string)?,
            a.req("dim", uint)?,
            a.req("parts", uint)?,
        ))
    };
    let op = match m {
        "input" => Op::Input {
            name: a.req("name", string)?,
            shards: a.shards()?,
        },
        "param" => Op::Param(ParamSource {
            name: a.req("name", string)?,
            view: a.opt("view", view)?,
            stack: a.opt("stack", uint)?,
            transposed: a.req("transposed", boolean)?,
            shards: a.shards()?,
        }),
        "embedding" => Op::Embedding,
        "matmul" => Op::MatMul {
            transpose_b: a.req("transpose_b", boolean)?,
        },
        "add" => Op::Add,
        "mul" => Op::Mul,
        "unary" => Op::Unary(a.req("fn", unary_fn)?),
        "scale" => Op::Scale(a.req("c", float)?),
        "cast" => Op::Cast(a.req("to", dtype)?),
        "rms_norm" => Op::RmsNorm {
            eps: a.req("eps", float)?,
        },
        "layer_norm" => Op::LayerNorm {
            eps: a.req("eps", float)?,
        },
        "rope" => Op::Rope(rope_spec(&mut a)?),
        "attention" => Op::Attention(attn_spec(&mut a)?),
        "softmax" => Op::Softmax,
        "reshape" => Op::Reshape,
        "transpose" => Op::Transpose {
            perm: a.req("perm", |v| list(v, uint))?,
        },
        "slice" => Op::Slice {
            dim: a.req("dim", uint)?,
            start: a.req("start", uint)?,
            len: a.req("len", uint)?,
        },
        "concat" => Op::Concat {
            dim: a.req("dim", uint)?,
        },
        "repeat" => Op::Repeat {
            dim: a.req("dim", uint)?,
            times: a.req("times", uint)?,
        },
        "router" => Op::Router {
            top_k: a.req("top_k", uint)?,
            normalize: a.req("normalize", boolean)?,
        },
        "dispatch" => Op::Dispatch,
        "combine" => Op::Combine,
        "cross_entropy" => Op::CrossEntropy {
            denom: a.req("denom", uint)?,
        },
        "cross_entropy_stats" => Op::CrossEntropyStats {
            axis: a.req("axis", string)?,
            parts: a.req("parts", uint)?,
        },
        "cross_entropy_from_stats" => Op::CrossEntropyFromStats {
            denom: a.req("denom", uint)?,
        },
        "all_reduce" => Op::AllReduce {
            axis: a.req("axis", string)?,
        },
        "reduce_scatter" => {
            let (axis, dim, parts) = dim_parts(&mut a)?;
            Op::ReduceScatter { axis, dim, parts }
        }
        "all_gather" => {
            let (axis, dim, parts) = dim_parts(&mut a)?;
            Op::AllGather { axis, dim, parts }
        }
        "local_slice" => {
            let (axis, dim, parts) = dim_parts(&mut a)?;
            Op::LocalSlice { axis, dim, parts }
        }
        "all_to_all" => Op::AllToAll {
            axis: a.req("axis", string)?,
            split_dim: a.req("split_dim", uint)?,
            concat_dim: a.req("concat_dim", uint)?,
            parts: a.req("parts", uint)?,
        },
        "broadcast" => Op::Broadcast {
            axis: a.req("axis", string)?,
            root: a.req("root", uint)?,
        },
        "ring_attention" => Op::RingAttention {
            axis: a.req("axis", string)?,
            parts: a.req("parts", uint)?,
            spec: attn_spec(&mut a)?,
        },
        "ring_attention_grad" => Op::RingAttentionGrad {
            axis: a.req("axis", string)?,
            parts: a.req("parts", uint)?,
            spec: attn_spec(&mut a)?,
        },
        "seq_index" => Op::SeqIndex {
            len: a.req("len", uint)?,
            order: a.req("order", seq_order)?,
        },
        "seq_permute" => Op::SeqPermute {
            dim: a.req("dim", uint)?,
            order: a.req("order", seq_order)?,
            inverse: a.req("inverse", boolean)?,
        },
        "rank_offset" => Op::RankOffset {
            axis: a.req("axis", string)?,
            stride: a.req("stride", uint)?,
        },
        "fused_elementwise" => Op::FusedElementwise {
            expr: a.req("steps", ew_expr)?,
        },
        "fused_matmul" => Op::FusedMatMul {
            transpose_b: a.req("transpose_b", boolean)?,
            epilogue: a.req("epilogue", ew_expr)?,
        },
        "add_rms_norm" => Op::AddRmsNorm {
            eps: a.req("eps", float)?,
        },
        "ag_matmul" | "matmul_rs" => {
            let (axis, dim, parts) = dim_parts(&mut a)?;
            let transpose_b = a.req("transpose_b", boolean)?;
            if m == "ag_matmul" {
                Op::AgMatMul {
                    axis,
                    dim,
                    parts,
                    transpose_b,
                }
            } else {
                Op::MatMulRs {
                    axis,
                    dim,
                    parts,
                    transpose_b,
                }
            }
        }
        _ => return build_train_op(m, a),
    };
    a.finish(Some(op))
}

/// A training op (`grad.rs`) named `m` from its attributes; `Ok(None)` for an unknown
/// mnemonic.
fn build_train_op(m: &str, mut a: Attrs) -> Result<Option<Op>, String> {
    let norm_wrt = |v| named(v, "`x` or `weight`", NormWrt::from_name);
    let op = match m {
        "unary_grad" => Op::UnaryGrad(a.req("fn", unary_fn)?),
        "bias_grad" => Op::BiasGrad,
        "weight_grad" => Op::WeightGrad {
            transpose_b: a.req("transpose_b", boolean)?,
        },
        "rms_norm_grad" => Op::RmsNormGrad {
            eps: a.req("eps", float)?,
            wrt: a.req("wrt", norm_wrt)?,
        },
        "layer_norm_grad" => Op::LayerNormGrad {
            eps: a.req("eps", float)?,
            wrt: a.req("wrt", norm_wrt)?,
        },
        "rope_grad" => Op::RopeGrad(rope_spec(&mut a)?),
        "attention_probs" => Op::AttentionProbs(attn_spec(&mut a)?),
        "attention_grad" => Op::AttentionGrad {
            spec: attn_spec(&mut a)?,
            wrt: a.req("wrt", |v| named(v, "`q`, `k` or `v`", AttnWrt::from_name))?,
        },
        "embedding_grad" => Op::EmbeddingGrad,
        "router_grad" => Op::RouterGrad {
            top_k: a.req("top_k", uint)?,
            normalize: a.req("normalize", boolean)?,
        },
        "dispatch_grad" => Op::DispatchGrad,
        "combine_grad" => Op::CombineGrad {
            wrt: a.req("wrt", |v| named(v, "`y` or `gates`", CombineWrt::from_name))?,
        },
        "cross_entropy_grad" => Op::CrossEntropyGrad {
            denom: a.req("denom", uint)?,
        },
        "cross_entropy_shard_grad" => Op::CrossEntropyShardGrad {
            axis: a.req("axis", string)?,
            denom: a.req("denom", uint)?,
        },
        "repeat_grad" => Op::RepeatGrad {
            dim: a.req("dim", uint)?,
            times: a.req("times", uint)?,
        },
        "adam_moment" => Op::AdamMoment {
            beta: a.req("beta", float)?,
            squared: a.req("squared", boolean)?,
        },
        "adamw_update" => Op::AdamWUpdate(AdamWSpec {
            lr: a.req("lr", float)?,
            beta1: a.req("beta1", float)?,
            beta2: a.req("beta2", float)?,
            eps: a.req("eps", float)?,
            weight_decay: a.req("weight_decay", float)?,
        }),
        _ => return Ok(None),
    };
    a.finish(Some(op))
}

/// Rejects attribute arithmetic that would overflow (or divide by zero) in [`Op::infer`], which
/// assumes sane sizes: the parser must not panic on any input.
fn guard(op: &Op, tys: &[&TensorType]) -> Result<(), String> {
    let size = |d: usize| {
        tys.first()
            .and_then(|t| t.dims.get(d))
            .map_or(0, |d| d.size)
    };
    let ok = match op {
        Op::AllToAll { parts: 0, .. } => return Err("parts must be positive".into()),
        Op::AllGather { dim, parts, .. }
        | Op::AgMatMul { dim, parts, .. }
        | Op::AllToAll {
            concat_dim: dim,
            parts,
            ..
        }
        | Op::Repeat { dim, times: parts } => size(*dim).checked_mul(*parts).is_some(),
        Op::Slice { start, len, .. } => start.checked_add(*len).is_some(),
        Op::Concat { dim } => tys
            .iter()
            .try_fold(0usize, |n, t| {
                n.checked_add(t.dims.get(*dim).map_or(0, |d| d.size))
            })
            .is_some(),
        _ => true,
    };
    if ok {
        Ok(())
    } else {
        Err("result size overflows".into())
    }
}

/// Appends a parsed node through [`Graph::add_typed`] and checks it got exactly its declared type.
fn add_node(
    g: &mut Graph,
    op: Op,
    inputs: &[ValueId],
    ty: TensorType,
    name: String,
    layer: Option<u32>,
    role: ValueRole,
) -> Result<(), String> {
    let bytes = ty
        .dims
        .iter()
        .try_fold(ty.dtype.size_bytes(), |n, d| n.checked_mul(d.size));
    if bytes.is_none() {
        return Err(format!("type {ty} is too large"));
    }
    let mut tys = Vec::new();
    for &i in inputs {
        if i.index() >= g.len() {
            return Err(format!("operand {i} is not defined before %{}", g.len()));
        }
        tys.push(g.ty(i));
    }
    guard(&op, &tys).map_err(|m| format!("{}: {m}", op.mnemonic()))?;
    g.current_layer = layer;
    g.current_role = role;
    g.add_typed(op, inputs, Some(ty.clone()), name)
        .map_err(|e| e.to_string())?;
    let node = g.nodes.last().expect("invariant: a node was just added");
    if node.ty != ty {
        let (m, got) = (node.op.mnemonic(), &node.ty);
        return Err(format!("{m}: declared type {ty} but operands give {got}"));
    }
    Ok(())
}

fn node_line(c: &mut Cur<'_>, g: &mut Graph) -> Result<(), IrError> {
    let id = c.value_id()?;
    if id.index() != g.len() {
        return c.err(format!(
            "expected value id %{}, found {id} (ids must be dense and in order)",
            g.len()
        ));
    }
    c.expect(':', "after the value id")?;
    let ty = c.tensor_type()?;
    c.expect('=', "after the type")?;
    let found = c.found();
    let m = c.word();
    if m.is_empty() {
        return c.err(format!("expected an op mnemonic, found {found}"));
    }
    let attrs = if c.peek() == Some('{') {
        c.record(0)?
    } else {
        Vec::new()
    };
    let mut inputs = Vec::new();
    if c.eat('(') && !c.eat(')') {
        loop {
            inputs.push(c.value_id()?);
            if !c.eat(',') {
                c.expect(')', "after the operands")?;
                break;
            }
        }
    }
    let name = if c.peek() == Some('"') {
        c.string()?
    } else {
        String::new()
    };
    let (mut layer, mut role) = (None, ValueRole::Forward);
    while c.eat('@') {
        match c.word() {
            "layer" if layer.is_none() && role.is_forward() => {
                layer = Some(c.uint("a layer number")?)
            }
            "role" if role.is_forward() => {
                let found = c.found();
                role = match ValueRole::from_name(c.word()) {
                    Some(r) if !r.is_forward() => r,
                    _ => return c.err(format!("expected a value role, found {found}")),
                };
            }
            _ => return c.err("expected `layer` or `role` after `@`"),
        }
    }
    c.end()?;
    let op = match build_op(m, Attrs(attrs)) {
        Ok(Some(op)) => op,
        Ok(None) => return c.err(format!("unknown op `{m}`")),
        Err(msg) => return c.err(format!("{m}: {msg}")),
    };
    add_node(g, op, &inputs, ty, name, layer, role).or_else(|msg| c.err(msg))
}

fn output_line(c: &mut Cur<'_>, g: &mut Graph) -> Result<(), IrError> {
    let name = if c.peek() == Some('"') {
        c.string()?
    } else {
        let found = c.found();
        match c.atom() {
            "" => return c.err(format!("expected an output name, found {found}")),
            a => a.to_string(),
        }
    };
    c.expect('=', "after the output name")?;
    let v = c.value_id()?;
    if v.index() >= g.len() {
        return c.err(format!("output `{name}` refers to undefined value {v}"));
    }
    c.end()?;
    g.outputs.push((name, v));
    Ok(())
}

/// Parses the text form printed by `Graph`'s `Display` (see the module docs). Every node is
/// type-checked as it is added; the first error is returned as [`IrError::Parse`].
pub fn parse_graph(s: &str) -> Result<Graph, IrError> {
    #[derive(PartialEq)]
    enum At {
        Before,
        In,
        After,
    }
    let mut g = Graph::new();
    let mut at = At::Before;
    let mut last = 1;
    for (i, raw) in s.split('\n').enumerate() {
        last = i + 1;
        let text = raw.strip_suffix('\r').unwrap_or(raw);
        let mut c = Cur {
            s: text,
            i: 0,
            line: last,
        };
        if c.peek().is_none() || c.rest().starts_with("//") {
            continue;
        }
        match at {
            At::Before => {
                if c.word() != "graph" || !c.eat('{') {
                    return c.err("expected `graph {`");
                }
                at = At::In;
            }
            At::In if c.peek() == Some('%') => node_line(&mut c, &mut g)?,
            At::In if c.eat('}') => at = At::After,
            At::In => {
                let found = c.found();
                if c.word() != "output" {
                    return c.err(format!("expected a node, `output` or `}}`, found {found}"));
                }
                output_line(&mut c, &mut g)?;
            }
            At::After => return c.err(format!("unexpected {} after the graph", c.found())),
        }
        c.end()?;
    }
    let msg = match at {
        At::Before => "expected `graph {`",
        At::In => "missing `}` at the end of the graph",
        At::After => {
            g.current_layer = None;
            g.current_role = ValueRole::Forward;
            return Ok(g);
        }
    };
    Err(IrError::Parse {
        line: last,
        msg: msg.into(),
    })
}
