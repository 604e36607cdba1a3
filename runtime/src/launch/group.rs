//! This rank's communicators for a mesh, over TCP: one [`TcpComm`] per mesh axis, connecting
//! it to the other ranks of its group on that axis.
//!
//! Set-up ([`ProcessGroup::connect`]): join the rendezvous, bind one listener per mesh axis on
//! the address that routes to the store, register them, then for each axis in mesh order
//! connect the group (a group only waits on its own members, who are all at the same axis, so
//! the axes cannot deadlock). Groups are named after their axis, so a communicator's errors
//! read "group `tp`"; [`ProcessGroup::groups`] maps group-local ranks back to global ones.
//!
//! Running ([`ProcessGroup::run`]): load this rank's parameters, execute the SPMD program (the
//! one `run_spmd` runs on threads), then a world barrier, so no rank reports success, or
//! writes results, while a peer may still fail. A failure aborts every group of this rank, so
//! its peers fail at once instead of at their timeout, and they abort theirs in turn.

use super::rendezvous::Rendezvous;
use super::{LaunchError, WorldEnv};
use crate::comm::tcp::TcpComm;
use crate::comm::{CommError, Communicator, ReduceOp};
use crate::exec::{execute_with_params, load_params, RankCtx};
use crate::{Tensor, Weights};
use shardc_compiler::ir::Graph;
use shardc_compiler::shard::Mesh;
use std::collections::hash_map::RandomState;
use std::collections::BTreeMap;
use std::hash::{BuildHasher, Hasher};
use std::net::{SocketAddr, TcpListener};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Length of the random job id rank 0 shares when the caller gives no bootstrap bytes.
pub const JOB_ID_BYTES: usize = 16;

/// This rank's group on one mesh axis.
#[derive(Debug)]
pub struct AxisGroup {
    /// The mesh axis (also the communicator's name).
    pub axis: String,
    /// The group's global ranks, in group order (group rank `k` is `ranks[k]`).
    pub ranks: Vec<usize>,
    /// The communicator.
    pub comm: TcpComm,
}

/// One rank's communicators for a mesh (see the module docs).
#[derive(Debug)]
pub struct ProcessGroup {
    rank: usize,
    coords: String,
    groups: Vec<AxisGroup>,
    bootstrap: Vec<u8>,
}

impl ProcessGroup {
    /// Connects this rank (`env`) to its groups of `mesh`, whose world size must be
    /// `env.world_size`. Rank 0 shares `bootstrap` (default: [`JOB_ID_BYTES`] random bytes)
    /// with every rank; other ranks' `bootstrap` is ignored. `plan` is the fingerprint of the
    /// plan this rank runs ([`plan_fingerprint`]): a rank whose differs from the others' is
    /// refused at the rendezvous, naming both. `timeout` bounds the rendezvous, each group's
    /// connection, and later every wait of a collective on a peer.
    pub fn connect(
        env: &WorldEnv,
        mesh: &Mesh,
        plan: &[u8],
        bootstrap: Option<&[u8]>,
        timeout: Duration,
    ) -> Result<ProcessGroup, LaunchError> {
        if mesh.world_size() != env.world_size {
            return Err(LaunchError::MeshSize {
                mesh: mesh.to_string(),
                mesh_size: mesh.world_size(),
                world_size: env.world_size,
            });
        }
        let rv = Rendezvous::join(env, timeout)?;
        let ip = rv.local_ip();
        let mut listeners = Vec::new();
        for a in mesh.axis_ids() {
            let l = TcpListener::bind(SocketAddr::new(ip, 0)).map_err(|e| LaunchError::Io {
                what: format!(
                    "rank {}: listening on {ip} for mesh axis `{}`",
                    env.rank,
                    mesh.axis_name(a)
                ),
                source: e,
            })?;
            listeners.push(l);
        }
        let addrs = listeners
            .iter()
            .map(TcpListener::local_addr)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| LaunchError::Io {
                what: format!("rank {}: listener address", env.rank),
                source: e,
            })?;
        let job_id;
        let bootstrap = match bootstrap {
            Some(b) => b,
            None => {
                job_id = random_bytes(JOB_ID_BYTES);
                &job_id
            }
        };
        let table = rv.exchange(plan, &addrs, Some(bootstrap))?;
        let axes = mesh.axes.len();
        if let Some((r, _)) = table
            .addrs
            .iter()
            .enumerate()
            .find(|(_, a)| a.len() != axes)
        {
            return Err(LaunchError::Rendezvous {
                addr: env.master(),
                detail: format!(
                    "rank {r} registered {} listeners for a mesh of {axes} axes; do all ranks \
                     run with the same --mesh?",
                    table.addrs[r].len()
                ),
            });
        }
        let mut groups = Vec::with_capacity(axes);
        for (a, listener) in mesh.axis_ids().zip(listeners) {
            let axis = mesh.axis_name(a).to_string();
            let ranks = mesh
                .groups(a)
                .into_iter()
                .find(|g| g.contains(&env.rank))
                .expect("invariant: every rank is in one group per axis");
            let k = ranks
                .iter()
                .position(|&r| r == env.rank)
                .expect("invariant: found above");
            let group_addrs: Vec<SocketAddr> = ranks
                .iter()
                .map(|&r| table.addrs[r][a.0 as usize])
                .collect();
            let comm =
                TcpComm::from_listener(&axis, k, ranks.len(), listener, &group_addrs, timeout)
                    .map_err(|source| LaunchError::Connect {
                        rank: env.rank,
                        axis: axis.clone(),
                        ranks: ranks.clone(),
                        source: Box::new(source),
                    })?;
            groups.push(AxisGroup { axis, ranks, comm });
        }
        let coords = mesh
            .coords(env.rank)
            .iter()
            .zip(&mesh.axes)
            .map(|(c, a)| format!("{}={c}", a.name))
            .collect::<Vec<_>>()
            .join(",");
        Ok(ProcessGroup {
            rank: env.rank,
            coords,
            groups,
            bootstrap: table.bootstrap,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// This rank's mesh coordinates, `dp=0,tp=1`.
    pub fn coords(&self) -> &str {
        &self.coords
    }

    /// The bootstrap bytes rank 0 shared (identical on every rank).
    pub fn bootstrap(&self) -> &[u8] {
        &self.bootstrap
    }

    /// This rank's group on each mesh axis, in mesh order.
    pub fn groups(&self) -> &[AxisGroup] {
        &self.groups
    }

    /// The groups as global ranks, `dp:[1,3] tp:[2,3]`.
    pub fn groups_text(&self) -> String {
        self.groups
            .iter()
            .map(|g| {
                let r: Vec<String> = g.ranks.iter().map(usize::to_string).collect();
                format!("{}:[{}]", g.axis, r.join(","))
            })
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// A rank context serving each mesh axis with its communicator.
    pub fn ctx(&self) -> RankCtx<'_> {
        let mut ctx = RankCtx::new();
        for g in &self.groups {
            ctx.insert(g.axis.clone(), &g.comm as &dyn Communicator);
        }
        ctx
    }

    /// Aborts every group of this rank (see [`TcpComm::abort`]): call it when this rank fails,
    /// so its peers stop promptly.
    pub fn abort(&self, reason: &str) {
        for g in &self.groups {
            g.comm.abort(reason);
        }
    }

    /// Returns once every rank of the world has called it: an `all_reduce` over each axis in
    /// turn (a reduction over every axis spans the whole mesh). Fails like a collective when
    /// a peer fails or stalls.
    pub fn barrier(&self) -> Result<(), CommError> {
        let mut token = [1.0f32];
        for g in &self.groups {
            g.comm.all_reduce(&mut token, ReduceOp::Sum)?;
        }
        Ok(())
    }

    /// Runs this rank's share of `program` (see the module docs): its outputs, or an error
    /// naming this rank, its coordinates and groups, after aborting its groups.
    pub fn run(
        &self,
        program: &Graph,
        weights: &Weights,
        inputs: &BTreeMap<String, Tensor>,
    ) -> Result<BTreeMap<String, Tensor>, LaunchError> {
        let ctx = self.ctx();
        let out = load_params(program, weights, &ctx)
            .and_then(|p| execute_with_params(program, &p, inputs, &ctx));
        // Peers see `rank <group rank> aborted: <why>`; say which global rank that is.
        let why =
            |e: &dyn std::fmt::Display| format!("[global rank {}, {}] {e}", self.rank, self.coords);
        let out = match out {
            Ok(o) => o,
            Err(error) => {
                self.abort(&why(&error));
                return Err(LaunchError::Rank {
                    rank: self.rank,
                    coords: self.coords.clone(),
                    groups: self.groups_text(),
                    error: Box::new(error),
                });
            }
        };
        if let Err(error) = self.barrier() {
            self.abort(&why(&error));
            return Err(LaunchError::Barrier {
                rank: self.rank,
                coords: self.coords.clone(),
                groups: self.groups_text(),
                error: Box::new(error),
            });
        }
        Ok(out)
    }
}

/// `n` bytes that differ between jobs (not cryptographic): std's randomly seeded hasher over
/// the time and process id.
pub fn random_bytes(n: usize) -> Vec<u8> {
    let state = RandomState::new();
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let mut out = Vec::with_capacity(n + 8);
    let mut i = 0u64;
    while out.len() < n {
        let mut h = state.build_hasher();
        h.write_u128(nanos);
        h.write_u32(std::process::id());
        h.write_u64(i);
        out.extend_from_slice(&h.finish().to_le_bytes());
        i += 1;
    }
    out.truncate(n);
    out
}

/// The fingerprint of a plan (its serialised form, with nothing rank- or path-specific): what
/// every rank of a job must agree on at the rendezvous.
pub fn plan_fingerprint(plan: &[u8]) -> Vec<u8> {
    blake3::hash(plan).as_bytes().to_vec()
}

/// The fingerprint of `plan` ([`plan_fingerprint`] of its JSON without the model's path, so
/// ranks that found the model or plan in different places agree).
pub fn fingerprint_of(plan: &shardc_compiler::plan::Plan) -> Vec<u8> {
    let mut p = plan.clone();
    p.model.source.clear();
    plan_fingerprint(p.to_json().as_bytes())
}
