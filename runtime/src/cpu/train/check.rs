//! Test support: a seeded generator of random tensors and the finite-difference check every
//! gradient kernel is tested with.
//!
//! `check_vjp` compares a vector-Jacobian product `g = Jᵀ·dy` with the directional derivative
//! of the forward kernel along random directions `e`: `⟨g, e⟩ = ⟨dy, J·e⟩`, where `J·e` is a
//! Richardson-extrapolated central difference (step h and h/2, error O(h⁴)), with the dot
//! products in f64. Float32 forward kernels limit the check to about 1e-5 relative.

use crate::Tensor;

/// A small deterministic generator (SplitMix64).
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03)
    }
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    pub(crate) fn uniform(&mut self) -> f32 {
        ((self.next() >> 40) as f64 / (1u64 << 24) as f64 * 2.0 - 1.0) as f32
    }
}

/// A tensor of uniform values in `[-scale, scale)`.
pub(crate) fn rand_tensor(rng: &mut Rng, shape: &[usize], scale: f32) -> Tensor {
    let n = shape.iter().product();
    Tensor::f32(
        shape.to_vec(),
        (0..n).map(|_| rng.uniform() * scale).collect(),
    )
}

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
}

/// Checks `grad` (the gradient wrt `inputs[wrt]` given upstream `dy`) against finite
/// differences of `forward` along three random directions.
pub(crate) fn check_vjp(
    what: &str,
    inputs: &[Tensor],
    wrt: usize,
    dy: &Tensor,
    grad: &Tensor,
    forward: impl Fn(&[Tensor]) -> Tensor,
) {
    check_vjp_masked(what, inputs, wrt, dy, grad, None, forward)
}

/// [`check_vjp`] along directions that are zero where `mask` is false (elements at which the
/// forward op is not differentiable, or where the gradient is defined as zero).
pub(crate) fn check_vjp_masked(
    what: &str,
    inputs: &[Tensor],
    wrt: usize,
    dy: &Tensor,
    grad: &Tensor,
    mask: Option<&[bool]>,
    forward: impl Fn(&[Tensor]) -> Tensor,
) {
    assert_eq!(grad.shape, inputs[wrt].shape, "{what}: gradient shape");
    let mut rng = Rng::new(0xC0FFEE ^ what.len() as u64);
    let g = grad.as_f32().expect("f32 gradient");
    let dyd = dy.as_f32().expect("f32 dy");
    let base = inputs[wrt].as_f32().expect("f32 input").to_vec();
    let shape = inputs[wrt].shape.clone();
    // Worst-case rounding of ⟨dy, F(x)⟩ in f32, for the tolerance.
    let f0 = forward(inputs);
    let scale: f64 = f0
        .as_f32()
        .expect("f32 forward")
        .iter()
        .zip(dyd)
        .map(|(&f, &d)| (f as f64 * d as f64).abs())
        .sum();
    let h = 5e-2f32;
    for _ in 0..3 {
        let e: Vec<f32> = (0..base.len())
            .map(|i| {
                let x = rng.uniform();
                if mask.is_some_and(|m| !m[i]) {
                    0.0
                } else {
                    x
                }
            })
            .collect();
        let directional = |h: f32| -> f64 {
            let at = |s: f32| -> f64 {
                let mut xs = inputs.to_vec();
                let shifted: Vec<f32> = base.iter().zip(&e).map(|(&x, &d)| x + s * d).collect();
                xs[wrt] = Tensor::f32(shape.clone(), shifted);
                dot(forward(&xs).as_f32().expect("f32 forward"), dyd)
            };
            (at(h) - at(-h)) / (2.0 * h as f64)
        };
        // Richardson extrapolation of the central difference: error O(h⁴).
        let (d1, d2) = (directional(h), directional(h / 2.0));
        let fd = (4.0 * d2 - d1) / 3.0;
        let an = dot(g, &e);
        let rounding = 3.0 * f32::EPSILON as f64 * scale / h as f64;
        let tol = rounding + 2e-4 * an.abs().max(fd.abs()) + 1e-7;
        assert!(
            (an - fd).abs() <= tol,
            "{what}: analytic ⟨g, e⟩ = {an}, finite difference {fd} (tolerance {tol:.2e})"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::elementwise;
    use shardc_compiler::ir::UnaryOp;

    fn silu_case(wrong: f32) {
        let mut rng = Rng::new(7);
        let x = rand_tensor(&mut rng, &[4, 8], 2.0);
        let dy = rand_tensor(&mut rng, &[4, 8], 1.0);
        let g = crate::cpu::train::basic::unary_grad(UnaryOp::Silu, &x, &dy).unwrap();
        let g = Tensor::f32(
            g.shape.clone(),
            g.as_f32().unwrap().iter().map(|v| v * wrong).collect(),
        );
        check_vjp("silu", &[x], 0, &dy, &g, |xs| {
            elementwise::unary(UnaryOp::Silu, &xs[0]).unwrap()
        });
    }

    #[test]
    fn accepts_the_right_gradient() {
        silu_case(1.0);
    }

    #[test]
    #[should_panic(expected = "finite difference")]
    fn rejects_a_gradient_one_percent_off() {
        silu_case(1.01);
    }
}
