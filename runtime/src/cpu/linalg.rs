//! Matrix multiplication: `a[.., M, K] × b` with `b` `[K, N]`, `[N, K]` (`transpose_b`), or
//! batched `[E, K, N]` / `[E, N, K]` with `a` `[E, .., M, K]`. Every form is one strided
//! `sgemm` per batch entry (the transposed layout is a stride swap, never a copy).

use super::{f32_of, prod, shape_err};
use crate::{RuntimeError, Tensor};
use rayon::prelude::*;

/// Multiply-adds above which batched matmuls run their batch entries in parallel.
const PAR_FLOPS: usize = 1 << 18;

/// An element type `matrixmultiply` multiplies: f32 (`sgemm`) or f64 (`dgemm`).
pub(crate) trait GemmElem: Copy {
    /// Zero.
    const ZERO: Self;

    /// `matrixmultiply`'s gemm with alpha = 1 and beta = 0 (`c` is only written).
    ///
    /// # Safety
    /// As `matrixmultiply::sgemm`: every element reached through the pointers and strides is
    /// in bounds, and `c` aliases neither input.
    unsafe fn gemm_raw(
        m: usize,
        k: usize,
        n: usize,
        a: (*const Self, isize, isize),
        b: (*const Self, isize, isize),
        c: (*mut Self, isize, isize),
    );
}

/// `impl GemmElem for $t` calling `matrixmultiply::$gemm`.
macro_rules! gemm_elem {
    ($t:ty, $gemm:ident) => {
        impl GemmElem for $t {
            const ZERO: $t = 0.0;

            unsafe fn gemm_raw(
                m: usize,
                k: usize,
                n: usize,
                a: (*const $t, isize, isize),
                b: (*const $t, isize, isize),
                c: (*mut $t, isize, isize),
            ) {
                // SAFETY: forwarded from the caller (the trait contract).
                unsafe {
                    matrixmultiply::$gemm(
                        m, k, n, 1.0, a.0, a.1, a.2, b.0, b.1, b.2, 0.0, c.0, c.1, c.2,
                    )
                }
            }
        }
    };
}

gemm_elem!(f32, sgemm);
gemm_elem!(f64, dgemm);

/// `c[m×n] (row stride ldc) = a · b` with `a` `m×k` at element strides `sa` (row, col) and `b`
/// `k×n` at `sb`; elements of `c` outside the `m×n` block are left alone.
#[allow(clippy::too_many_arguments)]
pub(crate) fn strided_gemm<T: GemmElem>(
    m: usize,
    k: usize,
    n: usize,
    a: &[T],
    sa: (usize, usize),
    b: &[T],
    sb: (usize, usize),
    c: &mut [T],
    ldc: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    let last =
        |rows: usize, cols: usize, (rs, cs): (usize, usize)| (rows - 1) * rs + (cols - 1) * cs;
    assert!(
        ldc >= n && last(m, n, (ldc, 1)) < c.len(),
        "invariant: strided gemm result in bounds"
    );
    if k == 0 {
        for row in c.chunks_mut(ldc).take(m) {
            row[..n].fill(T::ZERO);
        }
        return;
    }
    assert!(
        last(m, k, sa) < a.len() && last(k, n, sb) < b.len(),
        "invariant: strided gemm operands in bounds"
    );
    let s = |x: usize| x as isize;
    // SAFETY: the asserts bound the largest index the gemm reads in `a` and `b` and writes in
    // `c`; `c` is a unique borrow, so it aliases neither input.
    unsafe {
        T::gemm_raw(
            m,
            k,
            n,
            (a.as_ptr(), s(sa.0), s(sa.1)),
            (b.as_ptr(), s(sb.0), s(sb.1)),
            (c.as_mut_ptr(), s(ldc), 1),
        );
    }
}

/// `c[m×n] = a[m×k] · b`, row-major `a` and `c`; `b` is `[k, n]` or, with `tb`, `[n, k]`.
pub(crate) fn gemm(m: usize, k: usize, n: usize, a: &[f32], b: &[f32], tb: bool, c: &mut [f32]) {
    assert!(
        a.len() >= m * k && b.len() >= k * n && c.len() >= m * n,
        "invariant: gemm operand lengths"
    );
    let sb = if tb { (1, k) } else { (n, 1) };
    strided_gemm(m, k, n, a, (k, 1), b, sb, c, n);
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
