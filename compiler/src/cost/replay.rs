//! Discrete-event replay of [`Program`]s over every rank of a mesh.
//!
//! Each stream of each rank runs its ops in issue order. A kernel takes its roofline time; a
//! record stamps an event; a wait blocks its stream until the event is recorded (and moves it
//! to the event's time). A collective blocks until every rank of its group has reached it,
//! then runs from the latest arrival for its alpha-beta time on every member at once — so a
//! slow rank delays its whole group. Collectives that share a link (the NVLink domain, or the
//! network adapters) are serialised on it, work-conserving: a collective starts no earlier than
//! the previous one on any link it uses has finished on every member.
//!
//! Pre: every rank of a group issues the group's collectives in the same order (the plan's
//! static check); otherwise the replay reports a deadlock naming the blocked ranks.

use super::collective::{collective_time, CollectiveKind, GroupTopology};
use super::profile::Cluster;
use super::program::{ProgKind, Program, COMPUTE};
use super::units::{Bytes, Seconds};
use super::CostError;
use crate::shard::Mesh;
use std::collections::HashMap;

/// How each axis' groups sit on the machine.
#[derive(Clone, Debug)]
pub struct Topology {
    /// The mesh the programs run on.
    pub mesh: Mesh,
    /// Per axis (by index): group index of each rank.
    group_of: Vec<Vec<u32>>,
    /// Per axis: the members of each group.
    members: Vec<Vec<Vec<usize>>>,
    /// Per axis: each group's topology.
    topo: Vec<Vec<GroupTopology>>,
}

impl Topology {
    /// Groups of `mesh` with ranks filling the cluster's NVLink domains in rank order.
    pub fn new(mesh: &Mesh, cluster: &Cluster) -> Topology {
        let world = mesh.world_size();
        let domain = cluster.profile.nvlink_domain.value as usize;
        let mut group_of = Vec::new();
        let mut members = Vec::new();
        let mut topo = Vec::new();
        for a in mesh.axis_ids() {
            let groups = mesh.groups(a);
            let mut of = vec![0u32; world];
            for (gi, g) in groups.iter().enumerate() {
                for &r in g {
                    of[r] = gi as u32;
                }
            }
            topo.push(
                groups
                    .iter()
                    .map(|g| GroupTopology::of_members(g, domain))
                    .collect(),
            );
            group_of.push(of);
            members.push(groups);
        }
        Topology {
            mesh: mesh.clone(),
            group_of,
            members,
            topo,
        }
    }

    /// Every group of axis `name` laid out as `t` (the layer programs of the training model run
    /// on a small mesh but communicate as the full mesh's axis does).
    pub fn with_axis(mut self, name: &str, t: GroupTopology) -> Topology {
        if let Some(a) = self.mesh.axis(name) {
            for x in &mut self.topo[a.0 as usize] {
                *x = t;
            }
        }
        self
    }

    fn axis_index(&self, name: &str) -> Option<usize> {
        self.mesh.axis(name).map(|a| a.0 as usize)
    }
}

/// One timed op of one rank.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OpTime {
    /// Index into the program's ops.
    pub op: u32,
    /// Start, seconds.
    pub start: f64,
    /// End, seconds.
    pub end: f64,
}

/// What one rank did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RankReplay {
    /// When its last op ended.
    pub end: Seconds,
    /// Busy time of its compute stream (sum of kernel times there).
    pub compute: Seconds,
    /// Sum of its collectives' durations.
    pub comm: Seconds,
    /// Kernels and collectives with their times (when recorded).
    pub ops: Vec<OpTime>,
    /// Live bytes after each change: (time, bytes).
    pub memory: Vec<(f64, u64)>,
    /// Peak live bytes.
    pub peak_live: Bytes,
}

impl RankReplay {
    /// Time on the critical path with no compute running: communication (and waiting on it)
    /// that nothing hides.
    pub fn exposed_comm(&self) -> Seconds {
        self.end - self.compute
    }
}

/// The replay of all ranks.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Replay {
    /// Per rank.
    pub ranks: Vec<RankReplay>,
}

impl Replay {
    /// The rank that finishes last.
    pub fn critical_rank(&self) -> usize {
        let mut best = 0;
        for (i, r) in self.ranks.iter().enumerate() {
            if r.end.0 > self.ranks[best].end.0 {
                best = i;
            }
        }
        best
    }

    /// When the last rank finishes.
    pub fn end(&self) -> Seconds {
        self.ranks
            .iter()
            .fold(Seconds::ZERO, |acc, r| acc.max(r.end))
    }
}

#[derive(Clone, Copy)]
struct Slot {
    arrived: u32,
    ready: f64,
    end: f64,
    start: f64,
}

/// Replays `program` (the same SPMD program on every rank) over every rank of `topo.mesh`.
/// With `record`, each rank's op times and memory timeline are kept.
pub fn replay(
    program: &Program,
    topo: &Topology,
    cluster: &Cluster,
    record: bool,
) -> Result<Replay, CostError> {
    let world = topo.mesh.world_size();
    let nstreams = program.streams.len().max(1);
    // Per-stream op lists (the same on every rank).
    let mut lists: Vec<Vec<u32>> = vec![Vec::new(); nstreams];
    for (i, op) in program.ops.iter().enumerate() {
        let s = (op.stream as usize).min(nstreams - 1);
        lists[s].push(i as u32);
    }
    // Per collective op: axis index, group size; per (axis, group) duration cache.
    let mut axis_of: Vec<Option<usize>> = vec![None; program.ops.len()];
    for (i, op) in program.ops.iter().enumerate() {
        if let ProgKind::Collective { axis, .. } = &op.kind {
            match topo.axis_index(axis) {
                Some(a) => axis_of[i] = Some(a),
                None => {
                    return Err(CostError::Replay(format!(
                        "collective `{}` runs on axis `{axis}`, which mesh {} does not have",
                        op.label, topo.mesh
                    )))
                }
            }
        }
    }
    let mut durations: HashMap<(CollectiveKind, u64, GroupTopology), f64> = HashMap::new();
    let mut dur = |kind: CollectiveKind, bytes: u64, t: GroupTopology| -> f64 {
        *durations
            .entry((kind, bytes, t))
            .or_insert_with(|| collective_time(cluster, kind, Bytes(bytes), t).0)
    };

    let mut pos = vec![vec![0usize; nstreams]; world];
    let mut time = vec![vec![0f64; nstreams]; world];
    let mut arrived = vec![vec![false; nstreams]; world];
    let mut events = vec![vec![f64::NAN; program.events as usize]; world];
    // Link reservations per rank: [nvlink, network].
    let mut link_free = vec![[0f64; 2]; world];
    let mut slots: HashMap<(u32, u32), Slot> = HashMap::new();
    let mut out: Vec<RankReplay> = (0..world)
        .map(|_| RankReplay {
            memory: if record {
                vec![(0.0, program.initial_live)]
            } else {
                Vec::new()
            },
            ..RankReplay::default()
        })
        .collect();
    let mut live = vec![program.initial_live; world];
    let mut peak = vec![program.initial_live; world];
    let total: usize = lists.iter().map(Vec::len).sum();
    let mut done = 0usize;

    loop {
        let mut progressed = false;
        for r in 0..world {
            for s in 0..nstreams {
                while let Some(&oi) = lists[s].get(pos[r][s]) {
                    let op = &program.ops[oi as usize];
                    let t = time[r][s];
                    match &op.kind {
                        ProgKind::Kernel { work, .. } => {
                            let end = t + work.time.0;
                            live[r] += op.alloc;
                            peak[r] = peak[r].max(live[r]);
                            live[r] = live[r].saturating_sub(op.free);
                            if op.stream == COMPUTE {
                                out[r].compute += work.time;
                            }
                            if record {
                                out[r].ops.push(OpTime {
                                    op: oi,
                                    start: t,
                                    end,
                                });
                                if op.alloc > 0 || op.free > 0 {
                                    out[r].memory.push((end, live[r]));
                                }
                            }
                            time[r][s] = end;
                        }
                        ProgKind::Record(e) => events[r][*e as usize] = t,
                        ProgKind::Wait(e) => {
                            let ev = events[r][*e as usize];
                            if ev.is_nan() {
                                break;
                            }
                            time[r][s] = t.max(ev);
                        }
                        ProgKind::Collective { kind, bytes, .. } => {
                            let a = axis_of[oi as usize].expect("invariant: checked above");
                            let g = topo.group_of[a][r];
                            let key = (oi, g);
                            let gt = topo.topo[a][g as usize];
                            let slot = slots.entry(key).or_insert(Slot {
                                arrived: 0,
                                ready: 0.0,
                                end: f64::NAN,
                                start: 0.0,
                            });
                            if !arrived[r][s] {
                                arrived[r][s] = true;
                                slot.arrived += 1;
                                slot.ready = slot.ready.max(t);
                                if slot.arrived as usize == gt.ranks {
                                    let links: &[usize] = if gt.crosses_network() {
                                        if gt.per_domain > 1 {
                                            &[0, 1]
                                        } else {
                                            &[1]
                                        }
                                    } else {
                                        &[0]
                                    };
                                    let members = &topo.members[a][g as usize];
                                    let mut start = slot.ready;
                                    for &m in members {
                                        for &l in links {
                                            start = start.max(link_free[m][l]);
                                        }
                                    }
                                    let end = start + dur(*kind, *bytes, gt);
                                    for &m in members {
                                        for &l in links {
                                            link_free[m][l] = end;
                                        }
                                    }
                                    slot.start = start;
                                    slot.end = end;
                                }
                            }
                            if slot.end.is_nan() {
                                break;
                            }
                            let (start, end) = (slot.start, slot.end);
                            arrived[r][s] = false;
                            live[r] += op.alloc;
                            peak[r] = peak[r].max(live[r]);
                            live[r] = live[r].saturating_sub(op.free);
                            out[r].comm += Seconds(end - start);
                            if record {
                                out[r].ops.push(OpTime { op: oi, start, end });
                                if op.alloc > 0 || op.free > 0 {
                                    out[r].memory.push((end, live[r]));
                                }
                            }
                            time[r][s] = end;
                        }
                    }
                    pos[r][s] += 1;
                    done += 1;
                    progressed = true;
                }
            }
        }
        if done == total * world {
            break;
        }
        if !progressed {
            let mut blocked: Vec<String> = Vec::new();
            'find: for (r, rpos) in pos.iter().enumerate() {
                for (s, list) in lists.iter().enumerate() {
                    if let Some(&oi) = list.get(rpos[s]) {
                        let op = &program.ops[oi as usize];
                        blocked.push(format!(
                            "rank {r} stream {} at `{}`",
                            program.streams[s], op.label
                        ));
                        if blocked.len() == 4 {
                            break 'find;
                        }
                    }
                }
            }
            return Err(CostError::Replay(format!(
                "deadlock: no stream can make progress ({})",
                blocked.join("; ")
            )));
        }
    }
    for r in 0..world {
        out[r].end = Seconds(time[r].iter().copied().fold(0.0, f64::max));
        out[r].peak_live = Bytes(peak[r]);
    }
    Ok(Replay { ranks: out })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::program::{ProgOp, Work, COMM};

    fn push(p: &mut Program, stream: u32, kind: ProgKind) {
        p.ops.push(ProgOp {
            stream,
            label: "x".into(),
            kind,
            alloc: 0,
            free: 0,
            grad: None,
        });
    }

    fn kernel(t: f64) -> ProgKind {
        ProgKind::Kernel {
            work: Work {
                time: Seconds(t),
                flops: 0.0,
                bytes: 0.0,
            },
            gemm: false,
        }
    }

    /// Seconds of an all-reduce of `bytes` over one NVLink group of 8 on `c`.
    fn all_reduce_time(c: &Cluster, bytes: u64) -> f64 {
        let topo = GroupTopology::intra(8);
        collective_time(c, CollectiveKind::AllReduce, Bytes(bytes), topo).0
    }

    #[test]
    fn comm_overlaps_independent_compute() {
        let c = Cluster::resolve("dgx-h100x1").unwrap();
        let mesh = Mesh::parse("tp=8", 8).unwrap();
        let topo = Topology::new(&mesh, &c);
        let bytes = 1u64 << 30;
        let tc = all_reduce_time(&c, bytes);
        let mut p = Program::new();
        push(&mut p, COMPUTE, kernel(1e-3));
        push(&mut p, COMPUTE, ProgKind::Record(0));
        push(&mut p, COMM, ProgKind::Wait(0));
        push(
            &mut p,
            COMM,
            ProgKind::Collective {
                axis: "tp".into(),
                kind: CollectiveKind::AllReduce,
                bytes,
            },
        );
        push(&mut p, COMM, ProgKind::Record(1));
        push(&mut p, COMPUTE, kernel(2e-3));
        push(&mut p, COMPUTE, ProgKind::Wait(1));
        push(&mut p, COMPUTE, kernel(1e-3));
        p.events = 2;
        let r = replay(&p, &topo, &c, true).unwrap();
        assert_eq!(r.ranks.len(), 8);
        let end = r.end().0;
        let expect = 1e-3 + tc.max(2e-3) + 1e-3;
        assert!((end - expect).abs() < 1e-12, "{end} vs {expect}");
        let exposed = r.ranks[0].exposed_comm().0;
        assert!((exposed - (tc - 2e-3).max(0.0)).abs() < 1e-12);
    }

    #[test]
    fn collectives_sharing_a_link_are_serialised() {
        // Two streams each issue an all-reduce at t = 0 over the same NVLink group: the link
        // carries one after the other (work-conserving), so the second ends at twice the time.
        let c = Cluster::resolve("dgx-h100x1").unwrap();
        let mesh = Mesh::parse("tp=8", 8).unwrap();
        let bytes = 1u64 << 30;
        let t = all_reduce_time(&c, bytes);
        let mut p = Program::new();
        p.streams.push("comm2".into());
        for s in [COMM, 2] {
            push(
                &mut p,
                s,
                ProgKind::Collective {
                    axis: "tp".into(),
                    kind: CollectiveKind::AllReduce,
                    bytes,
                },
            );
        }
        let r = replay(&p, &Topology::new(&mesh, &c), &c, true).unwrap();
        assert!(
            (r.end().0 - 2.0 * t).abs() < 1e-12,
            "{} vs {}",
            r.end().0,
            2.0 * t
        );
        let ends: Vec<f64> = r.ranks[0].ops.iter().map(|o| o.end).collect();
        assert!((ends[0] - t).abs() < 1e-12 && (ends[1] - 2.0 * t).abs() < 1e-12);
    }

    #[test]
    fn missing_record_is_a_deadlock() {
        let c = Cluster::resolve("dgx-h100x1").unwrap();
        let mesh = Mesh::parse("tp=2", 8).unwrap();
        let mut p = Program::new();
        push(&mut p, COMPUTE, ProgKind::Wait(0));
        p.events = 1;
        let e = replay(&p, &Topology::new(&mesh, &c), &c, false).unwrap_err();
        assert!(e.to_string().contains("deadlock"), "{e}");
    }
}
