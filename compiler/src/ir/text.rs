//! The text form of a [`Graph`]: `Display` prints it, [`parse_graph`] (and `FromStr`) reads it.
//!
//! Post-conditions: for a graph built through [`Graph::add_typed`], parsing its text gives an
//! equal graph (`current_layer` = `None`, `current_role` forward) whose text is identical. The parser builds every node
//! through [`Graph::add_typed`], so each node is type-checked; it never panics, and reports the
//! first problem as [`IrError::Parse`] with its 1-based line.
//!
//! ```text
//! graph {
//!   %0: i32[batch=2,seq=3] = input{name="input_ids"} "input_ids"
//!   %1: f32[vocab=5,hidden=4] = param{name="embed", view={dim=0, start=5, len=5}, transposed=false, shards=[{dim=0, axis=tp, parts=2}]} "embed"
//!   %2: f32[batch=2,seq=3,hidden=4] = embedding(%1, %0) "embed \"x\"" @layer 0
//!   output hidden = %2
//! }
//! ```
//!
//! A node is `%N: TYPE = MNEMONIC{ATTRS}(OPERANDS) "LABEL" @layer L @role R`. Ids are dense
//! and in order. `{ATTRS}` is left out when the op has none, `(OPERANDS)` when there are none,
//! the label when empty, `@layer` when `None` and `@role` for a forward value (the role's
//! [`crate::ir::ValueRole`] text name otherwise: `saved`, `backward`, `gradient`, ...). Attribute values are integers, floats ([`Float`]'s
//! Display; a NaN other than `f32::NAN` as `NaN:0x7fc00001`), `true`/`false`, words, strings,
//! lists `[a, b]`, records `{k=v, ..}` and tagged records (`linear{factor=2.0}`). An `Option`
//! attribute is left out when `None`, `shards` when empty. Strings (`name`, labels) are quoted
//! with the escapes `\" \\ \n \r \t \u{7f}`; axis and output names are bare when they are
//! identifiers. `//` starts a comment.

mod parse;
mod print;

pub use parse::parse_graph;

use super::{Graph, IrError};
use std::str::FromStr;

impl FromStr for Graph {
    type Err = IrError;
    fn from_str(s: &str) -> Result<Graph, IrError> {
        parse_graph(s)
    }
}

#[cfg(test)]
mod tests {
    use super::parse::{float, Val};
    use super::print::Lit;
    use super::*;
    use crate::ir::{
        dims, AttnSpec, DType, Dim, EwExpr, EwStep, Float, Op, ParamSource, ParamView, Role,
        RopeScaling, RopeSpec, RopeStyle, SeqOrder, ShardSpec, TensorType, UnaryOp, ValueId,
    };
    use crate::ir::{AdamWSpec, AttnWrt, CombineWrt, NormWrt};
    use proptest::prelude::*;
    use DType::{Bf16, F32, I32};
    use Role::{Batch, Expert, HeadDim, Heads, Hidden, Other, Seq, Vocab};

    fn t(dtype: DType, spec: &[(Role, usize)]) -> TensorType {
        TensorType::new(dtype, dims(spec))
    }
    fn shard(dim: usize, axis: &str, parts: usize) -> ShardSpec {
        ShardSpec {
            dim,
            axis: axis.into(),
            parts,
        }
    }
    fn param(g: &mut Graph, p: ParamSource, ty: TensorType) -> Result<ValueId, IrError> {
        let label = p.name.clone();
        g.add_typed(Op::Param(p), &[], Some(ty), label)
    }
    /// The whole stored tensor `name`, as a parameter of type `ty`.
    fn whole(g: &mut Graph, name: &str, ty: TensorType) -> Result<ValueId, IrError> {
        param(g, ParamSource::whole(name), ty)
    }
    /// Rows `start..start + len` of the stored matrix `name`, split by rows over `tp`, as a
    /// parameter of type `ty`.
    fn tp_rows(
        g: &mut Graph,
        name: &str,
        start: usize,
        len: usize,
        ty: TensorType,
    ) -> Result<ValueId, IrError> {
        let src = ParamSource {
            view: Some(ParamView { dim: 0, start, len }),
            shards: vec![shard(0, "tp", 2)],
            ..ParamSource::whole(name)
        };
        param(g, src, ty)
    }
    fn rope(theta: f32, style: RopeStyle, scaling: Option<RopeScaling>) -> Op {
        Op::Rope(RopeSpec {
            theta: Float(theta),
            style,
            scaling,
        })
    }

    /// Every op variant, odd names, layers and shards.
    fn every_op() -> Result<Graph, IrError> {
        let mut g = Graph::new();
        let bt = [(Batch, 2), (Seq, 4)];
        let input = Op::Input {
            name: "input_ids".into(),
            shards: vec![shard(0, "dp", 2)],
        };
        let ids = g.add_typed(input, &[], Some(t(I32, &bt)), "input_ids")?;
        let pos = g.input("position_ids", TensorType::plain(I32, &[2, 4]));
        let mask = g.input("attention_mask", t(F32, &bt));
        let labels = g.input("labels \"y\"", t(I32, &bt));
        let emb_ty = t(F32, &[(Vocab, 16), (Hidden, 8)]);
        let emb = tp_rows(&mut g, "model.embed_tokens.weight", 16, 16, emb_ty)?;
        g.current_layer = Some(0);
        let local = g.add(
            Op::RankOffset {
                axis: "tp".into(),
                stride: 8,
            },
            &[ids],
            "",
        )?;
        let x = g.add(Op::Embedding, &[emb, local], "embed")?;
        let wn = whole(&mut g, "norm.weight", t(F32, &[(Hidden, 8)]))?;
        let xn = g.add(Op::RmsNorm { eps: Float(1e-6) }, &[x, wn], "")?;
        let src = ParamSource {
            transposed: true,
            ..ParamSource::whole("q \"proj\" {}\n\\")
        };
        let wq = param(&mut g, src, TensorType::plain(F32, &[8, 8]))?;
        let q = g.add(
            Op::MatMul { transpose_b: true },
            &[xn, wq],
            "layers.0 {attn} q",
        )?;
        let heads = t(F32, &[(Batch, 2), (Seq, 4), (Heads, 2), (HeadDim, 4)]);
        let q4 = g.add_typed(Op::Reshape, &[q], Some(heads), "")?;
        let llama3 = RopeScaling::Llama3 {
            factor: Float(8.0),
            low_freq_factor: Float(1.0),
            high_freq_factor: Float(4.0),
            original_max_positions: 8192,
        };
        let qr = g.add(rope(1e4, RopeStyle::Half, Some(llama3)), &[q4, pos], "")?;
        let linear = Some(RopeScaling::Linear { factor: Float(2.0) });
        let kr = g.add(rope(5e5, RopeStyle::Interleaved, linear), &[q4, pos], "")?;
        let vr = g.add(rope(1e4, RopeStyle::Half, None), &[q4, pos], "")?;
        let spec = AttnSpec {
            causal: true,
            window: Some(3),
            scale: Float(0.5),
            indexed: false,
        };
        let att = g.add(Op::Attention(spec), &[qr, kr, vr, mask], "")?;
        let spec = AttnSpec {
            causal: false,
            window: None,
            scale: Float(1e-40),
            indexed: false,
        };
        let att2 = g.add(Op::Attention(spec), &[qr, kr, vr], "")?;
        // Context parallelism: indices of a head-tail sequence, a ring over `cp` (this rank's
        // block of 2 of the 4 keys), and the return to natural order.
        let order = SeqOrder::HeadTail { parts: 2 };
        let idx = g.add(Op::SeqIndex { len: 4, order }, &[], "")?;
        let block = Op::Slice {
            dim: 1,
            start: 0,
            len: 2,
        };
        let kb = g.add(block, &[kr], "")?;
        let spec = AttnSpec {
            causal: true,
            window: Some(3),
            scale: Float(0.5),
            indexed: true,
        };
        let ring = Op::RingAttention {
            spec,
            axis: "cp".into(),
            parts: 2,
        };
        let ring = g.add(ring, &[qr, kb, kb, mask, idx, idx], "")?;
        let ring_grad = Op::RingAttentionGrad {
            spec,
            axis: "cp".into(),
            parts: 2,
        };
        g.add(ring_grad, &[qr, kb, kb, ring, ring, mask, idx, idx], "")?;
        let back = Op::SeqPermute {
            dim: 1,
            order,
            inverse: true,
        };
        g.add(back, &[ring], "")?;
        g.add(
            Op::Transpose {
                perm: vec![0, 2, 1, 3],
            },
            &[att2],
            "",
        )?;
        let a3 = g.add_typed(
            Op::Reshape,
            &[att],
            Some(t(F32, &[(Batch, 2), (Seq, 4), (Hidden, 8)])),
            "",
        )?;
        let h = g.add(Op::Add, &[x, a3], "")?;
        let m = g.add(Op::Mul, &[h, wn], "")?;
        for u in UnaryOp::ALL {
            g.add(Op::Unary(u), &[m], u.name())?;
        }
        let s = g.add(Op::Scale(Float(-0.125)), &[m], "")?;
        g.add(Op::Cast(Bf16), &[s], "")?;
        let lb = whole(&mut g, "ln.bias", t(F32, &[(Hidden, 8)]))?;
        let ln = g.add(Op::LayerNorm { eps: Float(1e-5) }, &[m, wn, lb], "")?;
        let sm = g.add(Op::Softmax, &[ln], "")?;
        let sl = g.add(
            Op::Slice {
                dim: 2,
                start: 2,
                len: 4,
            },
            &[sm],
            "",
        )?;
        g.add(Op::Concat { dim: 2 }, &[sl, sl], "")?;
        g.add(Op::Repeat { dim: 2, times: 2 }, &[sl], "")?;
        let we = whole(&mut g, "gate", t(F32, &[(Hidden, 8), (Expert, 4)]))?;
        let le = g.add(Op::MatMul { transpose_b: false }, &[m, we], "")?;
        let gates = g.add(
            Op::Router {
                top_k: 2,
                normalize: true,
            },
            &[le],
            "",
        )?;
        g.add(
            Op::Router {
                top_k: 1,
                normalize: false,
            },
            &[le],
            "",
        )?;
        g.current_role = crate::ir::ValueRole::Saved;
        let disp = g.add(Op::Dispatch, &[m, gates], "")?;
        g.current_role = crate::ir::ValueRole::Forward;
        let src = ParamSource {
            stack: Some(4),
            shards: vec![shard(0, "ep", 2), shard(2, "tp", 1)],
            ..ParamSource::whole("experts.{}.w")
        };
        let wexp = param(&mut g, src, t(F32, &[(Expert, 4), (Other, 8), (Other, 8)]))?;
        let ey = g.add(Op::MatMul { transpose_b: false }, &[disp, wexp], "")?;
        let comb = g.add(Op::Combine, &[ey, gates], "")?;
        g.current_layer = None;
        let lm = whole(
            &mut g,
            "lm_head.weight",
            t(F32, &[(Vocab, 16), (Hidden, 8)]),
        )?;
        let logits = g.add(Op::MatMul { transpose_b: true }, &[comb, lm], "logits")?;
        g.current_role = crate::ir::ValueRole::Loss;
        let loss = g.add(Op::CrossEntropy { denom: 7 }, &[logits, labels], "")?;
        let ce_stats = Op::CrossEntropyStats {
            axis: "tp".into(),
            parts: 2,
        };
        let stats = g.add(ce_stats, &[logits, labels], "")?;
        let gathered = Op::AllGather {
            axis: "tp".into(),
            dim: 2,
            parts: 2,
        };
        let stats = g.add(gathered, &[stats], "")?;
        g.add(Op::CrossEntropyFromStats { denom: 7 }, &[stats, labels], "")?;
        g.current_role = crate::ir::ValueRole::Forward;
        let ar = g.add(Op::AllReduce { axis: "tp".into() }, &[logits], "")?;
        let rs = g.add(
            Op::ReduceScatter {
                axis: "tp".into(),
                dim: 2,
                parts: 2,
            },
            &[ar],
            "",
        )?;
        let ag = g.add(
            Op::AllGather {
                axis: "odd axis\t\"".into(),
                dim: 2,
                parts: 2,
            },
            &[rs],
            "",
        )?;
        let op = Op::AllToAll {
            axis: "ep".into(),
            split_dim: 0,
            concat_dim: 2,
            parts: 2,
        };
        let a2a = g.add(op, &[ag], "")?;
        let bc = g.add(
            Op::Broadcast {
                axis: "dp".into(),
                root: 1,
            },
            &[a2a],
            "",
        )?;
        let ls = g.add(
            Op::LocalSlice {
                axis: "tp".into(),
                dim: 1,
                parts: 2,
            },
            &[bc],
            "",
        )?;
        let ew = |steps: Vec<EwStep>| EwExpr { steps };
        let fe = ew(vec![
            EwStep::Add { a: 0, b: 1 },
            EwStep::Unary {
                f: UnaryOp::Silu,
                x: 2,
            },
            EwStep::Mul { a: 3, b: 0 },
            EwStep::Scale {
                c: Float(0.5),
                x: 4,
            },
            EwStep::Cast { to: Bf16, x: 5 },
        ]);
        g.add(Op::FusedElementwise { expr: fe }, &[m, wn], "fused")?;
        let epilogue = ew(vec![
            EwStep::Add { a: 0, b: 1 },
            EwStep::Unary {
                f: UnaryOp::GeluTanh,
                x: 2,
            },
        ]);
        let fm = Op::FusedMatMul {
            transpose_b: true,
            epilogue,
        };
        g.add(fm, &[m, wq, lb], "")?;
        g.add(Op::AddRmsNorm { eps: Float(1e-6) }, &[x, a3, wn], "")?;
        let (axis, dim, parts, transpose_b) = ("tp".to_string(), 1, 2, true);
        let agm = Op::AgMatMul {
            axis: axis.clone(),
            dim,
            parts,
            transpose_b,
        };
        g.add(agm, &[m, wq], "")?;
        let mrs = Op::MatMulRs {
            axis,
            dim,
            parts,
            transpose_b,
        };
        g.add(mrs, &[m, wq], "")?;
        // Training ops.
        let dm = g.add(Op::UnaryGrad(UnaryOp::GeluTanh), &[m, m], "")?;
        g.add(Op::BiasGrad, &[dm, lb], "")?;
        g.add(Op::WeightGrad { transpose_b: true }, &[xn, q, wq], "")?;
        let rms_dx = Op::RmsNormGrad {
            eps: Float(1e-6),
            wrt: NormWrt::X,
        };
        g.add(rms_dx, &[x, wn, dm], "")?;
        let ln_dw = Op::LayerNormGrad {
            eps: Float(1e-5),
            wrt: NormWrt::Weight,
        };
        g.add(ln_dw, &[m, wn, dm], "")?;
        let rope_spec = RopeSpec {
            theta: Float(1e4),
            style: RopeStyle::Interleaved,
            scaling: Some(RopeScaling::Linear { factor: Float(4.0) }),
        };
        g.add(Op::RopeGrad(rope_spec), &[q4, pos], "")?;
        let spec = AttnSpec {
            causal: true,
            window: Some(3),
            scale: Float(0.5),
            indexed: false,
        };
        let probs = g.add(Op::AttentionProbs(spec), &[qr, kr, mask], "probs")?;
        let wrt = AttnWrt::K;
        g.add(
            Op::AttentionGrad { spec, wrt },
            &[qr, kr, vr, att, probs],
            "",
        )?;
        g.add(Op::EmbeddingGrad, &[ids, x, emb], "")?;
        let router_grad = Op::RouterGrad {
            top_k: 2,
            normalize: true,
        };
        g.add(router_grad, &[le, le], "")?;
        g.add(Op::DispatchGrad, &[disp, gates], "")?;
        let wrt = CombineWrt::Gates;
        g.add(Op::CombineGrad { wrt }, &[ey, gates, comb], "")?;
        g.add(Op::CrossEntropyGrad { denom: 7 }, &[logits, labels], "")?;
        let shard_grad = Op::CrossEntropyShardGrad {
            axis: "tp".into(),
            denom: 7,
        };
        g.add(shard_grad, &[logits, labels, stats], "")?;
        g.add(Op::RepeatGrad { dim: 2, times: 2 }, &[q4], "")?;
        let step = g.input("step", TensorType::plain(F32, &[]));
        let moment = Op::AdamMoment {
            beta: Float(0.9),
            squared: true,
        };
        let mo = g.add(moment, &[wn, wn], "")?;
        g.add(
            Op::AdamWUpdate(AdamWSpec::default()),
            &[wn, mo, mo, step],
            "",
        )?;
        g.set_output("loss", loss);
        g.set_output("logits", logits);
        g.set_output("weird \"name\"\n", ls);
        Ok(g)
    }

    fn round_trip(g: &Graph) {
        let text = g.to_string();
        let back: Graph = match text.parse() {
            Ok(b) => b,
            Err(e) => panic!("{e}\n{text}"),
        };
        assert_eq!(&back, g, "{text}");
        assert_eq!(back.to_string(), text);
    }

    #[test]
    fn every_op_round_trips() -> Result<(), IrError> {
        let g = every_op()?;
        let mnemonics: std::collections::HashSet<_> =
            g.nodes.iter().map(|n| n.op.mnemonic()).collect();
        // 35 ops, plus the rewriter's 5 fused ones and 18 training ops.
        assert_eq!(mnemonics.len(), 35 + 5 + 18, "every Op variant is covered");
        round_trip(&g);
        Ok(())
    }

    const GOLDEN: &str = r#"graph {
  %0: i32[batch=2,seq=3] = input{name="input_ids"} "input_ids"
  %1: f32[vocab=5,hidden=4] = param{name="embed", view={dim=0, start=5, len=5}, transposed=false, shards=[{dim=0, axis=tp, parts=2}]} "embed"
  %2: f32[batch=2,seq=3,hidden=4] = embedding(%1, %0) "embed \"x\"" @layer 0
  %3: f32[batch=2,seq=3,hidden=4] = all_reduce{axis=tp}(%2) @layer 0
  %4: f32[batch=2,seq=3,hidden=4] = scale{c=-1e-7}(%3)
  output hidden = %4
  output "two words" = %3
}"#;

    #[test]
    fn golden_text() -> Result<(), IrError> {
        let mut g = Graph::new();
        let ids = g.input("input_ids", t(I32, &[(Batch, 2), (Seq, 3)]));
        let emb = tp_rows(&mut g, "embed", 5, 5, t(F32, &[(Vocab, 5), (Hidden, 4)]))?;
        g.current_layer = Some(0);
        let x = g.add(Op::Embedding, &[emb, ids], "embed \"x\"")?;
        let r = g.add(Op::AllReduce { axis: "tp".into() }, &[x], "")?;
        g.current_layer = None;
        let s = g.add(Op::Scale(Float(-1e-7)), &[r], "")?;
        g.set_output("hidden", s);
        g.set_output("two words", r);
        assert_eq!(g.to_string(), GOLDEN);
        assert_eq!(parse_graph(GOLDEN)?, g);
        let commented = GOLDEN.replace("\n  output hidden", " // c\n\n  // c\n  output hidden");
        assert_eq!(commented.parse::<Graph>()?, g);
        Ok(())
    }

    fn parse_err(text: &str) -> (usize, String) {
        match parse_graph(text) {
            Err(IrError::Parse { line, msg }) => (line, msg),
            other => panic!("expected a parse error for {text:?}, got {other:?}"),
        }
    }

    #[track_caller]
    fn check_err(body: &str, line: usize, needle: &str) {
        let text = format!("graph {{\n  %0: f32[batch=2,4] = input{{name=\"x\"}}\n{body}\n}}");
        let (l, msg) = parse_err(&text);
        assert!(
            l == line && msg.contains(needle),
            "line {l}: {msg}; wanted line {line}: {needle}"
        );
    }

    #[test]
    fn parse_errors() {
        assert!(parse_err("hello world").1.contains("expected `graph {`"));
        assert!(parse_err("").1.contains("expected `graph {`"));
        assert!(parse_err("graph {\n").1.contains("missing `}`"));
        assert_eq!(parse_err("graph {\n}\n%0").0, 3);
        assert!(parse_graph("// golden\ngraph { // c\n\n}\n").is_ok());
        // Each body line after the input line (line 3 of the text), and what its error says.
        for (body, needle) in [
            ("  %1: f32[2,4] = frobnicate(%0)", "unknown op `frobnicate`"),
            ("  %1: f33[2,4] = softmax(%0)", "expected a dtype"),
            ("  %1: f32[2,x] = softmax(%0)", "dim role or size"),
            ("  %1: f32[width=2] = softmax(%0)", "dim role or size"),
            ("  %1: f32[2,4 = softmax(%0)", "to close the dims"),
            (
                "  %1: f32[2,99999999999999999999999] = softmax(%0)",
                "out of range",
            ),
            ("  %1: f32[2,4] = add(%0, %5)", "operand %5 is not defined"),
            ("  %2: f32[2,4] = softmax(%0)", "expected value id %1"),
            ("  %0: f32[2,4] = softmax(%0)", "expected value id %1"),
            ("  %1: f32[2,4] = softmax(%0) \"abc", "unterminated string"),
            ("  %1: f32[2,4] = softmax(%0) \"a\\q\"", "unknown escape"),
            ("  %1: f32[2,5] = softmax(%0)", "declared type"),
            ("  %1: i32[2,4] = softmax(%0)", "declared type"),
            ("  %1: f32[2,4] = softmax(%0, %0)", "operand"),
            ("  %1: f32[2,4] = scale(%0)", "missing attribute `c`"),
            (
                "  %1: f32[2,4] = scale{c=1.0, d=2}(%0)",
                "unknown attribute `d`",
            ),
            ("  %1: f32[2,4] = scale{c=1.0, c=2.0}(%0)", "given twice"),
            ("  %1: f32[2,4] = scale{c=x}(%0)", "expected a float"),
            ("  %1: f32[2,4] = unary{fn=tanh}(%0)", "unary function"),
            ("  %1: f32[2,4] = softmax(%0) junk", "unexpected"),
            ("  %1: f32[2,4] = softmax(%0) @lay 2", "expected `layer`"),
            (
                "  %1: f32[2,4] = softmax(%0) @role x",
                "expected a value role",
            ),
            ("  %1: f32[2,4] = softmax(%0) @role forward", "value role"),
            (
                "  %1: f32[2,4] = softmax(%0) @role saved @layer 1",
                "`layer`",
            ),
            ("  output y = %1", "undefined value %1"),
            ("  outptu y = %0", "expected a node"),
            (
                "  %1: f32[2,4] = scale{c=[[[[[[[[[[[[1]]]]]]]]]]]]}(%0)",
                "nested too deeply",
            ),
            (
                "  %1: f32[2,8] = all_to_all{axis=tp, split_dim=0, concat_dim=1, parts=0}(%0)",
                "positive",
            ),
            (
                "  %1: f32[2,4] = repeat{dim=1, times=18446744073709551615}(%0)",
                "overflows",
            ),
            (
                "  %1: f32[2,4] = slice{dim=1, start=18446744073709551615, len=1}(%0)",
                "overflows",
            ),
            (
                "  %1: f32[4294967296,4294967296] = reshape(%0)",
                "too large",
            ),
        ] {
            check_err(body, 3, needle);
        }
    }

    #[test]
    fn floats_round_trip_bits() {
        for bits in [
            0x7fc0_0000u32,
            0xffc0_0000,
            0x7f80_0001,
            1,
            0x8000_0000,
            0x7f7f_ffff,
            0xff80_0000,
        ] {
            let x = Float(f32::from_bits(bits));
            let back = float(Val::Atom(Lit(x).to_string())).expect("a printed float parses");
            assert_eq!(back.0.to_bits(), bits, "{}", Lit(x));
        }
    }

    /// One random step of a random graph: which op, on which value, with what attributes.
    type Step = (u8, prop::sample::Index, u8, u8, f32, String, Option<u32>);

    fn odd_float() -> impl Strategy<Value = f32> {
        let special = [
            0.0,
            -0.0,
            1e-45,
            -1e-45,
            1.1754942e-38,
            f32::MAX,
            f32::MIN,
            3.4e38,
            -1e-7,
        ];
        prop_oneof![
            any::<f32>(),
            any::<u32>().prop_map(f32::from_bits),
            prop::sample::select(special.to_vec()),
        ]
    }

    fn step() -> impl Strategy<Value = Step> {
        let name = "[a-z0-9 ._{}\"\\\\\n\t\r\u{0}\u{7f}\u{85}é%@=,()\\[\\]]{0,8}";
        (
            0u8..18,
            any::<prop::sample::Index>(),
            any::<u8>(),
            any::<u8>(),
            odd_float(),
            name,
            any::<Option<u32>>(),
        )
    }

    /// A graph from random steps; steps whose op does not type-check are skipped.
    fn build(shape: &[(usize, usize)], steps: &[Step]) -> Graph {
        let mut g = Graph::new();
        let ty = TensorType::new(
            F32,
            shape
                .iter()
                .map(|&(r, s)| Dim::new(Role::ALL[r], s))
                .collect(),
        );
        g.input("x", ty);
        for (kind, pick, a, b, x, name, layer) in steps {
            g.current_layer = *layer;
            let v = ValueId(pick.index(g.len()) as u32);
            let ty = g.ty(v).clone();
            let (a, b, rank) = (usize::from(*a), usize::from(*b), ty.rank().max(1));
            let axis = if a % 2 == 0 {
                "tp".to_string()
            } else {
                name.clone()
            };
            let (op, ins, decl) = match kind {
                0 => (Op::Unary(UnaryOp::ALL[a % 6]), vec![v], None),
                1 => (Op::Scale(Float(*x)), vec![v], None),
                2 => (Op::Add, vec![v, v], None),
                3 => (Op::Mul, vec![v, v], None),
                4 => {
                    let src = ParamSource {
                        name: name.clone(),
                        view: (a % 2 == 0).then_some(ParamView {
                            dim: a % 3,
                            start: b,
                            len: 1 + b % 5,
                        }),
                        stack: (a % 3 == 0).then_some(b),
                        transposed: a % 5 == 0,
                        shards: (0..a % 3).map(|i| shard(i, &axis, 1 + b % 4)).collect(),
                    };
                    let pty = TensorType::plain(ty.dtype, &[ty.last(), 1 + b % 5]);
                    let Ok(p) = param(&mut g, src, pty) else {
                        continue;
                    };
                    (Op::MatMul { transpose_b: false }, vec![v, p], None)
                }
                5 => (
                    Op::Reshape,
                    vec![v],
                    Some(TensorType::plain(ty.dtype, &[ty.numel()])),
                ),
                6 => (
                    Op::Slice {
                        dim: a % rank,
                        start: b % 3,
                        len: 1,
                    },
                    vec![v],
                    None,
                ),
                7 => (Op::AllReduce { axis }, vec![v], None),
                8 => (
                    Op::AllGather {
                        axis,
                        dim: a % rank,
                        parts: 1 + b % 3,
                    },
                    vec![v],
                    None,
                ),
                9 => (
                    Op::ReduceScatter {
                        axis,
                        dim: a % rank,
                        parts: 1 + b % 2,
                    },
                    vec![v],
                    None,
                ),
                10 => (
                    Op::AllToAll {
                        axis,
                        split_dim: a % rank,
                        concat_dim: b % rank,
                        parts: 1 + b % 2,
                    },
                    vec![v],
                    None,
                ),
                11 => (Op::Broadcast { axis, root: b }, vec![v], None),
                12 => (
                    Op::LocalSlice {
                        axis,
                        dim: a % rank,
                        parts: 1 + b % 2,
                    },
                    vec![v],
                    None,
                ),
                13 => (Op::Cast([F32, Bf16, DType::F16][a % 3]), vec![v], None),
                14 => (
                    Op::Transpose {
                        perm: (0..ty.rank()).rev().collect(),
                    },
                    vec![v],
                    None,
                ),
                15 => (Op::Concat { dim: a % rank }, vec![v; 1 + b % 3], None),
                16 => {
                    let input = Op::Input {
                        name: name.clone(),
                        shards: vec![shard(a, &axis, b)],
                    };
                    let ity = TensorType::plain([F32, Bf16, I32][a % 3], &[1 + b % 4, 1 + a % 3]);
                    (input, vec![], Some(ity))
                }
                _ => (Op::Softmax, vec![v], None),
            };
            let _ = g.add_typed(op, &ins, decl, name.clone());
        }
        g.current_layer = None;
        for (i, (_, _, _, _, _, name, _)) in steps.iter().enumerate().take(2) {
            g.set_output(name, ValueId((i % g.len()) as u32));
        }
        g
    }

    proptest! {
        #[test]
        fn random_graphs_round_trip(
            shape in prop::collection::vec((0usize..10, 1usize..5), 0..4),
            steps in prop::collection::vec(step(), 0..14),
        ) {
            round_trip(&build(&shape, &steps));
        }

        #[test]
        fn garbage_never_panics(
            prefix in prop::sample::select(vec![
                "", "graph {\n", "graph {\n  %0: f32[2] = ",
                "graph {\n  %0: f32[2,3] = input{name=\"x\"}\n  %1: f32[2,3] = ",
            ]),
            body in "(?s).{0,80}",
        ) {
            let _ = parse_graph(&format!("{prefix}{body}"));
        }

        #[test]
        fn mutated_text_never_panics(cut in any::<prop::sample::Index>(), n in 0usize..6, ins in ".{0,4}") {
            let text = GOLDEN.to_string();
            let at = cut.index(text.chars().count());
            let mut chars: Vec<char> = text.chars().collect();
            chars.splice(at..(at + n).min(chars.len()), ins.chars());
            let _ = parse_graph(&chars.into_iter().collect::<String>());
        }
    }
}
