//! The output check every gpu_bench program passes before it is timed: one GPU run compared
//! with the CPU reference executor (`shardc_runtime::execute_with_params`, f32).
//!
//! The benchmark shapes are too large for the CPU to run whole in a benchmark's time, so a
//! program is checked on a *prefix*: the same program built for fewer tokens (rows), its
//! inputs the leading block of the full inputs. Every program here is causal or per-row along
//! its token dim (GEMM rows, norms, elementwise ops, RoPE, causal attention, a causal decoder
//! layer), so the full run's leading rows must equal the small run's. A program with no such
//! dim is checked whole when small (a decode step: one query against the whole cache) or, when
//! not (an attention backward), as the same program at a smaller size on both the GPU and the
//! CPU, the full run's outputs required finite.
//!
//! The comparison is the relative L2 error over every output value, with no NaN or infinity
//! allowed where the reference is finite: below 2e-2 for bf16 (its 8-bit mantissa against an
//! f32 reference), 1e-4 for f32.

use shardc_compiler::ir::{Graph, Op, ParamSource};
use shardc_runtime::cuda::GpuDType;
use shardc_runtime::{execute_with_params, ParamCache, RankCtx, RuntimeError, Tensor};
use std::collections::BTreeMap;
use thiserror::Error;

/// Why a check failed.
#[derive(Debug, Error)]
pub enum CheckError {
    /// The CPU reference could not run the program.
    #[error("the CPU reference of `{case}` failed: {source}")]
    Cpu {
        case: String,
        #[source]
        source: RuntimeError,
    },
    /// A GPU output has a shape the reference's cannot be a prefix of, or is missing.
    #[error("`{case}`: output `{output}` is {got:?} on the GPU, the reference's {want:?}")]
    Shape {
        case: String,
        output: String,
        got: Vec<usize>,
        want: Vec<usize>,
    },
    /// A GPU output is not finite where the reference is.
    #[error(
        "`{case}`: output `{output}` has a non-finite value {value} at {index} (reference {want})"
    )]
    NonFinite {
        case: String,
        output: String,
        index: usize,
        value: f32,
        want: f32,
    },
    /// A GPU output is too far from the reference.
    #[error("`{case}`: output `{output}` is {rel_l2:.3e} from the CPU reference in relative L2 (at most {tol:.0e})")]
    Mismatch {
        case: String,
        output: String,
        rel_l2: f64,
        tol: f64,
    },
}

/// What a program's GPU outputs are compared with.
pub enum Reference {
    /// The program built for fewer tokens, run on the leading block of the inputs.
    Prefix(Graph),
    /// The program itself, run whole on the CPU.
    Whole,
    /// A program with no prefix property (an attention backward: a key's gradient sums over
    /// every later query) checked at this smaller size, on the GPU with the same options and
    /// on the CPU, on the leading block of the inputs; the full run's outputs must be finite.
    Smaller(Graph),
}

/// The relative L2 error a check allows for `dt`.
pub fn tolerance(dt: GpuDType) -> f64 {
    match dt {
        GpuDType::F32 => 1e-4,
        GpuDType::Bf16 => 2e-2,
    }
}

/// The leading `shape` block of `t` (every dim of `shape` at most `t`'s).
pub fn prefix(t: &Tensor, shape: &[usize]) -> Tensor {
    let full = &t.shape;
    debug_assert_eq!(full.len(), shape.len());
    let n: usize = shape.iter().product();
    // The flat index in `t` of element `i` of the block.
    let index = |mut i: usize| {
        let mut at = 0;
        let mut stride = 1;
        for d in (0..shape.len()).rev() {
            at += (i % shape[d]) * stride;
            i /= shape[d];
            stride *= full[d];
        }
        at
    };
    match (t.as_f32(), t.as_i32()) {
        (Some(v), _) => Tensor::f32(shape.to_vec(), (0..n).map(|i| v[index(i)]).collect()),
        (_, Some(v)) => Tensor::i32(shape.to_vec(), (0..n).map(|i| v[index(i)]).collect()),
        _ => unreachable!("invariant: bench tensors are f32 or i32"),
    }
}

/// The inputs and parameters of `small` cut from `full`'s: each the leading block of its full
/// tensor.
pub fn small_inputs(small: &Graph, full: &BTreeMap<String, Tensor>) -> BTreeMap<String, Tensor> {
    small
        .ids()
        .filter_map(|v| match &small.node(v).op {
            Op::Input { name, .. } | Op::Param(ParamSource { name, .. }) => {
                let t = full.get(name)?;
                Some((name.clone(), prefix(t, &small.ty(v).shape())))
            }
            _ => None,
        })
        .collect()
}

/// `g` with every parameter an input of its name: the CPU reads the benchmark's weights as
/// inputs, the values the GPU uploaded as parameters.
fn params_as_inputs(g: &Graph) -> Graph {
    let mut g = g.clone();
    for node in &mut g.nodes {
        if let Op::Param(src) = &node.op {
            node.op = Op::Input {
                name: src.name.clone(),
                shards: Vec::new(),
            };
        }
    }
    g
}

/// Every float output value of `outputs` finite.
pub fn finite(case: &str, outputs: &BTreeMap<String, Tensor>) -> Result<(), CheckError> {
    for (name, t) in outputs {
        if let Some((index, &value)) = t
            .as_f32()
            .and_then(|v| v.iter().enumerate().find(|(_, x)| !x.is_finite()))
        {
            return Err(CheckError::NonFinite {
                case: case.to_string(),
                output: name.clone(),
                index,
                value,
                want: 0.0,
            });
        }
    }
    Ok(())
}

/// The CPU reference's outputs of `g` on `inputs`.
pub fn cpu_outputs(
    case: &str,
    g: &Graph,
    inputs: &BTreeMap<String, Tensor>,
) -> Result<BTreeMap<String, Tensor>, CheckError> {
    let g = &params_as_inputs(g);
    execute_with_params(g, &ParamCache::default(), inputs, &RankCtx::new()).map_err(|source| {
        CheckError::Cpu {
            case: case.to_string(),
            source,
        }
    })
}

/// The relative L2 error of every output of `got` (the GPU's, cut to the reference's shape)
/// against `want` (the reference's), or the first failure.
pub fn compare(
    case: &str,
    got: &BTreeMap<String, Tensor>,
    want: &BTreeMap<String, Tensor>,
    dt: GpuDType,
) -> Result<f64, CheckError> {
    let tol = tolerance(dt);
    let mut worst = 0f64;
    for (name, w) in want {
        let shape_err = |got: Vec<usize>| CheckError::Shape {
            case: case.to_string(),
            output: name.clone(),
            got,
            want: w.shape.clone(),
        };
        let g = got.get(name).ok_or_else(|| shape_err(vec![]))?;
        if g.shape.len() != w.shape.len() || g.shape.iter().zip(&w.shape).any(|(a, b)| a < b) {
            return Err(shape_err(g.shape.clone()));
        }
        let g = prefix(g, &w.shape);
        let (gv, wv) = match (g.as_f32(), w.as_f32()) {
            (Some(a), Some(b)) => (a.to_vec(), b.to_vec()),
            _ => continue,
        };
        let (mut num, mut den) = (0f64, 0f64);
        for (i, (&a, &b)) in gv.iter().zip(&wv).enumerate() {
            if !a.is_finite() && b.is_finite() {
                return Err(CheckError::NonFinite {
                    case: case.to_string(),
                    output: name.clone(),
                    index: i,
                    value: a,
                    want: b,
                });
            }
            num += ((a - b) as f64).powi(2);
            den += (b as f64).powi(2);
        }
        let e = (num / den.max(1e-30)).sqrt();
        if e > tol {
            return Err(CheckError::Mismatch {
                case: case.to_string(),
                output: name.clone(),
                rel_l2: e,
                tol,
            });
        }
        worst = worst.max(e);
    }
    Ok(worst)
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardc_compiler::ir::{DType, TensorType};

    #[test]
    fn prefixes_take_the_leading_block() {
        let t = Tensor::f32(vec![2, 3, 2], (0..12).map(|x| x as f32).collect());
        let p = prefix(&t, &[1, 2, 2]);
        assert_eq!(p.as_f32().unwrap(), &[0.0, 1.0, 2.0, 3.0]);
        let p = prefix(&t, &[2, 1, 1]);
        assert_eq!(p.as_f32().unwrap(), &[0.0, 6.0]);
        let ids = Tensor::i32(vec![1, 4], vec![5, 6, 7, 8]);
        assert_eq!(prefix(&ids, &[1, 2]).as_i32().unwrap(), &[5, 6]);
    }

    /// A per-row program's prefix run equals the leading rows of the full run (its weight a
    /// parameter the reference reads from the inputs by name, whole in the prefix too), and the
    /// comparison catches a wrong row, a NaN and a shape that cannot be a prefix.
    #[test]
    fn a_prefix_reference_checks_the_leading_rows() {
        let build = |rows: usize| {
            let mut g = Graph::new();
            let x = g.input("x", TensorType::plain(DType::F32, &[rows, 3]));
            let w = g.param("w", TensorType::plain(DType::F32, &[3]));
            let y = g.add(Op::Add, &[x, w], "y").unwrap();
            g.set_output("y", y);
            g
        };
        let full = BTreeMap::from([
            (
                "x".to_string(),
                Tensor::f32(vec![4, 3], (0..12).map(|x| x as f32).collect()),
            ),
            ("w".to_string(), Tensor::f32(vec![3], vec![0.5, 1.0, -1.0])),
        ]);
        let (big, small) = (build(4), build(2));
        assert_eq!(small_inputs(&small, &full)["w"], full["w"]);
        let got = cpu_outputs("full", &big, &full).unwrap();
        assert_eq!(got["y"].as_f32().unwrap()[..3], [0.5, 2.0, 1.0]);
        let want = cpu_outputs("prefix", &small, &small_inputs(&small, &full)).unwrap();
        assert_eq!(compare("add", &got, &want, GpuDType::F32).unwrap(), 0.0);
        let mut bad = got.clone();
        let mut v = bad["y"].as_f32().unwrap().to_vec();
        v[4] += 1.0;
        bad.insert("y".into(), Tensor::f32(vec![4, 3], v.clone()));
        let e = compare("add", &bad, &want, GpuDType::Bf16).unwrap_err();
        assert!(matches!(e, CheckError::Mismatch { .. }), "{e}");
        v[4] = f32::NAN;
        bad.insert("y".into(), Tensor::f32(vec![4, 3], v));
        let e = compare("add", &bad, &want, GpuDType::Bf16).unwrap_err();
        assert!(e.to_string().contains("non-finite value NaN at 4"), "{e}");
        let short = BTreeMap::from([("y".to_string(), Tensor::f32(vec![1, 3], vec![0.0; 3]))]);
        let e = compare("add", &short, &want, GpuDType::F32).unwrap_err();
        assert!(matches!(e, CheckError::Shape { .. }), "{e}");
    }
}
