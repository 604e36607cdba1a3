//! The rewriter's cost: per-rank time from a first roofline model plus a weighted
//! activation-memory term.
//!
//! - Compute: each kernel costs a launch floor plus `max(flops / peak, bytes / HBM
//!   bandwidth)` at the op's dtype.
//! - Communication: ring alpha-beta on the link class of the collective's mesh axis:
//!   all-reduce `2(n−1)α + 2(n−1)/n · S/β`, reduce-scatter and all-gather `(n−1)α +
//!   (n−1)/n · S/β` (S the unsharded buffer), all-to-all likewise, broadcast
//!   `⌈log₂ n⌉α + S/β`. The collective matmuls overlap: a ring of `n` partial GEMMs costs
//!   `n` launches plus one GEMM step plus `n − 1` steps of `max(GEMM step, transfer step)`.
//! - Memory: the bytes of every activation a node produces (parameters, inputs and reshape
//!   views excluded), weighted into time by [`CostModel::memory_us_per_mib`].
//! - Saved activations (training steps): the values of the forward pass that the
//!   backward pass reads are the views autodiff inserts in role [`ValueRole::Saved`]; each such
//!   view is charged its bytes again, times [`CostModel::saved_factor`], because it is held from
//!   the forward to the backward pass while other activations live about one op. This is the
//!   term that makes Megatron sequence parallelism pay in training (Korthikanti et al. 2022: the
//!   norm and residual inputs are saved `1/tp` the size and re-gathered in the backward). A
//!   saved view sunk below a gather (`gather-sink-reshape`) keeps its label and role, so the
//!   sequence-sharded view is charged at its `1/tp` size.
//!
//! Compute, communication and memory stay separate fields of [`NodeCost`]; [`CostModel::weigh`]
//! turns one into the scalar the extractor minimises. The cost of a program is the sum over
//! its nodes, each counted once (a DAG sum: a value used twice is computed once), which is what
//! the greedy DAG extractor assumes. Overlap between different nodes (streams) is not
//! modelled here; the schedule and simulator do that.
//!
//! The device's peak rates and link classes come from the simulator's cluster profile
//! (`compiler::cost::Cluster::rewrite_device`, what `compile --cluster` passes); without one
//! they are the DGX H100's ([`DeviceProfile::h100_sxm`], equal to that profile's, by test).

use crate::ir::{DType, Op, TensorType, ValueRole};
use crate::shard::{LinkClass, Mesh};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::ops::Add;

/// A duration in microseconds. Sums saturate to [`Micros::INFINITE`].
#[derive(Clone, Copy, Debug, Default, PartialEq, PartialOrd, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Micros(pub f64);

impl Micros {
    /// No time.
    pub const ZERO: Micros = Micros(0.0);
    /// Never finishes.
    pub const INFINITE: Micros = Micros(f64::INFINITY);
    /// The larger of two durations.
    pub fn max(self, o: Micros) -> Micros {
        if self.0 >= o.0 {
            self
        } else {
            o
        }
    }
}

impl Add for Micros {
    type Output = Micros;
    fn add(self, o: Micros) -> Micros {
        let s = self.0 + o.0;
        if s.is_finite() {
            Micros(s)
        } else {
            Micros::INFINITE
        }
    }
}

impl fmt::Display for Micros {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_finite() {
            write!(f, "{:.2} µs", self.0)
        } else {
            f.write_str("∞")
        }
    }
}

/// A size in bytes. Sums saturate at `u64::MAX`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Bytes(pub u64);

impl Add for Bytes {
    type Output = Bytes;
    fn add(self, o: Bytes) -> Bytes {
        Bytes(self.0.saturating_add(o.0))
    }
}

/// The cost of one node, per rank.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeCost {
    /// Kernel time (launch floor included).
    pub compute: Micros,
    /// Communication time not hidden behind this node's own compute.
    pub comm: Micros,
    /// Activation bytes produced.
    pub memory: Bytes,
}

impl NodeCost {
    /// Nothing.
    pub const ZERO: NodeCost = NodeCost {
        compute: Micros::ZERO,
        comm: Micros::ZERO,
        memory: Bytes(0),
    };
}

impl Add for NodeCost {
    type Output = NodeCost;
    fn add(self, o: NodeCost) -> NodeCost {
        NodeCost {
            compute: self.compute + o.compute,
            comm: self.comm + o.comm,
            memory: self.memory + o.memory,
        }
    }
}

/// One link class: per-direction bandwidth and per-step latency (α).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LinkProfile {
    /// Bytes per µs in each direction.
    pub bytes_per_us: f64,
    /// Latency of one ring step, µs.
    pub latency_us: f64,
}

/// Peak rates of one device.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeviceProfile {
    /// Name.
    pub name: String,
    /// Dense bf16/f16 FLOP per µs.
    pub flops_per_us_16: f64,
    /// f32 FLOP per µs.
    pub flops_per_us_32: f64,
    /// HBM bytes per µs.
    pub hbm_bytes_per_us: f64,
    /// Launch floor of one kernel, µs.
    pub launch_us: f64,
    /// NVLink (inside a node).
    pub nvlink: LinkProfile,
    /// InfiniBand (across nodes).
    pub ib: LinkProfile,
    /// PCIe.
    pub pcie: LinkProfile,
}

impl DeviceProfile {
    /// NVIDIA H100 SXM5 80GB. Sources: NVIDIA H100 datasheet (989.4 TFLOP/s dense bf16,
    /// 66.9 TFLOP/s f32, 3.35 TB/s HBM3, NVLink 900 GB/s = 450 GB/s per direction); DGX H100
    /// reference architecture (ConnectX-7 400 Gb/s = 50 GB/s per direction per GPU); PCIe Gen5
    /// x16 64 GB/s per direction. Assumed (refit by calibration): 3 µs launch floor, ring-step
    /// latency 1 µs on NVLink and 5 µs on InfiniBand and PCIe.
    pub fn h100_sxm() -> DeviceProfile {
        DeviceProfile {
            name: "h100-sxm".into(),
            flops_per_us_16: 989.4e6,
            flops_per_us_32: 66.9e6,
            hbm_bytes_per_us: 3.35e6,
            launch_us: 3.0,
            nvlink: LinkProfile {
                bytes_per_us: 450e3,
                latency_us: 1.0,
            },
            ib: LinkProfile {
                bytes_per_us: 50e3,
                latency_us: 5.0,
            },
            pcie: LinkProfile {
                bytes_per_us: 64e3,
                latency_us: 5.0,
            },
        }
    }

    fn peak(&self, dt: DType) -> f64 {
        match dt {
            DType::Bf16 | DType::F16 => self.flops_per_us_16,
            DType::F32 | DType::I32 => self.flops_per_us_32,
        }
    }

    fn link(&self, l: LinkClass) -> LinkProfile {
        match l {
            LinkClass::Nvlink => self.nvlink,
            LinkClass::Ib => self.ib,
            LinkClass::Pcie => self.pcie,
        }
    }
}

/// Default weight of the memory term: a MiB of activations per rank weighs as much as
/// 2048 µs (2 µs per KiB). Memory-first: at this weight a layout that shrinks activations
/// wins unless it costs more than about one extra kernel launch per 1.5 KiB saved, which is
/// what makes Megatron sequence parallelism (norm and residual activations `1/tp` the size)
/// win even on tiny models, where the extra collective launch would otherwise decide.
pub const DEFAULT_MEMORY_US_PER_MIB: f64 = 2048.0;

/// The cost model: a device profile and the memory weight.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CostModel {
    /// Device peak rates.
    pub device: DeviceProfile,
    /// µs per MiB of activations (0 turns the memory term off).
    pub memory_us_per_mib: f64,
    /// Weight of a byte saved for the backward pass, on top of its charge as an activation
    /// ([`DEFAULT_SAVED_FACTOR`]; 0 turns the saved-activation term off).
    #[serde(default = "default_saved_factor")]
    pub saved_factor: f64,
    /// Weight of a parameter byte a rank holds, relative to an activation byte (0, the
    /// default: a program's weights are not weighed, as no rule of `all` changes them;
    /// `shardc search --space layers` raises it until the chosen layouts fit the device).
    #[serde(default)]
    pub weight_factor: f64,
}

/// Default weight of a saved byte: 4 transient bytes. A saved value is held from its forward
/// op to its backward op, across the rest of the step, while other activations live about one
/// op. Keeping a saved value on `1/n` sequence shards and gathering it again in the backward
/// pass (Megatron sequence parallelism; Korthikanti et al. 2022) trades `s · (1 − 1/n)` of the
/// saved bytes for one transient whole copy and a gather, so it pays for `s > n/(n − 1)` (2 at
/// `tp=2`) plus the gather's time: 4 leaves that margin at every `tp ≥ 2`.
pub const DEFAULT_SAVED_FACTOR: f64 = 4.0;

fn default_saved_factor() -> f64 {
    DEFAULT_SAVED_FACTOR
}

impl Default for CostModel {
    fn default() -> CostModel {
        CostModel {
            device: DeviceProfile::h100_sxm(),
            memory_us_per_mib: DEFAULT_MEMORY_US_PER_MIB,
            saved_factor: default_saved_factor(),
            weight_factor: 0.0,
        }
    }
}

fn bytes(t: &TensorType) -> f64 {
    t.size_bytes() as f64
}

impl CostModel {
    /// The scalar the extractor minimises: time plus weighted memory, in µs.
    pub fn weigh(&self, c: &NodeCost) -> f64 {
        let t = c.compute + c.comm;
        t.0 + self.memory_us_per_mib * c.memory.0 as f64 / (1u64 << 20) as f64
    }

    /// The held-memory term of a node in role `role`: a view saved for the backward pass
    /// ([`ValueRole::Saved`]) holds its bytes from the forward to the backward pass; a
    /// parameter holds its bytes for the whole run (weighed by [`CostModel::weight_factor`]).
    pub fn held(&self, role: ValueRole, op: &Op, out: &TensorType) -> NodeCost {
        let factor = match op {
            Op::Reshape if role == ValueRole::Saved => self.saved_factor,
            Op::Param(_) => self.weight_factor,
            _ => 0.0,
        };
        if factor > 0.0 {
            NodeCost {
                memory: Bytes((out.size_bytes() as f64 * factor) as u64),
                ..NodeCost::ZERO
            }
        } else {
            NodeCost::ZERO
        }
    }

    fn kernel(&self, flops: f64, bytes: f64, dt: DType) -> Micros {
        let d = &self.device;
        Micros(d.launch_us + (flops / d.peak(dt)).max(bytes / d.hbm_bytes_per_us))
    }

    /// Size and link of a mesh axis (size 1 and NVLink when unknown).
    fn axis(&self, mesh: &Mesh, name: &str) -> (f64, LinkProfile) {
        match mesh.axis(name) {
            Some(a) => (
                mesh.axis_size(a) as f64,
                self.device.link(mesh.axes[a.0 as usize].link),
            ),
            None => (1.0, self.device.nvlink),
        }
    }

    /// Ring time of `steps` steps of α plus moving `frac` of `s` bytes.
    fn ring(&self, link: LinkProfile, steps: f64, frac: f64, s: f64) -> Micros {
        Micros(self.device.launch_us + steps * link.latency_us + frac * s / link.bytes_per_us)
    }

    /// The cost of `op` with operands of types `ins` producing `out`, on `mesh`.
    pub fn node(&self, mesh: &Mesh, op: &Op, ins: &[&TensorType], out: &TensorType) -> NodeCost {
        let n_out = out.numel() as f64;
        let io: f64 = ins.iter().map(|t| bytes(t)).sum::<f64>() + bytes(out);
        let mem = Bytes(out.size_bytes() as u64);
        let compute = |flops: f64, b: f64| NodeCost {
            compute: self.kernel(flops, b, out.dtype),
            comm: Micros::ZERO,
            memory: mem,
        };
        let comm = |t: Micros| NodeCost {
            compute: Micros::ZERO,
            comm: t,
            memory: mem,
        };
        let gemm_flops =
            |a: &TensorType, out: &TensorType| 2.0 * out.numel() as f64 * a.last() as f64;
        match op {
            Op::Param(_) | Op::Input { .. } | Op::Reshape => NodeCost::ZERO,
            Op::MatMul { .. } => compute(gemm_flops(ins[0], out), io),
            Op::FusedMatMul { epilogue, .. } => {
                let f = gemm_flops(ins[0], out) + n_out * epilogue.steps.len() as f64;
                compute(f, io)
            }
            Op::Attention(_) => {
                let (q, k) = (ins[0], ins[1]);
                let f = 4.0 * q.numel() as f64 * k.dim(1) as f64;
                compute(f, io)
            }
            Op::FusedElementwise { expr } => compute(n_out * expr.steps.len() as f64, io),
            Op::RmsNorm { .. } | Op::LayerNorm { .. } | Op::Softmax | Op::AddRmsNorm { .. } => {
                compute(6.0 * n_out, io)
            }
            Op::AllReduce { axis } => {
                let (n, l) = self.axis(mesh, axis);
                comm(self.ring(l, 2.0 * (n - 1.0), 2.0 * (n - 1.0) / n, bytes(out)))
            }
            Op::ReduceScatter { axis, .. } | Op::AllToAll { axis, .. } => {
                let (n, l) = self.axis(mesh, axis);
                comm(self.ring(l, n - 1.0, (n - 1.0) / n, bytes(ins[0])))
            }
            Op::AllGather { axis, .. } => {
                let (n, l) = self.axis(mesh, axis);
                comm(self.ring(l, n - 1.0, (n - 1.0) / n, bytes(out)))
            }
            Op::Broadcast { axis, .. } => {
                let (n, l) = self.axis(mesh, axis);
                comm(self.ring(l, n.log2().ceil(), 1.0, bytes(out)))
            }
            Op::AgMatMul { axis, .. } | Op::MatMulRs { axis, .. } => {
                let (n, l) = self.axis(mesh, axis);
                let (x, w) = (ins[0], ins[1]);
                let gathered = matches!(op, Op::AgMatMul { .. });
                // Per step: one chunk's GEMM, and one chunk moved (x's rows, or a partial sum).
                let chunk_out = if gathered { n_out / n } else { n_out };
                let f = 2.0 * chunk_out * x.last() as f64;
                let b = if gathered {
                    bytes(x) + bytes(w) + bytes(out) / n
                } else {
                    bytes(x) / n + bytes(w) + bytes(out)
                };
                let d = &self.device;
                let step = (f / d.peak(out.dtype)).max(b / d.hbm_bytes_per_us);
                let moved = if gathered { bytes(x) } else { bytes(out) };
                let xfer = l.latency_us + moved / l.bytes_per_us;
                let comp = n * (d.launch_us + step);
                let total = n * d.launch_us + step + (n - 1.0) * step.max(xfer);
                NodeCost {
                    compute: Micros(comp),
                    comm: Micros((total - comp).max(0.0)),
                    memory: mem,
                }
            }
            Op::Unary(u) => {
                use crate::ir::UnaryOp::*;
                let per = match u {
                    GeluTanh | GeluErf | Silu | Exp => 8.0,
                    Relu | Neg => 1.0,
                };
                compute(per * n_out, io)
            }
            Op::Combine => compute(2.0 * ins[0].numel() as f64, io),
            // A max, an exponential and a sum per logit.
            Op::CrossEntropyStats { .. } | Op::CrossEntropyShardGrad { .. } => {
                compute(10.0 * ins[0].numel() as f64, io)
            }
            Op::Rope(_) => compute(4.0 * n_out, io),
            // Data movement and cheap elementwise work: bandwidth-bound.
            _ => compute(n_out, io),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{DType, TensorType};

    #[test]
    fn saturating_units() {
        assert_eq!(Micros(1.0) + Micros(2.0), Micros(3.0));
        assert!((Micros::INFINITE + Micros(1.0)).0.is_infinite());
        assert!((Micros(f64::MAX) + Micros(f64::MAX)).0.is_infinite());
        assert_eq!(Bytes(u64::MAX) + Bytes(1), Bytes(u64::MAX));
        assert_eq!(Micros::INFINITE.to_string(), "∞");
    }

    #[test]
    fn ring_all_reduce_is_reduce_scatter_plus_all_gather() {
        let m = CostModel::default();
        let mesh = Mesh::parse("tp=4", 8).expect("mesh");
        let full = TensorType::plain(DType::F32, &[8, 1024, 1024]);
        let shard = TensorType::plain(DType::F32, &[8, 256, 1024]);
        let ar = m.node(&mesh, &Op::AllReduce { axis: "tp".into() }, &[&full], &full);
        let rs = Op::ReduceScatter {
            axis: "tp".into(),
            dim: 1,
            parts: 4,
        };
        let ag = Op::AllGather {
            axis: "tp".into(),
            dim: 1,
            parts: 4,
        };
        let rs = m.node(&mesh, &rs, &[&full], &shard);
        let ag = m.node(&mesh, &ag, &[&shard], &full);
        // Same bytes and steps; the split pays one more launch.
        let launch = m.device.launch_us;
        let diff = (rs.comm + ag.comm).0 - ar.comm.0;
        assert!((diff - launch).abs() < 1e-6, "{diff}");
    }

    #[test]
    fn norms_on_shards_are_cheaper_and_smaller() {
        let m = CostModel::default();
        let mesh = Mesh::parse("tp=8", 8).expect("mesh");
        let w = TensorType::plain(DType::Bf16, &[8192]);
        let full = TensorType::plain(DType::Bf16, &[1, 4096, 8192]);
        let shard = TensorType::plain(DType::Bf16, &[1, 512, 8192]);
        let op = Op::RmsNorm {
            eps: crate::ir::Float(1e-5),
        };
        let a = m.node(&mesh, &op, &[&full, &w], &full);
        let b = m.node(&mesh, &op, &[&shard, &w], &shard);
        assert!(b.compute.0 < a.compute.0);
        assert_eq!(b.memory.0 * 8, a.memory.0);
        assert!(m.weigh(&b) < m.weigh(&a));
    }
}
