//! Strided-copy descriptors for `layout.cu`'s `strided_copy_b{2,4}`: one kernel moves the data
//! of transpose, slice, concat, repeat and the chunk packing around collectives.
//!
//! Post-condition of every constructor: applying the spec (on the device, or with
//! [`StridedSpec::apply_host`] in tests) gives exactly the CPU reference layout op.

use cudarc::driver::DeviceRepr;

/// Largest rank a spec supports (`SHARDC_MAX_RANK` in layout.cu).
pub const MAX_RANK: usize = 8;

/// Mirror of `struct StridedSpec` in layout.cu (`#[repr(C)]`, all `i64`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StridedSpec {
    rank: i64,
    n: i64,
    in_base: i64,
    out_base: i64,
    shape: [i64; MAX_RANK],
    in_stride: [i64; MAX_RANK],
    in_div: [i64; MAX_RANK],
    out_stride: [i64; MAX_RANK],
}

// SAFETY: `#[repr(C)]` plain-old-data of `i64`s, laid out exactly as the C struct.
unsafe impl DeviceRepr for StridedSpec {}

/// Row-major strides (elements) of `shape`.
pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1usize; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * shape[d + 1];
    }
    s
}

/// A spec's rank is above [`MAX_RANK`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankTooHigh(pub usize);

impl StridedSpec {
    /// The general form: iterate `shape`; read `in[in_base + Σ (i_d / in_div_d)·in_stride_d]`,
    /// write `out[out_base + Σ i_d·out_stride_d]`.
    pub fn new(
        shape: &[usize],
        in_stride: &[usize],
        in_div: &[usize],
        out_stride: &[usize],
        in_base: usize,
        out_base: usize,
    ) -> Result<StridedSpec, RankTooHigh> {
        let r = shape.len();
        if r > MAX_RANK {
            return Err(RankTooHigh(r));
        }
        debug_assert!(in_stride.len() == r && in_div.len() == r && out_stride.len() == r);
        let fill = |v: &[usize], pad: i64| {
            let mut a = [pad; MAX_RANK];
            for (d, &x) in v.iter().enumerate() {
                a[d] = x as i64;
            }
            a
        };
        Ok(StridedSpec {
            rank: r as i64,
            n: shape.iter().product::<usize>() as i64,
            in_base: in_base as i64,
            out_base: out_base as i64,
            shape: fill(shape, 1),
            in_stride: fill(in_stride, 0),
            in_div: fill(in_div, 1),
            out_stride: fill(out_stride, 0),
        })
    }

    /// Number of elements copied.
    pub fn len(&self) -> usize {
        self.n as usize
    }

    /// True when nothing is copied.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// `out = transpose(x, perm)`: output dim i is input dim `perm[i]`.
    pub fn transpose(in_shape: &[usize], perm: &[usize]) -> Result<StridedSpec, RankTooHigh> {
        let is = contiguous_strides(in_shape);
        let out_shape: Vec<usize> = perm.iter().map(|&p| in_shape[p]).collect();
        let in_stride: Vec<usize> = perm.iter().map(|&p| is[p]).collect();
        let ones = vec![1; perm.len()];
        Self::new(
            &out_shape,
            &in_stride,
            &ones,
            &contiguous_strides(&out_shape),
            0,
            0,
        )
    }

    /// `out = x[.., start .. start + len, ..]` along `dim`.
    pub fn slice(
        in_shape: &[usize],
        dim: usize,
        start: usize,
        len: usize,
    ) -> Result<StridedSpec, RankTooHigh> {
        let is = contiguous_strides(in_shape);
        let mut out_shape = in_shape.to_vec();
        out_shape[dim] = len;
        let ones = vec![1; in_shape.len()];
        Self::new(
            &out_shape,
            &is,
            &ones,
            &contiguous_strides(&out_shape),
            start * is[dim],
            0,
        )
    }

    /// Copies all of `x` (shape `in_shape`) into `out` (shape `out_shape`) at `offset` along
    /// `dim` (one operand of a concat).
    pub fn place(
        in_shape: &[usize],
        out_shape: &[usize],
        dim: usize,
        offset: usize,
    ) -> Result<StridedSpec, RankTooHigh> {
        let os = contiguous_strides(out_shape);
        let ones = vec![1; in_shape.len()];
        Self::new(
            in_shape,
            &contiguous_strides(in_shape),
            &ones,
            &os,
            0,
            offset * os[dim],
        )
    }

    /// `out = repeat_interleave(x, times, dim)`.
    pub fn repeat(
        in_shape: &[usize],
        dim: usize,
        times: usize,
    ) -> Result<StridedSpec, RankTooHigh> {
        let mut out_shape = in_shape.to_vec();
        out_shape[dim] *= times;
        let mut div = vec![1; in_shape.len()];
        div[dim] = times;
        Self::new(
            &out_shape,
            &contiguous_strides(in_shape),
            &div,
            &contiguous_strides(&out_shape),
            0,
            0,
        )
    }

    /// Packs `x` (shape `shape`) into `parts` contiguous chunks along `dim` (chunk j is
    /// row-major over `shape` with `dim` divided), as the CPU `pack_chunks`.
    pub fn pack_chunks(
        shape: &[usize],
        dim: usize,
        parts: usize,
    ) -> Result<StridedSpec, RankTooHigh> {
        let (outer, mid, inner) = split3(shape, dim);
        let c = mid / parts;
        // iterate [parts, outer, c * inner]
        Self::new(
            &[parts, outer, c * inner],
            &[c * inner, mid * inner, 1],
            &[1, 1, 1],
            &[outer * c * inner, c * inner, 1],
            0,
            0,
        )
    }

    /// The inverse: `parts` contiguous chunks of shape `chunk_shape` concatenated along `dim`,
    /// as the CPU `unpack_chunks`.
    pub fn unpack_chunks(
        chunk_shape: &[usize],
        dim: usize,
        parts: usize,
    ) -> Result<StridedSpec, RankTooHigh> {
        let (outer, c, inner) = split3(chunk_shape, dim);
        // iterate [outer, parts, c * inner]
        Self::new(
            &[outer, parts, c * inner],
            &[c * inner, outer * c * inner, 1],
            &[1, 1, 1],
            &[parts * c * inner, c * inner, 1],
            0,
            0,
        )
    }

    /// The copy on the host (tests and documentation of the semantics).
    pub fn apply_host<T: Copy>(&self, input: &[T], out: &mut [T]) {
        let r = self.rank as usize;
        for i in 0..self.n {
            let (mut rem, mut src, mut dst) = (i, self.in_base, self.out_base);
            for d in (0..r).rev() {
                let idx = rem % self.shape[d];
                rem /= self.shape[d];
                src += (idx / self.in_div[d]) * self.in_stride[d];
                dst += idx * self.out_stride[d];
            }
            out[dst as usize] = input[src as usize];
        }
    }
}

/// `(prod(shape[..dim]), shape[dim], prod(shape[dim+1..]))`.
pub fn split3(shape: &[usize], dim: usize) -> (usize, usize, usize) {
    (
        shape[..dim].iter().product(),
        shape[dim],
        shape[dim + 1..].iter().product(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::layout;
    use crate::Tensor;

    fn iota(shape: &[usize]) -> Tensor {
        let n = shape.iter().product::<usize>();
        Tensor::f32(shape.to_vec(), (0..n).map(|i| i as f32).collect())
    }

    fn run(spec: &StridedSpec, x: &Tensor, out_len: usize) -> Vec<f32> {
        let mut out = vec![f32::NAN; out_len];
        spec.apply_host(x.as_f32().unwrap(), &mut out);
        out
    }

    #[test]
    fn transpose_matches_cpu() {
        let x = iota(&[2, 3, 5, 4]);
        for perm in [[0, 2, 1, 3], [3, 2, 1, 0], [1, 0, 3, 2]] {
            let want = layout::transpose(&x, &perm).unwrap();
            let spec = StridedSpec::transpose(&x.shape, &perm).unwrap();
            assert_eq!(
                run(&spec, &x, x.numel()),
                want.as_f32().unwrap(),
                "{perm:?}"
            );
        }
    }

    #[test]
    fn slice_place_repeat_match_cpu() {
        let x = iota(&[3, 7, 2]);
        let want = layout::slice(&x, 1, 2, 4).unwrap();
        let spec = StridedSpec::slice(&x.shape, 1, 2, 4).unwrap();
        assert_eq!(run(&spec, &x, 24), want.as_f32().unwrap());

        let y = iota(&[3, 2, 2]);
        let want = layout::concat(&[&x, &y], 1).unwrap();
        let mut out = vec![f32::NAN; want.numel()];
        let out_shape = want.shape.clone();
        StridedSpec::place(&x.shape, &out_shape, 1, 0)
            .unwrap()
            .apply_host(x.as_f32().unwrap(), &mut out);
        StridedSpec::place(&y.shape, &out_shape, 1, 7)
            .unwrap()
            .apply_host(y.as_f32().unwrap(), &mut out);
        assert_eq!(out, want.as_f32().unwrap());

        let want = layout::repeat(&x, 1, 3).unwrap();
        let spec = StridedSpec::repeat(&x.shape, 1, 3).unwrap();
        assert_eq!(run(&spec, &x, want.numel()), want.as_f32().unwrap());
    }

    #[test]
    fn pack_and_unpack_match_cpu() {
        let shape = [2, 6, 3];
        let x = iota(&shape);
        let data = x.as_f32().unwrap();
        for parts in [1, 2, 3, 6] {
            let want = layout::pack_chunks(data, &shape, 1, parts);
            let packed = run(&StridedSpec::pack_chunks(&shape, 1, parts).unwrap(), &x, 36);
            assert_eq!(packed, want);
            let chunk = [2, 6 / parts, 3];
            let p = Tensor::f32(vec![36], packed);
            let unpacked = run(
                &StridedSpec::unpack_chunks(&chunk, 1, parts).unwrap(),
                &p,
                36,
            );
            assert_eq!(unpacked, layout::unpack_chunks(&want, &chunk, 1, parts));
            assert_eq!(unpacked, data);
        }
    }

    #[test]
    fn rank_limit_and_padding() {
        assert_eq!(
            StridedSpec::transpose(&[1; 9], &[0, 1, 2, 3, 4, 5, 6, 7, 8]),
            Err(RankTooHigh(9))
        );
        let s = StridedSpec::slice(&[4], 0, 1, 2).unwrap();
        assert_eq!((s.len(), s.in_base, s.shape[1], s.in_div[7]), (2, 1, 1, 1));
        // 8 i64 scalars... matches the C layout: 4 + 4·8 fields of 8 bytes.
        assert_eq!(std::mem::size_of::<StridedSpec>(), (4 + 4 * MAX_RANK) * 8);
    }
}
