//! Collective matmuls (`AgMatMul`, `MatMulRs`) as rings of partial GEMMs over a
//! [`Communicator`]'s point-to-point `send`/`recv`: each step starts the transfer of one chunk
//! and computes the GEMM of another, which is how a GPU backend overlaps communication with
//! compute. On the CPU the steps run in order; the results equal `MatMul` of `AllGather` and
//! `ReduceScatter` of `MatMul` up to the order of the partial sums.
//!
//! Pre: `dim` is a row dim of the product (not the last), the communicator's size is `parts`,
//! and every rank of the group runs the same op with the same shapes.

use super::collective::Wrap;
use super::{f32_of, layout, linalg, shape_err};
use crate::comm::Communicator;
use crate::{RuntimeError, Tensor};
use shardc_compiler::ir::Op;

/// The ring of a collective matmul: the axis' communicator (of `parts` ranks), the ring dim,
/// whether `w` is transposed, and how a communicator error names the node.
struct Ring<'a> {
    comm: &'a dyn Communicator,
    dim: usize,
    parts: usize,
    transpose_b: bool,
    wrap: Wrap<'a>,
}

/// The collective matmul `op` (`AgMatMul` or `MatMulRs`) of `x` and `w` over `comm`.
pub(crate) fn ring_matmul(
    comm: &dyn Communicator,
    op: &Op,
    x: &Tensor,
    w: &Tensor,
    wrap: Wrap,
) -> Result<Tensor, RuntimeError> {
    let m = op
        .ring_matmul()
        .expect("invariant: called for AgMatMul and MatMulRs only");
    let ring = Ring {
        comm,
        dim: m.dim,
        parts: m.parts,
        transpose_b: m.transpose_b,
        wrap,
    };
    if m.gather {
        ag_matmul(&ring, x, w)
    } else {
        matmul_rs(&ring, x, w)
    }
}

fn check(op: &'static str, ring: &Ring, x: &Tensor) -> Result<(), RuntimeError> {
    let (comm, dim, parts) = (ring.comm, ring.dim, ring.parts);
    if comm.size() != parts {
        return Err(RuntimeError::AxisSize {
            axis: comm.name().to_string(),
            expected: parts,
            found: comm.size(),
        });
    }
    if parts == 0 || dim + 1 >= x.shape.len() {
        return Err(shape_err(op, &[x], "the ring dim must be a row dim of x"));
    }
    Ok(())
}

/// `AgMatMul`: `matmul(all_gather(x, dim), w)`. Step `s` multiplies the chunk of rank
/// `r − s` while that chunk travels on to rank `r + 1`; the products are concatenated along
/// `dim` in rank order.
fn ag_matmul(ring: &Ring, x: &Tensor, w: &Tensor) -> Result<Tensor, RuntimeError> {
    const OP: &str = "ag_matmul";
    check(OP, ring, x)?;
    let Ring {
        comm,
        dim,
        parts: n,
        transpose_b,
        wrap,
    } = *ring;
    let r = comm.rank();
    let mut cur = x.clone();
    let mut src = r;
    let mut products: Vec<Option<Tensor>> = (0..n).map(|_| None).collect();
    for s in 0..n {
        if s + 1 < n {
            comm.send(f32_of(OP, &cur, 0)?, (r + 1) % n).map_err(wrap)?;
        }
        products[src] = Some(linalg::matmul(&cur, w, transpose_b)?);
        if s + 1 < n {
            let mut buf = vec![0.0f32; x.numel()];
            comm.recv(&mut buf, (r + n - 1) % n).map_err(wrap)?;
            cur = Tensor::f32(x.shape.clone(), buf);
            src = (src + n - 1) % n;
        }
    }
    let parts: Vec<&Tensor> = products
        .iter()
        .map(|p| p.as_ref().expect("invariant: every chunk was multiplied"))
        .collect();
    layout::concat(&parts, dim)
}

/// `MatMulRs`: `reduce_scatter(matmul(x, w), dim)`. Step `s` multiplies rows chunk
/// `r − s − 1` of `x`, adds the partial sum of that chunk received from rank `r − 1`, and
/// passes it on to rank `r + 1`; after `parts` steps rank `r` holds the full sum of chunk `r`.
fn matmul_rs(ring: &Ring, x: &Tensor, w: &Tensor) -> Result<Tensor, RuntimeError> {
    const OP: &str = "matmul_rs";
    check(OP, ring, x)?;
    let (comm, dim, n, wrap) = (ring.comm, ring.dim, ring.parts, ring.wrap);
    if x.shape[dim] % n != 0 {
        return Err(shape_err(
            OP,
            &[x],
            "the ring dim does not divide by the axis size",
        ));
    }
    let r = comm.rank();
    let chunk = x.shape[dim] / n;
    for s in 0..n {
        let c = (r + 2 * n - s - 1) % n;
        let xs = layout::slice(x, dim, c * chunk, chunk)?;
        let mut p = linalg::matmul(&xs, w, ring.transpose_b)?;
        if s > 0 {
            let mut buf = vec![0.0f32; p.numel()];
            comm.recv(&mut buf, (r + n - 1) % n).map_err(wrap)?;
            if let crate::Buffer::F32(v) = &mut p.data {
                for (a, b) in v.iter_mut().zip(&buf) {
                    *a += b;
                }
            }
        }
        if s + 1 < n {
            comm.send(f32_of(OP, &p, 0)?, (r + 1) % n).map_err(wrap)?;
        } else {
            return Ok(p);
        }
    }
    unreachable!("invariant: the last step returns")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::thread::group;
    use crate::cpu::collective;
    use crate::rank::on_threads;
    use std::time::Duration;

    fn data(seed: usize, n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (((i * 7919 + seed * 104_729) % 1000) as f32 / 500.0) - 1.0)
            .collect()
    }

    /// Each rank runs `f` on its communicator; the results in rank order.
    fn on_ranks<F>(n: usize, f: F) -> Vec<(Tensor, Tensor)>
    where
        F: Fn(&dyn Communicator, usize) -> (Tensor, Tensor) + Sync,
    {
        let comms = group("tp", n, Duration::from_secs(10));
        on_threads(comms.into_iter().enumerate(), |(r, c)| f(&c, r))
            .into_iter()
            .map(|h| h.expect("rank thread"))
            .collect()
    }

    fn close(a: &Tensor, b: &Tensor) {
        assert_eq!(a.shape, b.shape);
        let (x, y) = (a.as_f32().expect("f32"), b.as_f32().expect("f32"));
        for (p, q) in x.iter().zip(y) {
            assert!((p - q).abs() <= 1e-5 * (1.0 + p.abs()), "{p} vs {q}");
        }
    }

    #[test]
    fn rings_equal_gather_then_gemm_and_gemm_then_scatter() {
        fn wrap(e: crate::comm::CommError) -> RuntimeError {
            RuntimeError::Comm {
                node: shardc_compiler::ir::ValueId(0),
                name: String::new(),
                op: "test",
                source: Box::new(e),
            }
        }
        for (n, dim) in [(2, 1), (3, 1), (3, 0), (4, 1)] {
            let (b, t, k, m) = (if dim == 0 { n } else { 2 }, 3 * n, 5, 7);
            for tb in [false, true] {
                let wshape = if tb { vec![m, k] } else { vec![k, m] };
                let outs = on_ranks(n, |c, r| {
                    let w = Tensor::f32(wshape.clone(), data(99, k * m));
                    // AgMatMul: this rank's rows chunk.
                    let mut xs = vec![b, t, k];
                    xs[dim] /= n;
                    let x = Tensor::f32(xs.clone(), data(r, xs.iter().product()));
                    let rg = Ring {
                        comm: c,
                        dim,
                        parts: n,
                        transpose_b: tb,
                        wrap: &wrap,
                    };
                    let ring = ag_matmul(&rg, &x, &w).expect("ring");
                    let tp = || "tp".to_string();
                    let ag = Op::AllGather {
                        axis: tp(),
                        dim,
                        parts: n,
                    };
                    let g = collective::collective(c, &ag, &x, &wrap).expect("gather");
                    let plain = linalg::matmul(&g, &w, tb).expect("gemm");
                    close(&ring, &plain);
                    // MatMulRs: full rows, partial sums.
                    let x = Tensor::f32(vec![b, t, k], data(10 + r, b * t * k));
                    let ring = matmul_rs(&rg, &x, &w).expect("ring");
                    let p = linalg::matmul(&x, &w, tb).expect("gemm");
                    let rs = Op::ReduceScatter {
                        axis: tp(),
                        dim,
                        parts: n,
                    };
                    let plain = collective::collective(c, &rs, &p, &wrap).expect("scatter");
                    (ring, plain)
                });
                for (ring, plain) in &outs {
                    close(ring, plain);
                }
            }
        }
    }
}
