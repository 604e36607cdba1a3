//! The generator for fused elementwise kernels.
//!
//! A [`FusedExpr`] is a tree over input tensors (by index), f32 constants and the elementwise
//! ops of `elementwise.cu`. [`generate_fused_kernel`] turns it into a complete, self-contained
//! `.cu` source with one entry point:
//!
//! ```text
//! extern "C" __global__ void NAME(const T* in0, .., const T* in{k-1}, T* out, i64 n,
//!                                 i64 len0, .., i64 len{k-1})
//! ```
//!
//! where `k` = [`FusedExpr::num_inputs`], `n` is the output length and input `j` is read at
//! `in_j[i % len_j]`: an input whose shape is a suffix of the output's (a bias, a per-channel
//! scale) broadcasts; `len_j == n` is a plain elementwise read. Every `len_j` must be >= 1.
//! Evaluation is in f32 with one rounding to `T` on store; repeated sub-expressions are
//! computed once, in a `{name}_expr` device function of the loaded inputs. The entry point
//! hands its loaded inputs to `fused_elementwise` in `common.cuh` (the loop the hand-written
//! elementwise kernels share): grid-stride, any launch shape (`launch::vector_launch` gives one
//! thread per vector).
//!
//! Memory access: 16-byte vectors (`VecWidth<T>::N` elements) over the whole vectors of the
//! output when `out` and every loaded input are 16-byte aligned and every loaded `len_j` is `n`
//! or a multiple of `N`; scalar accesses for the remaining elements, or for all of them
//! otherwise. The broadcast index `i % len_j` advances with the grid stride (`DivMod` in
//! `common.cuh`): no 64-bit division in the loop.

use crate::registry::COMMON_CUH;
use crate::KernelDType;
use std::collections::HashMap;
use std::fmt::{self, Write as _};

/// Unary ops (same definitions as `elementwise.cu`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FusedUnary {
    /// GeLU, tanh approximation.
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

impl FusedUnary {
    /// Text name, as in the IR (`gelu_tanh`).
    pub fn name(self) -> &'static str {
        match self {
            FusedUnary::GeluTanh => "gelu_tanh",
            FusedUnary::GeluErf => "gelu_erf",
            FusedUnary::Silu => "silu",
            FusedUnary::Relu => "relu",
            FusedUnary::Exp => "exp",
            FusedUnary::Neg => "neg",
        }
    }
}

/// Binary ops.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FusedBinary {
    /// a + b.
    Add,
    /// a − b.
    Sub,
    /// a · b.
    Mul,
    /// a / b.
    Div,
}

impl FusedBinary {
    /// Text name (`add`).
    pub fn name(self) -> &'static str {
        match self {
            FusedBinary::Add => "add",
            FusedBinary::Sub => "sub",
            FusedBinary::Mul => "mul",
            FusedBinary::Div => "div",
        }
    }

    fn c_op(self) -> &'static str {
        match self {
            FusedBinary::Add => "+",
            FusedBinary::Sub => "-",
            FusedBinary::Mul => "*",
            FusedBinary::Div => "/",
        }
    }
}

/// An elementwise expression over the kernel's inputs.
///
/// ```
/// use shardc_kernels::{FusedExpr, FusedUnary};
/// // swiglu with a scale: silu(x0) * x1 * 0.5
/// let e = FusedExpr::unary(FusedUnary::Silu, FusedExpr::input(0))
///     * FusedExpr::input(1)
///     * FusedExpr::constant(0.5);
/// assert_eq!(e.to_string(), "mul(mul(silu(x0), x1), 0.5)");
/// assert_eq!(e.num_inputs(), 2);
/// ```
#[derive(Clone, Debug, PartialEq)]
pub enum FusedExpr {
    /// Input tensor `i` (kernel parameter `in{i}`).
    Input(usize),
    /// An f32 constant.
    Const(f32),
    /// `op(x)`.
    Unary(FusedUnary, Box<FusedExpr>),
    /// `op(a, b)`.
    Binary(FusedBinary, Box<FusedExpr>, Box<FusedExpr>),
}

impl FusedExpr {
    /// Input `i`.
    pub fn input(i: usize) -> FusedExpr {
        FusedExpr::Input(i)
    }
    /// Constant `c`.
    pub fn constant(c: f32) -> FusedExpr {
        FusedExpr::Const(c)
    }
    /// `op(x)`.
    pub fn unary(op: FusedUnary, x: FusedExpr) -> FusedExpr {
        FusedExpr::Unary(op, Box::new(x))
    }
    /// `op(a, b)`.
    pub fn binary(op: FusedBinary, a: FusedExpr, b: FusedExpr) -> FusedExpr {
        FusedExpr::Binary(op, Box::new(a), Box::new(b))
    }
    /// `x · c` (the IR's `Scale`).
    pub fn scale(x: FusedExpr, c: f32) -> FusedExpr {
        x * FusedExpr::constant(c)
    }

    /// Number of kernel inputs: one more than the largest input index (0 for a constant).
    pub fn num_inputs(&self) -> usize {
        match self {
            FusedExpr::Input(i) => i + 1,
            FusedExpr::Const(_) => 0,
            FusedExpr::Unary(_, x) => x.num_inputs(),
            FusedExpr::Binary(_, a, b) => a.num_inputs().max(b.num_inputs()),
        }
    }

    /// A deterministic entry-point name for this expression: `fused_<16 hex>_<dtype>`.
    pub fn kernel_name(&self, dtype: KernelDType) -> String {
        let hash = blake3::hash(self.to_string().as_bytes()).to_hex();
        format!("fused_{}_{}", &hash[..16], dtype.suffix())
    }
}

macro_rules! binary_operator {
    ($trait:ident, $method:ident, $op:ident) => {
        /// Builds `FusedExpr::Binary` with the matching [`FusedBinary`].
        impl std::ops::$trait for FusedExpr {
            type Output = FusedExpr;
            fn $method(self, rhs: FusedExpr) -> FusedExpr {
                FusedExpr::binary(FusedBinary::$op, self, rhs)
            }
        }
    };
}
binary_operator!(Add, add, Add);
binary_operator!(Sub, sub, Sub);
binary_operator!(Mul, mul, Mul);
binary_operator!(Div, div, Div);

impl fmt::Display for FusedExpr {
    /// `mul(silu(x0), x1)`; constants in Rust's shortest round-trip form.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FusedExpr::Input(i) => write!(f, "x{i}"),
            FusedExpr::Const(c) => write!(f, "{c:?}"),
            FusedExpr::Unary(op, x) => write!(f, "{}({x})", op.name()),
            FusedExpr::Binary(op, a, b) => write!(f, "{}({a}, {b})", op.name()),
        }
    }
}

/// An f32 literal NVRTC reads back bit-exactly.
fn c_float(c: f32) -> String {
    if c.is_finite() {
        // Debug is the shortest round-trip form and always has a '.' or an exponent.
        format!("{c:?}f")
    } else {
        format!("__int_as_float(0x{:08x})", c.to_bits())
    }
}

/// Emits SSA temporaries for a tree, sharing repeated sub-expressions.
struct Emitter {
    body: String,
    /// Display form of an already-emitted sub-expression -> its temporary.
    done: HashMap<String, String>,
    next: usize,
}

impl Emitter {
    /// The C expression naming `e`'s value (a variable or a literal), emitting code as needed.
    fn value(&mut self, e: &FusedExpr) -> String {
        match e {
            FusedExpr::Input(i) => format!("x{i}"),
            FusedExpr::Const(c) => c_float(*c),
            FusedExpr::Unary(..) | FusedExpr::Binary(..) => {
                let key = e.to_string();
                if let Some(t) = self.done.get(&key) {
                    return t.clone();
                }
                let rhs = match e {
                    FusedExpr::Unary(op, x) => format!("op_{}({})", op.name(), self.value(x)),
                    FusedExpr::Binary(op, a, b) => {
                        let (a, b) = (self.value(a), self.value(b));
                        format!("{a} {} {b}", op.c_op())
                    }
                    FusedExpr::Input(_) | FusedExpr::Const(_) => {
                        unreachable!("invariant: leaves are handled above")
                    }
                };
                let t = format!("t{}", self.next);
                self.next += 1;
                let _ = writeln!(self.body, "    const float {t} = {rhs};  // {e}");
                self.done.insert(key, t.clone());
                t
            }
        }
    }
}

fn used_inputs(e: &FusedExpr, used: &mut [bool]) {
    match e {
        FusedExpr::Input(i) => used[*i] = true,
        FusedExpr::Const(_) => {}
        FusedExpr::Unary(_, x) => used_inputs(x, used),
        FusedExpr::Binary(_, a, b) => {
            used_inputs(a, used);
            used_inputs(b, used);
        }
    }
}

/// A complete `.cu` source defining the single entry point `name` that computes `expr`
/// elementwise over `dtype` tensors (signature and broadcasting in the module docs).
///
/// `name` must be a C identifier (e.g. from [`FusedExpr::kernel_name`]); otherwise NVRTC rejects
/// the source with a [`KernelError::Compile`](crate::KernelError::Compile).
pub fn generate_fused_kernel(name: &str, expr: &FusedExpr, dtype: KernelDType) -> String {
    let k = expr.num_inputs();
    let t = dtype.c_type();
    let mut used = vec![false; k];
    used_inputs(expr, &mut used);

    let mut params: Vec<String> = (0..k).map(|j| format!("const {t}* in{j}")).collect();
    params.push(format!("{t}* out"));
    params.push("i64 n".to_owned());
    params.extend((0..k).map(|j| format!("i64 len{j}")));
    let loaded: Vec<usize> = (0..k).filter(|&j| used[j]).collect();

    let mut em = Emitter {
        body: String::new(),
        done: HashMap::new(),
        next: 0,
    };
    let result = em.value(expr);

    let mut src = String::new();
    let _ = writeln!(
        src,
        "// Generated by shardc-kernels: fused elementwise kernel."
    );
    let _ = writeln!(
        src,
        "// {name}: out[i] = {expr}   (dtype {dtype}, f32 math)"
    );
    let _ = writeln!(
        src,
        "// input j is read at in_j[i % len_j] (suffix broadcast); 16-byte vectors where aligned."
    );
    src.push_str(COMMON_CUH);
    if !COMMON_CUH.ends_with('\n') {
        src.push('\n');
    }
    let _ = writeln!(src);

    // The expression, a function of the loaded inputs.
    let args: Vec<String> = loaded.iter().map(|j| format!("float x{j}")).collect();
    let _ = writeln!(
        src,
        "__device__ __forceinline__ float {name}_expr({}) {{",
        args.join(", ")
    );
    src.push_str(&em.body);
    let _ = writeln!(src, "    return {result};");
    let _ = writeln!(src, "}}");
    let _ = writeln!(src);

    let ptrs: Vec<String> = loaded.iter().map(|j| format!("in{j}")).collect();
    let lens: Vec<String> = loaded.iter().map(|j| format!("len{j}")).collect();
    let lanes: Vec<String> = (0..loaded.len()).map(|k| format!("x[{k}]")).collect();
    let _ = writeln!(
        src,
        "extern \"C\" __global__ void {name}({}) {{",
        params.join(", ")
    );
    let (ins, lens) = if loaded.is_empty() {
        ("nullptr".to_owned(), "nullptr".to_owned())
    } else {
        let _ = writeln!(src, "    const {t}* in[] = {{{}}};", ptrs.join(", "));
        let _ = writeln!(src, "    const i64 len[] = {{{}}};", lens.join(", "));
        ("in".to_owned(), "len".to_owned())
    };
    let x = if loaded.is_empty() { "" } else { " x" };
    let _ = writeln!(
        src,
        "    fused_elementwise<{}, {t}>({ins}, {lens}, out, n, [](const float*{x}) {{ return {name}_expr({}); }});",
        loaded.len(),
        lanes.join(", ")
    );
    let _ = writeln!(src, "}}");
    src
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The generated part of a source named `name`: its expression function and entry point
    /// (after the pasted header).
    fn kernel_part<'a>(src: &'a str, name: &str) -> &'a str {
        let start = format!("__device__ __forceinline__ float {name}_expr(");
        &src[src
            .find(&start)
            .expect("invariant: has an expression function")..]
    }

    fn swiglu() -> FusedExpr {
        FusedExpr::unary(FusedUnary::Silu, FusedExpr::input(0)) * FusedExpr::input(1)
    }

    #[test]
    fn swiglu_bf16_golden() {
        const NAME: &str = "fused_swiglu_bf16";
        let src = generate_fused_kernel(NAME, &swiglu(), KernelDType::Bf16);
        let expected = "\
__device__ __forceinline__ float fused_swiglu_bf16_expr(float x0, float x1) {
    const float t0 = op_silu(x0);  // silu(x0)
    const float t1 = t0 * x1;  // mul(silu(x0), x1)
    return t1;
}

extern \"C\" __global__ void fused_swiglu_bf16(const bf16* in0, const bf16* in1, bf16* out, i64 n, i64 len0, i64 len1) {
    const bf16* in[] = {in0, in1};
    const i64 len[] = {len0, len1};
    fused_elementwise<2, bf16>(in, len, out, n, [](const float* x) { return fused_swiglu_bf16_expr(x[0], x[1]); });
}
";
        assert_eq!(kernel_part(&src, NAME), expected);
        assert!(src.starts_with("// Generated by shardc-kernels"));
        assert!(src.contains("__device__ __forceinline__ float bf16_to_f32"));
        assert!(!src.lines().any(|l| l.trim_start().starts_with("#include")));
    }

    #[test]
    fn bias_gelu_scale_f32_golden() {
        // gelu_tanh(x0 + bias) * 0.125, bias broadcast over rows
        let e = FusedExpr::scale(
            FusedExpr::unary(
                FusedUnary::GeluTanh,
                FusedExpr::input(0) + FusedExpr::input(1),
            ),
            0.125,
        );
        assert_eq!(e.to_string(), "mul(gelu_tanh(add(x0, x1)), 0.125)");
        let src = generate_fused_kernel("k", &e, KernelDType::F32);
        let expected = "\
__device__ __forceinline__ float k_expr(float x0, float x1) {
    const float t0 = x0 + x1;  // add(x0, x1)
    const float t1 = op_gelu_tanh(t0);  // gelu_tanh(add(x0, x1))
    const float t2 = t1 * 0.125f;  // mul(gelu_tanh(add(x0, x1)), 0.125)
    return t2;
}
";
        let part = kernel_part(&src, "k");
        assert_eq!(&part[..expected.len()], expected);
        assert!(
            part.contains("fused_elementwise<2, float>(in, len, out, n,"),
            "{part}"
        );
        assert!(!part.contains('%'), "no division per element: {part}");
    }

    #[test]
    fn shared_subexpressions_are_computed_once() {
        let s = FusedExpr::input(0) + FusedExpr::input(1);
        let e = s.clone() * FusedExpr::unary(FusedUnary::Exp, s);
        let src = generate_fused_kernel("k", &e, KernelDType::F32);
        assert_eq!(src.matches("x0 + x1;").count(), 1, "{src}");
        assert!(src.contains("const float t1 = op_exp(t0);"));
        assert!(src.contains("const float t2 = t0 * t1;"));
    }

    #[test]
    fn unused_inputs_keep_their_parameters() {
        // Input 0 is unused: it keeps its slot (so parameter positions follow indices) but is
        // not loaded.
        let e = FusedExpr::unary(FusedUnary::Neg, FusedExpr::input(1));
        assert_eq!(e.num_inputs(), 2);
        let src = generate_fused_kernel("k", &e, KernelDType::F32);
        assert!(src.contains(
            "(const float* in0, const float* in1, float* out, i64 n, i64 len0, i64 len1)"
        ));
        assert!(src.contains("const float* in[] = {in1};"));
        assert!(src.contains("const i64 len[] = {len1};"));
        assert!(src.contains("fused_elementwise<1, float>(in, len, out, n,"));
        assert!(src.contains("__device__ __forceinline__ float k_expr(float x1) {"));
    }

    #[test]
    fn constant_only_expression() {
        let e = FusedExpr::constant(1.0);
        assert_eq!(e.num_inputs(), 0);
        let src = generate_fused_kernel("k", &e, KernelDType::Bf16);
        assert!(src.contains("void k(bf16* out, i64 n) {"));
        assert!(src.contains("float k_expr() {\n    return 1.0f;\n}"));
        assert!(src.contains(
            "fused_elementwise<0, bf16>(nullptr, nullptr, out, n, [](const float*) { return k_expr(); });"
        ));
    }

    #[test]
    fn float_literals_round_trip() {
        assert_eq!(c_float(1.0), "1.0f");
        assert_eq!(c_float(1e-5), "1e-5f");
        assert_eq!(c_float(-0.0), "-0.0f");
        assert_eq!(c_float(0.1), "0.1f");
        assert_eq!(c_float(f32::INFINITY), "__int_as_float(0x7f800000)");
        assert_eq!(c_float(f32::NEG_INFINITY), "__int_as_float(0xff800000)");
        for c in [0.1_f32, 1.0 / 3.0, 3.402_823_5e38, 1e-45, 0.044715] {
            let lit = c_float(c);
            let back: f32 = lit
                .trim_end_matches('f')
                .parse()
                .expect("invariant: a number");
            assert_eq!(back.to_bits(), c.to_bits(), "{lit}");
        }
    }

    #[test]
    fn kernel_names_are_deterministic_and_distinct() {
        let a = swiglu().kernel_name(KernelDType::Bf16);
        assert_eq!(a, swiglu().kernel_name(KernelDType::Bf16));
        assert!(a.starts_with("fused_") && a.ends_with("_bf16") && a.len() == 6 + 16 + 5);
        let other = FusedExpr::input(0) + FusedExpr::input(1);
        assert_ne!(
            a.trim_end_matches("_bf16"),
            other
                .kernel_name(KernelDType::Bf16)
                .trim_end_matches("_bf16")
        );
        assert!(a.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'));
    }
}
