//! Collective time: ring and tree alpha-beta models, hierarchical across the NVLink domain and
//! the network.
//!
//! Sizes follow nccl-tests: `bytes` is the larger of a rank's send and receive buffers (the
//! whole gathered tensor for all-gather, the whole input for reduce-scatter). nccl-tests'
//! bus bandwidth is `busbw = algbw · factor(n)` with `algbw = bytes / time`, and the factor is
//! what a ring moves per rank ([`CollectiveKind::bus_factor`]); a ring at link bandwidth `B`
//! therefore takes `steps · α + bytes · factor(n) / B`.
//!
//! A group inside one NVLink domain runs a flat ring at the NVLink busbw. A group spanning
//! several domains runs hierarchically: reduce-scatter inside each domain, the inter-node
//! collective on `1/k` of the data per GPU (each GPU on its share of the node's adapters: every
//! GPU of a node communicates at once in an SPMD program, which is the contention between
//! groups that share a node's adapters), and all-gather inside each domain. All-reduce also
//! considers NCCL's double binary tree across nodes (`2·⌈log₂ m⌉` latency steps) and takes the
//! faster, as NCCL's tuner does.

use super::profile::Cluster;
use super::units::{Bytes, Seconds};
use crate::ir::Op;
use crate::shard::Mesh;
use serde::{Deserialize, Serialize};

/// A collective operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CollectiveKind {
    /// Sum, everyone gets the sum.
    AllReduce,
    /// Sum, everyone keeps a `1/n` chunk.
    ReduceScatter,
    /// Concatenation of everyone's chunk.
    AllGather,
    /// Personalised exchange.
    AllToAll,
    /// One rank's value to all.
    Broadcast,
    /// Point-to-point (pipeline stages).
    SendRecv,
}

impl CollectiveKind {
    /// The kind of a collective op.
    pub fn of_op(op: &Op) -> Option<CollectiveKind> {
        Some(match op {
            Op::AllReduce { .. } => CollectiveKind::AllReduce,
            Op::ReduceScatter { .. } => CollectiveKind::ReduceScatter,
            Op::AllGather { .. } => CollectiveKind::AllGather,
            Op::AllToAll { .. } => CollectiveKind::AllToAll,
            Op::Broadcast { .. } => CollectiveKind::Broadcast,
            _ => return None,
        })
    }

    /// nccl-tests' bus-bandwidth factor for `n` ranks (PERFORMANCE.md of NVIDIA/nccl-tests):
    /// all-reduce `2(n−1)/n`; reduce-scatter, all-gather and all-to-all `(n−1)/n`; broadcast
    /// and send/recv 1.
    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n.max(1) as f64;
        match self {
            CollectiveKind::AllReduce => 2.0 * (n - 1.0) / n,
            CollectiveKind::ReduceScatter
            | CollectiveKind::AllGather
            | CollectiveKind::AllToAll => (n - 1.0) / n,
            CollectiveKind::Broadcast | CollectiveKind::SendRecv => 1.0,
        }
    }

    /// Latency steps of a ring over `n` ranks.
    pub fn ring_steps(self, n: usize) -> f64 {
        let n = n.max(1) as f64;
        match self {
            CollectiveKind::AllReduce => 2.0 * (n - 1.0),
            CollectiveKind::SendRecv => 1.0,
            _ => n - 1.0,
        }
    }

    /// The collective the backward pass runs in its place: all-gather ↔ reduce-scatter,
    /// all-reduce and all-to-all are their own conjugates (Megatron's f/g pairs), broadcast
    /// becomes a reduction (modelled as all-reduce).
    pub fn conjugate(self) -> CollectiveKind {
        match self {
            CollectiveKind::AllGather => CollectiveKind::ReduceScatter,
            CollectiveKind::ReduceScatter => CollectiveKind::AllGather,
            CollectiveKind::Broadcast => CollectiveKind::AllReduce,
            k => k,
        }
    }

    /// Snake-case name.
    pub fn name(self) -> &'static str {
        match self {
            CollectiveKind::AllReduce => "all_reduce",
            CollectiveKind::ReduceScatter => "reduce_scatter",
            CollectiveKind::AllGather => "all_gather",
            CollectiveKind::AllToAll => "all_to_all",
            CollectiveKind::Broadcast => "broadcast",
            CollectiveKind::SendRecv => "send_recv",
        }
    }
}

/// How a group's ranks sit on the machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GroupTopology {
    /// Ranks in the group.
    pub ranks: usize,
    /// Ranks of the group in one NVLink domain.
    pub per_domain: usize,
    /// NVLink domains the group spans.
    pub domains: usize,
}

impl GroupTopology {
    /// All `n` ranks inside one NVLink domain.
    pub fn intra(n: usize) -> GroupTopology {
        GroupTopology::across(1, n)
    }

    /// `per_domain` ranks in each of `domains` NVLink domains.
    pub fn across(domains: usize, per_domain: usize) -> GroupTopology {
        GroupTopology {
            ranks: domains.saturating_mul(per_domain),
            per_domain,
            domains,
        }
    }

    /// The topology of `members` (global ranks) when ranks fill NVLink domains of `domain`
    /// GPUs in order.
    pub fn of_members(members: &[usize], domain: usize) -> GroupTopology {
        let domain = domain.max(1);
        let first = members.first().map_or(0, |&r| r / domain);
        let per_domain = members
            .iter()
            .filter(|&&r| r / domain == first)
            .count()
            .max(1);
        let mut ds: Vec<usize> = members.iter().map(|&r| r / domain).collect();
        ds.sort_unstable();
        ds.dedup();
        GroupTopology {
            ranks: members.len(),
            per_domain,
            domains: ds.len().max(1),
        }
    }

    /// The topology of the first group of `axis` in `mesh` on `cluster`.
    pub fn of_axis(mesh: &Mesh, axis: &str, cluster: &Cluster) -> GroupTopology {
        match mesh.axis(axis) {
            Some(a) => GroupTopology::of_members(
                &mesh.group_of_first(&[a]),
                cluster.profile.nvlink_domain.value as usize,
            ),
            None => GroupTopology::intra(1),
        }
    }

    /// True when the group crosses the network.
    pub fn crosses_network(&self) -> bool {
        self.domains > 1
    }
}

/// Alpha-beta parameters of one link class.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Link {
    /// Per-step latency, seconds.
    pub alpha: f64,
    /// Bandwidth per GPU per direction after efficiency, bytes/s.
    pub bw: f64,
}

impl Link {
    /// The NVLink domain of `cluster`.
    pub fn nvlink(cluster: &Cluster) -> Link {
        Link {
            alpha: cluster.profile.nvlink_latency.value,
            bw: cluster.nvlink_bw(),
        }
    }
    /// The network of `cluster`, per GPU.
    pub fn network(cluster: &Cluster) -> Link {
        Link {
            alpha: cluster.profile.network_latency.value,
            bw: cluster.net_bw_per_gpu(),
        }
    }
}

/// A flat ring over `n` ranks on one link: `steps · α + bytes · factor(n) / bw`.
pub fn ring_time(kind: CollectiveKind, bytes: f64, n: usize, link: Link) -> f64 {
    if n <= 1 && kind != CollectiveKind::SendRecv {
        return 0.0;
    }
    kind.ring_steps(n) * link.alpha + bytes * kind.bus_factor(n) / link.bw
}

/// NCCL's double-binary-tree all-reduce over `n` ranks: `2⌈log₂ n⌉` latency steps; each rank
/// sends and receives the whole buffer once in the reduce and once in the broadcast.
pub fn tree_allreduce_time(bytes: f64, n: usize, link: Link) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let depth = (n as f64).log2().ceil();
    2.0 * depth * link.alpha + 2.0 * bytes / link.bw
}

/// Time of one collective of `bytes` (nccl-tests size) over a group laid out as `topo`.
pub fn collective_time(
    cluster: &Cluster,
    kind: CollectiveKind,
    bytes: Bytes,
    topo: GroupTopology,
) -> Seconds {
    let s = bytes.as_f64();
    let nv = Link::nvlink(cluster);
    let net = Link::network(cluster);
    let (n, k, m) = (topo.ranks, topo.per_domain, topo.domains);
    if kind == CollectiveKind::SendRecv {
        let link = if m > 1 { net } else { nv };
        return Seconds(ring_time(kind, s, 2, link));
    }
    if n <= 1 {
        return Seconds::ZERO;
    }
    if m <= 1 {
        return Seconds(ring_time(kind, s, n, nv));
    }
    // Hierarchical: intra-domain phases on NVLink over k ranks; the inter-domain phase over m
    // domains on 1/k of the data per GPU, each GPU on its own network share.
    let rs_intra = ring_time(CollectiveKind::ReduceScatter, s, k, nv);
    let ag_intra = ring_time(CollectiveKind::AllGather, s, k, nv);
    let inter = s / k as f64;
    let t = match kind {
        CollectiveKind::AllReduce => {
            let ring = ring_time(CollectiveKind::AllReduce, inter, m, net);
            let tree = tree_allreduce_time(inter, m, net);
            rs_intra + ring.min(tree) + ag_intra
        }
        CollectiveKind::ReduceScatter => {
            rs_intra + ring_time(CollectiveKind::ReduceScatter, inter, m, net)
        }
        CollectiveKind::AllGather => ring_time(CollectiveKind::AllGather, inter, m, net) + ag_intra,
        CollectiveKind::AllToAll => {
            // Each rank sends (n−1)/n of its buffer: (k−1)/n of it stays in the domain, (n−k)/n
            // crosses the network; both directions run at once.
            let local = s * (k as f64 - 1.0) / n as f64 / nv.bw;
            let remote = s * (n - k) as f64 / n as f64 / net.bw;
            (n as f64 - 1.0) * net.alpha + local.max(remote)
        }
        CollectiveKind::Broadcast => {
            (m as f64 - 1.0) * net.alpha + (k as f64 - 1.0) * nv.alpha + s / net.bw.min(nv.bw)
        }
        CollectiveKind::SendRecv => unreachable!("handled above"),
    };
    Seconds(t)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cluster() -> Cluster {
        Cluster::resolve("dgx-h100x4").unwrap()
    }

    #[test]
    fn nccl_tests_bus_factors() {
        // PERFORMANCE.md of NVIDIA/nccl-tests.
        let k = CollectiveKind::AllReduce;
        assert_eq!(k.bus_factor(8), 2.0 * 7.0 / 8.0);
        assert_eq!(CollectiveKind::ReduceScatter.bus_factor(8), 7.0 / 8.0);
        assert_eq!(CollectiveKind::AllGather.bus_factor(4), 3.0 / 4.0);
        assert_eq!(CollectiveKind::AllToAll.bus_factor(2), 0.5);
        assert_eq!(CollectiveKind::Broadcast.bus_factor(8), 1.0);
        assert_eq!(CollectiveKind::SendRecv.bus_factor(2), 1.0);
        assert_eq!(k.bus_factor(1), 0.0);
    }

    #[test]
    fn flat_ring_busbw_equals_link_bandwidth_at_large_sizes() {
        let c = cluster();
        let bw = c.nvlink_bw();
        for kind in [
            CollectiveKind::AllReduce,
            CollectiveKind::ReduceScatter,
            CollectiveKind::AllGather,
            CollectiveKind::AllToAll,
        ] {
            for n in [2usize, 4, 8] {
                let bytes = 8u64 << 30;
                let t = collective_time(&c, kind, Bytes(bytes), GroupTopology::intra(n)).0;
                let algbw = bytes as f64 / t;
                let busbw = algbw * kind.bus_factor(n);
                assert!(
                    (busbw / bw - 1.0).abs() < 1e-3,
                    "{kind:?} n={n}: busbw {busbw} vs link {bw}"
                );
            }
        }
    }

    #[test]
    fn latency_dominates_small_messages() {
        let c = cluster();
        let t = collective_time(
            &c,
            CollectiveKind::AllReduce,
            Bytes(8),
            GroupTopology::intra(8),
        );
        let alpha = c.profile.nvlink_latency.value;
        assert!((t.0 - 14.0 * alpha).abs() < 1e-9, "{t}");
        assert_eq!(
            collective_time(
                &c,
                CollectiveKind::AllReduce,
                Bytes(1 << 20),
                GroupTopology::intra(1)
            ),
            Seconds::ZERO
        );
    }

    #[test]
    fn hierarchical_allreduce_is_bounded_by_the_network_share() {
        let c = cluster();
        // One rank per node on 4 nodes: the whole buffer crosses the network at the per-GPU share.
        let topo = GroupTopology::across(4, 1);
        let bytes = 4u64 << 30;
        let t = collective_time(&c, CollectiveKind::AllReduce, Bytes(bytes), topo).0;
        let expect = 2.0 * 3.0 / 4.0 * bytes as f64 / c.net_bw_per_gpu();
        assert!((t / expect - 1.0).abs() < 0.01, "{t} vs {expect}");
        // Eight per node on 4 nodes: the network phase carries 1/8 of the data per GPU.
        let topo = GroupTopology::across(4, 8);
        let t32 = collective_time(&c, CollectiveKind::AllReduce, Bytes(bytes), topo).0;
        assert!(t32 < t, "{t32} < {t}");
        let nv = Link::nvlink(&c);
        let lower = 2.0 * ring_time(CollectiveKind::ReduceScatter, bytes as f64, 8, nv);
        assert!(t32 > lower);
    }

    #[test]
    fn topology_of_mesh_axes() {
        let c = Cluster::resolve("dgx-h100x4").unwrap();
        let mesh = Mesh::parse("dp=4,tp=8", 8).unwrap();
        assert_eq!(
            GroupTopology::of_axis(&mesh, "tp", &c),
            GroupTopology::intra(8)
        );
        assert_eq!(
            GroupTopology::of_axis(&mesh, "dp", &c),
            GroupTopology::across(4, 1)
        );
        let mesh = Mesh::parse("tp=2,dp=16", 8).unwrap();
        assert_eq!(
            GroupTopology::of_axis(&mesh, "dp", &c),
            GroupTopology::across(2, 8)
        );
        assert_eq!(
            CollectiveKind::AllGather.conjugate(),
            CollectiveKind::ReduceScatter
        );
    }
}
