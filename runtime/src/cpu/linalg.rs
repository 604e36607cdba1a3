//! Matrix multiplication: `a[.., M, K] × b` with `b` `[K, N]`, `[N, K]` (`transpose_b`), or
//! batched `[E, K, N]` / `[E, N, K]` with `a` `[E, .., M, K]`. Every form is one strided
//! `sgemm` per batch entry (the transposed layout is a stride swap, never a copy).

use super::{f32_of, prod, shape_err};
use crate::{RuntimeError, Tensor};
use rayon::prelude::*;

/// Multiply-adds above which batched matmuls run their batch entries in parallel.
const PAR_FLOPS: usize = 1 << 18;

/// `c[m×n] = a[m×k] · b`, row-major `a` and `c`; `b` is `[k, n]` or, with `tb`, `[n, k]`.
pub(crate) fn gemm(m: usize, k: usize, n: usize, a: &[f32], b: &[f32], tb: bool, c: &mut [f32]) {
    assert!(
        a.len() >= m * k && b.len() >= k * n && c.len() >= m * n,
        "invariant: gemm operand lengths"
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        c[..m * n].fill(0.0);
        return;
    }
    let (rsb, csb) = if tb { (1, k as isize) } else { (n as isize, 1) };
    // SAFETY: the assert above bounds every index sgemm touches: a is m×k with strides (k, 1),
    // b is k×n with strides (rsb, csb) inside k·n elements, c is m×n with strides (n, 1).
    // `c` is a unique borrow, so it aliases neither input; beta = 0 means c is only written.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.as_ptr(),
            k as isize,
            1,
            b.as_ptr(),
            rsb,
            csb,
            0.0,
            c.as_mut_ptr(),
            n as isize,
            1,
        );
    }
}

/// `MatMul { transpose_b }`.
pub(crate) fn matmul(a: &Tensor, b: &Tensor, transpose_b: bool) -> Result<Tensor, RuntimeError> {
    const OP: &str = "matmul";
    let ad = f32_of(OP, a, 0)?;
    let bd = f32_of(OP, b, 1)?;
    let (ar, br) = (a.shape.len(), b.shape.len());
    if ar < 2 || !(br == 2 || br == 3) {
        return Err(shape_err(
            OP,
            &[a, b],
            "a must have rank >= 2 and b rank 2 or 3",
        ));
    }
    let (k, n) = if transpose_b {
        (b.shape[br - 1], b.shape[br - 2])
    } else {
        (b.shape[br - 2], b.shape[br - 1])
    };
    if a.shape[ar - 1] != k {
        return Err(shape_err(OP, &[a, b], "contracted dims differ"));
    }
    let mut shape = a.shape.clone();
    shape[ar - 1] = n;
    let mut out = vec![0.0f32; prod(&shape)];
    if br == 2 {
        let rows = prod(&a.shape[..ar - 1]);
        gemm(rows, k, n, ad, bd, transpose_b, &mut out);
    } else {
        let e = b.shape[0];
        if ar < 3 || a.shape[0] != e {
            return Err(shape_err(
                OP,
                &[a, b],
                "batched operands need the same leading dim",
            ));
        }
        let rows = prod(&a.shape[1..ar - 1]);
        let (a_step, b_step, c_step) = (rows * k, k * n, rows * n);
        if c_step == 0 {
            return Ok(Tensor::f32(shape, out));
        }
        let one = |(i, c): (usize, &mut [f32])| {
            gemm(
                rows,
                k,
                n,
                &ad[i * a_step..],
                &bd[i * b_step..],
                transpose_b,
                c,
            )
        };
        if e * rows * k * n >= PAR_FLOPS {
            out.par_chunks_mut(c_step).enumerate().for_each(one);
        } else {
            out.chunks_mut(c_step).enumerate().for_each(one);
        }
    }
    Ok(Tensor::f32(shape, out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(m: usize, k: usize, n: usize, a: &[f32], b: &[f32], tb: bool) -> Vec<f64> {
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k)
                    .map(|p| {
                        let bv = if tb { b[j * k + p] } else { b[p * n + j] };
                        a[i * k + p] as f64 * bv as f64
                    })
                    .sum();
            }
        }
        c
    }

    #[test]
    fn gemm_matches_naive_both_layouts() {
        let (m, k, n) = (5, 7, 3);
        let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.71).cos()).collect();
        for tb in [false, true] {
            let mut c = vec![f32::NAN; m * n];
            gemm(m, k, n, &a, &b, tb, &mut c);
            for (x, y) in c.iter().zip(naive(m, k, n, &a, &b, tb)) {
                assert!((*x as f64 - y).abs() < 1e-5, "{x} vs {y}");
            }
        }
    }

    #[test]
    fn gemm_with_empty_contraction_writes_zeros() {
        let mut c = vec![f32::NAN; 6];
        gemm(2, 0, 3, &[], &[], false, &mut c);
        assert_eq!(c, vec![0.0; 6]);
    }
}
