//! The CUDA executor: one rank's SPMD [`Graph`] (the same programs the CPU executor runs)
//! prepared on one GPU and run in f32 or bf16.
//!
//! [`CudaProgram::prepare`] plans the storage dtypes, the activation arena (one allocation,
//! views into it), the fused groups and the stream/event steps (`schedule::schedule`: compute
//! on stream 0, collectives on stream 1), uploads the parameters (cast to the run's dtype)
//! and the rope frequency tables. [`CudaProgram::run`] uploads the inputs (each rank's chunk,
//! as the CPU executor takes it), enqueues every step, waits with a watchdog that polls the
//! communicators, and downloads the named outputs as f32/i32 host tensors.
//!
//! With [`CudaOptions::graphs`] a run's launches are replayed from a CUDA graph: the first
//! run with a given set of input buffers is eager (kernel modules load, GEMM plans are built),
//! the second is captured on the compute stream and launched, later ones launch the graph.
//! Every address a graph bakes in stays put between runs: the arena, scratch and parameters are
//! allocated once, and [`CudaProgram::upload_inputs`] writes new inputs into the previous run's
//! buffers when the sizes match. The host-side checks of token ids and labels run before every
//! replay. Programs that communicate are refused (see [`graph_blocker`]).
//!
//! Stream safety (event tracking is off): the plan's events order a collective after its
//! operand's producer and its first consumer after the collective. The arena reuses bytes by
//! liveness in program order, which does not cover a collective still reading its operand on
//! the comm stream while the compute stream reuses those bytes; before every compute launch the
//! executor therefore makes the compute stream wait for any in-flight collective whose buffers
//! overlap what the launch writes.

use super::gemm::GemmCache;
use super::host::{alloc, download, random_values, DevBuf, HostData};
use super::ops::Launcher;
use super::plan::{plan_memory_routed, Action, ArenaPlan, FusedGroup, FusionPlan, Slot, Storage};
use super::rank::{CudaOptions, CudaRankCtx, ParamInit};
use super::routed::Routing;
use super::scratch::scratch_sizes;
use super::support::check_supported;
use super::train_ops::AdamWConsts;
use super::{CudaDevice, CudaError};
use crate::{RuntimeError, Tensor};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaEvent, CudaGraph, CudaStream};
use shardc_compiler::ir::{DType, Graph, Op, ParamSource, ShardSpec, ValueId};
use shardc_compiler::schedule::{schedule, Step, COMM_STREAM};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A collective in flight on the comm stream: its done event and the arena bytes it touches.
struct InFlight {
    event: usize,
    slots: Vec<Slot>,
}

/// A run captured into a CUDA graph, and the input addresses it bakes in.
struct StepGraph {
    inputs: Vec<u64>,
    /// `None` when the run enqueued no work.
    graph: Option<CudaGraph>,
}

/// The first node of `graph` that stops its runs from being captured into a CUDA graph: a
/// collective or an op that communicates inside (collective matmuls, ring attention), whose
/// communicator progress, host-side watchdog and cross-stream ordering the executor drives from
/// the host on every run. `None`: the program can run from a graph.
pub fn graph_blocker(graph: &Graph) -> Option<ValueId> {
    graph.ids().find(|&v| graph.node(v).op.communicates())
}

/// The tensor of parameter `src` (of type `ty`) among host `tensors` ([`ParamInit::Host`]).
fn host_param(
    tensors: &BTreeMap<String, Tensor>,
    src: &ParamSource,
    ty: &shardc_compiler::ir::TensorType,
) -> Result<Tensor, RuntimeError> {
    let plain =
        src.view.is_none() && src.stack.is_none() && !src.transposed && src.shards.is_empty();
    let t =
        tensors
            .get(&src.name)
            .filter(|_| plain)
            .ok_or_else(|| RuntimeError::MissingTensor {
                name: src.name.clone(),
                file: "the host tensors (whole parameters only)".into(),
            })?;
    if t.shape != ty.shape() || t.as_f32().is_none() {
        return Err(RuntimeError::TensorShape {
            name: src.name.clone(),
            expected: ty.shape(),
            found: t.shape.clone(),
        });
    }
    Ok(t.clone())
}

/// One rank's graph prepared on a GPU. See the module docs.
pub struct CudaProgram {
    pub(super) dev: Arc<CudaDevice>,
    pub(super) compute: Arc<CudaStream>,
    pub(super) comm: Arc<CudaStream>,
    pub(super) graph: Graph,
    pub(super) opts: CudaOptions,
    pub(super) storage: Vec<Storage>,
    pub(super) arena_plan: ArenaPlan,
    pub(super) fusion: FusionPlan,
    pub(super) steps: Vec<Step>,
    pub(super) local_ids: Vec<bool>,
    pub(super) coords: BTreeMap<String, (usize, usize)>,
    pub(super) arena: DevBuf,
    pub(super) scratch: DevBuf,
    pub(super) comm_scratch: DevBuf,
    pub(super) comm_half: u64,
    pub(super) ring: DevBuf,
    pub(super) params: Vec<Option<u64>>,
    pub(super) param_bufs: Vec<DevBuf>,
    pub(super) param_bytes: usize,
    pub(super) rope: Vec<Option<DevBuf>>,
    /// The routed expert GEMMs, and each routing source's index buffer (`routed.rs`).
    pub(super) routing: Routing,
    pub(super) route_index: Vec<Option<DevBuf>>,
    pub(super) events: Vec<CudaEvent>,
    pub(super) gemm: Option<GemmCache>,
    pub(super) inputs: Vec<Option<DevBuf>>,
    pub(super) host_i32: Vec<Option<Tensor>>,
    /// The value of each scalar float input of the last upload (an AdamW step count).
    pub(super) host_scalar: Vec<Option<f64>>,
    /// Per `AdamWUpdate`: its step's constants (`AdamWConsts::words`), written with the inputs
    /// of each run, so a captured CUDA graph reads each step's; `None` until a run's step
    /// count is known.
    pub(super) adamw_consts: Vec<Option<DevBuf>>,
    /// The captured run ([`CudaOptions::graphs`]).
    step_graph: Option<StepGraph>,
    /// The input addresses of the last eager run in graph mode: the next run with the same
    /// ones is captured.
    graph_warm: Option<Vec<u64>>,
}

impl std::fmt::Debug for CudaProgram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaProgram")
            .field("device", &self.dev)
            .field("nodes", &self.graph.len())
            .field("dtype", &self.opts.dtype)
            .field("arena_bytes", &self.arena_plan.total)
            .field("fused_groups", &self.fusion.groups.len())
            .finish()
    }
}

impl CudaProgram {
    /// Prepares `graph` for this rank on `dev`: plans, allocates, uploads parameters.
    pub fn prepare(
        dev: Arc<CudaDevice>,
        graph: &Graph,
        params: &ParamInit,
        ctx: &CudaRankCtx,
        opts: CudaOptions,
    ) -> Result<CudaProgram, CudaError> {
        let coords = ctx.coords();
        for v in graph.ids() {
            check_supported(graph, v, &coords, opts.dtype)?;
        }
        let dt = opts.dtype;
        let storage: Vec<Storage> = graph
            .nodes
            .iter()
            .map(|n| Storage::of(n.ty.dtype, dt))
            .collect();
        let mut routing = Routing::of(graph, opts.routed_experts, dt);
        let (mut arena_plan, mut fusion) =
            plan_memory_routed(graph, dt, opts.fuse, &routing.packed);
        // A source's index is filled when it runs as a node of its own (then the packing may
        // change, and the arena with it).
        let packed = routing.packed.clone();
        routing.keep_sources(graph, dt, |s| fusion.actions[s.index()] == Action::Run);
        if routing.packed != packed {
            (arena_plan, fusion) = plan_memory_routed(graph, dt, opts.fuse, &routing.packed);
        }
        let steps = schedule(graph);
        let n_events = steps
            .iter()
            .filter_map(|s| match s {
                Step::Record { event, .. } | Step::Wait { event, .. } => Some(*event as usize + 1),
                _ => None,
            })
            .max()
            .unwrap_or(0);
        let compute = dev.new_stream()?;
        let comm = dev.new_stream()?;
        let arena = alloc(&compute, arena_plan.total as usize, "activation arena")?;
        let (scratch_bytes, comm_half, ring_bytes) = scratch_sizes(
            graph,
            &storage,
            &fusion,
            dev.sm_count(),
            opts.split_kv_attention,
        );
        let scratch = alloc(&compute, scratch_bytes, "compute scratch")?;
        let ring = alloc(&compute, ring_bytes, "collective-matmul ring buffers")?;
        let comm_scratch = alloc(&compute, 2 * comm_half as usize, "collective scratch")?;
        let mut route_index: Vec<Option<DevBuf>> = (0..graph.len()).map(|_| None).collect();
        for &(source, experts, tokens) in &routing.sources {
            let bytes = Routing::index_bytes(experts, tokens);
            route_index[source.index()] = Some(alloc(&compute, bytes, "expert routing index")?);
        }
        let ctx_ref = dev.context();
        let events = (0..n_events)
            .map(|_| ctx_ref.new_event(None))
            .collect::<Result<Vec<_>, _>>()
            .map_err(CudaError::driver("create events"))?;
        let gemm = if graph.nodes.iter().any(|n| {
            matches!(
                n.op,
                Op::MatMul { .. }
                    | Op::FusedMatMul { .. }
                    | Op::AgMatMul { .. }
                    | Op::MatMulRs { .. }
                    | Op::WeightGrad { .. }
            )
        }) {
            Some(GemmCache::new(&compute, dev.compute_capability().0)?)
        } else {
            None
        };
        let mut p = CudaProgram {
            dev,
            compute,
            comm,
            graph: graph.clone(),
            opts,
            storage,
            arena_plan,
            fusion,
            steps,
            local_ids: crate::rank::local_ids(graph),
            coords,
            arena,
            scratch,
            comm_scratch,
            comm_half,
            ring,
            params: vec![None; graph.len()],
            param_bufs: Vec::new(),
            param_bytes: 0,
            rope: (0..graph.len()).map(|_| None).collect(),
            routing,
            route_index,
            events,
            gemm,
            inputs: (0..graph.len()).map(|_| None).collect(),
            host_i32: vec![None; graph.len()],
            host_scalar: vec![None; graph.len()],
            adamw_consts: (0..graph.len()).map(|_| None).collect(),
            step_graph: None,
            graph_warm: None,
        };
        p.load_params(params)?;
        p.load_rope_tables()?;
        p.warm_up()?;
        p.compute
            .synchronize()
            .map_err(CudaError::driver("synchronize after uploading parameters"))?;
        Ok(p)
    }

    /// Uploads every parameter once per distinct source, shape and dtype, but the weights of
    /// each sibling GEMM group, which go into one buffer of their own, `SiblingGemms::w_stride` apart
    /// in the group's order (the batched GEMM's weight stride). One host tensor is held at a
    /// time.
    fn load_params(&mut self, init: &ParamInit) -> Result<(), CudaError> {
        type Key = (ParamSource, Vec<usize>, DType);
        let params: Vec<ValueId> = self.graph.params().collect();
        // The distinct parameters, in graph order (the random seeds count them in that order),
        // and the one each parameter node reads.
        let mut distinct: HashMap<Key, usize> = HashMap::new();
        let mut firsts: Vec<ValueId> = Vec::new();
        let mut host_of = vec![usize::MAX; self.graph.len()];
        for &v in &params {
            let node = self.graph.node(v);
            let Op::Param(src) = &node.op else {
                unreachable!("invariant: Graph::params yields Param nodes")
            };
            let key = (src.clone(), node.ty.shape(), node.ty.dtype);
            let h = *distinct.entry(key).or_insert_with(|| {
                firsts.push(v);
                firsts.len() - 1
            });
            host_of[v.index()] = h;
        }
        // Each sibling group's weight buffer, and the slots in it each distinct parameter fills.
        let mut slots: Vec<Vec<(ValueId, u64)>> = vec![Vec::new(); firsts.len()];
        for group in &self.fusion.groups {
            let FusedGroup::Siblings(s) = group else {
                continue;
            };
            let stride = s.w_stride;
            let block = alloc(
                &self.compute,
                stride as usize * s.mms.len(),
                "sibling GEMM weights",
            )?;
            for (i, &m) in s.mms.iter().enumerate() {
                let w = self.graph.node(m).inputs[1];
                slots[host_of[w.index()]].push((w, block.ptr + i as u64 * stride));
            }
            self.param_bufs.push(block);
        }
        let coords = self.coords.clone();
        let mut ptr_of: Vec<u64> = vec![0; firsts.len()];
        for (h, &v) in firsts.iter().enumerate() {
            let node = self.graph.node(v);
            let Op::Param(src) = &node.op else {
                unreachable!("invariant: Graph::params yields Param nodes")
            };
            let t = match init {
                ParamInit::Weights(w) => {
                    w.load(src, &node.ty, &|axis| coords.get(axis).copied())?
                }
                ParamInit::Host(tensors) => host_param(tensors, src, &node.ty)?,
                ParamInit::Random { seed, scale } => {
                    let s = seed ^ (h as u64 + 1).wrapping_mul(0x9e37_79b9);
                    Tensor::f32(node.ty.shape(), random_values(s, node.ty.numel(), *scale))
                }
            };
            let data = HostData::of(&t, self.storage[v.index()], node.ty.dtype);
            let what = format!("parameter `{}`", src.name);
            self.param_bytes += data.bytes();
            if slots[h].is_empty() {
                let buf = data.upload(&self.compute, &what)?;
                ptr_of[h] = buf.ptr;
                self.param_bufs.push(buf);
            }
            // A sibling weight is written into its slot of each group that reads it (through
            // the buffer that holds the slot); its other readers use the first slot.
            for &(w, ptr) in &slots[h] {
                let buf = self
                    .param_bufs
                    .iter()
                    .find(|b| (b.ptr..b.ptr + b.bytes as u64).contains(&ptr))
                    .expect("invariant: the slot lies in a sibling weight buffer");
                data.write_at(&self.compute, buf, (ptr - buf.ptr) as usize, &what)?;
                self.params[w.index()] = Some(ptr);
            }
            if let Some(&(_, ptr)) = slots[h].first() {
                ptr_of[h] = ptr;
            }
        }
        for &v in &params {
            if self.params[v.index()].is_none() {
                self.params[v.index()] = Some(ptr_of[host_of[v.index()]]);
            }
        }
        Ok(())
    }

    fn load_rope_tables(&mut self) -> Result<(), CudaError> {
        for v in self.graph.ids() {
            let node = self.graph.node(v);
            // The gradient rotates by the negated angles: the frequencies negated.
            let (spec, sign) = match &node.op {
                Op::Rope(spec) => (spec, 1.0),
                Op::RopeGrad(spec) => (spec, -1.0),
                _ => continue,
            };
            let d = node.ty.last();
            let inv = spec.inv_freq(d).into_iter().map(|f| sign * f).collect();
            self.rope[v.index()] =
                Some(HostData::F32(inv).upload(&self.compute, "rope frequencies")?);
        }
        Ok(())
    }

    /// The device.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.dev
    }

    /// Bytes of the activation arena.
    pub fn arena_bytes(&self) -> u64 {
        self.arena_plan.total
    }

    /// Bytes of the distinct parameters uploaded.
    pub fn param_bytes(&self) -> usize {
        self.param_bytes
    }

    /// The fused groups in use.
    pub fn fused_groups(&self) -> &[FusedGroup] {
        &self.fusion.groups
    }

    /// The expert GEMMs computed on their routed rows only (`routed.rs`).
    pub fn routing(&self) -> &Routing {
        &self.routing
    }

    /// `(GEMM plans built, GEMM calls served from the plan cache)`.
    pub fn gemm_stats(&self) -> (usize, usize) {
        self.gemm.as_ref().map_or((0, 0), GemmCache::stats)
    }

    /// Runs the program: inputs up, every step, wait (watchdog), outputs down.
    pub fn run(
        &mut self,
        inputs: &BTreeMap<String, Tensor>,
        ctx: &CudaRankCtx,
    ) -> Result<BTreeMap<String, Tensor>, CudaError> {
        self.upload_inputs(inputs)?;
        self.enqueue(ctx)?;
        self.synchronize(ctx)?;
        self.outputs()
    }

    /// Uploads the graph inputs: each rank's chunk of the caller's global tensors, checked as
    /// the CPU executor checks them. An input of the same size as in the previous run is
    /// written into that run's buffer (stream-ordered after the run).
    pub fn upload_inputs(&mut self, inputs: &BTreeMap<String, Tensor>) -> Result<(), CudaError> {
        for v in self.graph.ids().collect::<Vec<_>>() {
            let node = self.graph.node(v);
            let Op::Input { name, shards } = &node.op else {
                continue;
            };
            let t = self.input_chunk(name, shards, v, inputs)?;
            if t.as_i32().is_some() {
                self.host_i32[v.index()] = Some(t.clone());
            }
            if let Some([x]) = t.as_f32() {
                self.host_scalar[v.index()] = Some(*x as f64);
            }
            let data = HostData::of(&t, self.storage[v.index()], node.ty.dtype);
            let what = format!("input `{name}`");
            // The previous run's buffer when it fits: its address stays put (graph replay).
            match &self.inputs[v.index()] {
                Some(buf) if buf.bytes == data.bytes() => data.write(&self.compute, buf, &what)?,
                _ => self.inputs[v.index()] = Some(data.upload(&self.compute, &what)?),
            }
        }
        self.write_adamw_consts()
    }

    /// Each `AdamWUpdate`'s constants for the step count just uploaded, into its buffer
    /// (stream-ordered after the previous run, which read the previous step's).
    fn write_adamw_consts(&mut self) -> Result<(), CudaError> {
        for v in self.graph.ids().collect::<Vec<_>>() {
            let node = self.graph.node(v);
            let Op::AdamWUpdate(spec) = &node.op else {
                continue;
            };
            let Some(t) = node.inputs.get(3).and_then(|s| self.host_scalar[s.index()]) else {
                self.adamw_consts[v.index()] = None;
                continue;
            };
            let data = HostData::F64(AdamWConsts::new(spec, t).words().to_vec());
            let what = format!("the AdamW constants of `{}`", node.name);
            match &self.adamw_consts[v.index()] {
                Some(buf) => data.write(&self.compute, buf, &what)?,
                None => self.adamw_consts[v.index()] = Some(data.upload(&self.compute, &what)?),
            }
        }
        Ok(())
    }

    fn input_chunk(
        &self,
        name: &str,
        shards: &[ShardSpec],
        v: ValueId,
        inputs: &BTreeMap<String, Tensor>,
    ) -> Result<Tensor, CudaError> {
        let node = self.graph.node(v);
        let t = crate::rank::input_chunk(node, name, shards, inputs, &|a| self.coord(a))?;
        Ok(t.into_owned())
    }

    pub(super) fn coord(&self, axis: &str) -> Result<(usize, usize), RuntimeError> {
        self.coords
            .get(axis)
            .copied()
            .ok_or_else(|| RuntimeError::MissingAxis {
                axis: axis.to_string(),
            })
    }

    /// The device address of value `v` (parameter, input or arena slot).
    pub(super) fn ptr(&self, v: ValueId) -> u64 {
        match &self.graph.node(v).op {
            Op::Param(_) => self.params[v.index()].expect("invariant: parameters are loaded"),
            Op::Input { .. } => {
                self.inputs[v.index()]
                    .as_ref()
                    .expect("invariant: inputs are uploaded before enqueue")
                    .ptr
            }
            _ => {
                self.arena.ptr
                    + self.arena_plan.slots[v.index()]
                        .expect("invariant: computed values have a slot")
                        .offset
            }
        }
    }

    pub(super) fn shape(&self, v: ValueId) -> Vec<usize> {
        self.graph.ty(v).shape()
    }

    /// Elements `v` occupies on the device (a packed value's routed rows only, `routed.rs`).
    pub(super) fn numel(&self, v: ValueId) -> usize {
        self.routing.stored_numel(&self.graph, v)
    }

    /// Enqueues every step on the streams (no host synchronisation), or with
    /// [`CudaOptions::graphs`] replays (or captures) the run's CUDA graph. Inputs must have
    /// been uploaded. When it returns, the compute stream's tail covers all work of the run.
    pub fn enqueue(&mut self, ctx: &CudaRankCtx) -> Result<(), CudaError> {
        for v in self.graph.ids() {
            if matches!(self.graph.node(v).op, Op::Input { .. }) && self.inputs[v.index()].is_none()
            {
                return Err(RuntimeError::MissingInput {
                    name: self.graph.node(v).name.clone(),
                }
                .into());
            }
        }
        if self.opts.graphs {
            self.enqueue_graph(ctx)
        } else {
            self.enqueue_eager(ctx)
        }
    }

    /// Graph mode: eager on the first run with these input buffers, captured on the second,
    /// replayed after that.
    fn enqueue_graph(&mut self, ctx: &CudaRankCtx) -> Result<(), CudaError> {
        if let Some(v) = graph_blocker(&self.graph) {
            return Err(self.unsupported(
                v,
                "it communicates, and runs that communicate cannot be captured into a CUDA \
                 graph; run this program without CUDA graphs",
            ));
        }
        for v in self.graph.ids() {
            self.check_host_values(v).map_err(|e| self.at_node(v, e))?;
        }
        let inputs: Vec<u64> = self.inputs.iter().flatten().map(|b| b.ptr).collect();
        if self.step_graph.as_ref().is_some_and(|g| g.inputs == inputs) {
            return self.launch_graph();
        }
        if self.graph_warm.as_ref() != Some(&inputs) {
            self.step_graph = None;
            self.enqueue_eager(ctx)?;
            self.graph_warm = Some(inputs);
            return Ok(());
        }
        self.capture(ctx, inputs)?;
        self.launch_graph()
    }

    /// Captures one run's launches on the compute stream (the comm stream joins through the
    /// run's fork and join events) into a graph and instantiates it. Nothing runs until the
    /// graph is launched.
    fn capture(&mut self, ctx: &CudaRankCtx, inputs: Vec<u64>) -> Result<(), CudaError> {
        self.step_graph = None;
        let compute = self.compute.clone();
        compute
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(CudaError::driver("begin capturing a run into a CUDA graph"))?;
        let enqueued = self.enqueue_eager(ctx);
        // Always end the capture, so the stream leaves capture mode when enqueuing failed too.
        let ended = compute.end_capture(CUgraphInstantiate_flags(0));
        enqueued?;
        let graph = ended.map_err(CudaError::driver(
            "end the capture of a run and instantiate its CUDA graph",
        ))?;
        if let Some(g) = &graph {
            g.upload()
                .map_err(CudaError::driver("upload the CUDA graph of a run"))?;
        }
        self.step_graph = Some(StepGraph { inputs, graph });
        Ok(())
    }

    fn launch_graph(&self) -> Result<(), CudaError> {
        match self.step_graph.as_ref().and_then(|g| g.graph.as_ref()) {
            Some(g) => g
                .launch()
                .map_err(CudaError::driver("launch the CUDA graph of a run")),
            None => Ok(()),
        }
    }

    /// Whether a run has been captured into a CUDA graph (replayed while the input buffers
    /// stay the same).
    pub fn has_graph(&self) -> bool {
        self.step_graph.is_some()
    }

    /// Enqueues every step on the streams, one launch at a time.
    fn enqueue_eager(&mut self, ctx: &CudaRankCtx) -> Result<(), CudaError> {
        let (dev, compute, comm) = (self.dev.clone(), self.compute.clone(), self.comm.clone());
        let lc = Launcher {
            dev: &dev,
            stream: &compute,
        };
        let lm = Launcher {
            dev: &dev,
            stream: &comm,
        };
        if self.opts.poison {
            lc.memset(self.arena.ptr, 0xff, self.arena_plan.total as usize)?;
        }
        // The comm stream sees the uploads, the poison and the previous run.
        comm.join(&compute)
            .map_err(CudaError::driver("order the comm stream after the uploads"))?;
        let steps = std::mem::take(&mut self.steps);
        let r = self.enqueue_steps(&steps, ctx, &lc, &lm);
        self.steps = steps;
        r?;
        compute
            .join(&comm)
            .map_err(CudaError::driver("join the comm stream"))
    }

    fn enqueue_steps(
        &mut self,
        steps: &[Step],
        ctx: &CudaRankCtx,
        lc: &Launcher,
        lm: &Launcher,
    ) -> Result<(), CudaError> {
        let mut inflight: VecDeque<InFlight> = VecDeque::new();
        let mut last_collective: Option<Vec<Slot>> = None;
        for step in steps {
            match step {
                Step::Kernel { value, .. } | Step::Gemm { value, .. } => {
                    let v = *value;
                    match self.fusion.actions[v.index()] {
                        Action::Skip => {}
                        Action::Run => {
                            self.guard(&mut inflight, &[v])?;
                            self.index_routes(v, lc).map_err(|e| self.at_node(v, e))?;
                            self.run_node(v, ctx, lc).map_err(|e| self.at_node(v, e))?;
                            if self.graph.node(v).op.communicates() {
                                // The ring joined both streams: every earlier collective is done.
                                inflight.clear();
                            }
                        }
                        Action::Fused(g) => {
                            let group = self.fusion.groups[g].clone();
                            self.guard(&mut inflight, &group.writes())?;
                            self.run_group(&group, lc)
                                .map_err(|e| self.at_node(group.head(), e))?;
                        }
                    }
                }
                Step::Collective { value, .. } => {
                    let v = *value;
                    self.run_collective(v, ctx, lm)?;
                    let x = self.graph.node(v).inputs[0];
                    last_collective = Some(
                        [x, v]
                            .iter()
                            .filter_map(|w| self.arena_plan.slots[w.index()])
                            .collect(),
                    );
                }
                Step::Record { event, stream } => {
                    let s = if *stream == COMM_STREAM { lm } else { lc };
                    self.events[*event as usize]
                        .record(s.stream)
                        .map_err(CudaError::driver("record an event"))?;
                    if *stream == COMM_STREAM {
                        if let Some(slots) = last_collective.take() {
                            inflight.push_back(InFlight {
                                event: *event as usize,
                                slots,
                            });
                        }
                    }
                }
                Step::Wait { event, stream } => {
                    let s = if *stream == COMM_STREAM { lm } else { lc };
                    s.stream
                        .wait(&self.events[*event as usize])
                        .map_err(CudaError::driver("wait for an event"))?;
                    if *stream != COMM_STREAM {
                        if let Some(i) = inflight.iter().position(|f| f.event == *event as usize) {
                            inflight.drain(..=i);
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Makes the compute stream wait for the newest in-flight collective whose buffers overlap
    /// the slots of `writes` (and, the comm stream being in order, for all older ones).
    fn guard(
        &self,
        inflight: &mut VecDeque<InFlight>,
        writes: &[ValueId],
    ) -> Result<(), CudaError> {
        let ws: Vec<Slot> = writes
            .iter()
            .filter_map(|w| self.arena_plan.slots[w.index()])
            .collect();
        let hit = inflight
            .iter()
            .rposition(|f| f.slots.iter().any(|s| ws.iter().any(|w| w.overlaps(s))));
        if let Some(i) = hit {
            self.compute
                .wait(&self.events[inflight[i].event])
                .map_err(CudaError::driver("wait for a collective"))?;
            inflight.drain(..=i);
        }
        Ok(())
    }

    /// Adds the node to a driver/kernel error's description.
    fn at_node(&self, v: ValueId, e: CudaError) -> CudaError {
        let node = self.graph.node(v);
        match e {
            CudaError::Driver { op, error } => CudaError::Driver {
                op: format!("{op} (node {v} `{}`)", node.name),
                error,
            },
            CudaError::Runtime(
                r @ (RuntimeError::Shape { .. } | RuntimeError::Unsupported { .. }),
            ) => CudaError::Runtime(RuntimeError::InNode {
                node: v,
                name: node.name.clone(),
                source: Box::new(r),
            }),
            other => other,
        }
    }

    /// Waits until the run's work is done, polling every communicator (whose watchdog fails a
    /// stalled collective, naming it) and failing after the options' timeout.
    pub fn synchronize(&self, ctx: &CudaRankCtx) -> Result<(), CudaError> {
        let done = self
            .compute
            .record_event(None)
            .map_err(CudaError::driver("record the end of the run"))?;
        let deadline = Instant::now() + self.opts.timeout;
        let mut nap = Duration::from_micros(20);
        loop {
            let finished = done
                .try_is_complete()
                .map_err(CudaError::driver("wait for the run"))?;
            for (axis, c) in ctx.comms() {
                c.poll().map_err(|e| CudaError::CommPoll {
                    axis: axis.to_string(),
                    source: Box::new(e),
                })?;
            }
            if finished {
                return Ok(());
            }
            if Instant::now() > deadline {
                for (_, c) in ctx.comms() {
                    c.abort("the run timed out");
                }
                return Err(CudaError::Timeout {
                    timeout_ms: self.opts.timeout.as_millis() as u64,
                });
            }
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_millis(1));
        }
    }

    /// The graph's named outputs of the last run, as host tensors (float values as f32).
    pub fn outputs(&self) -> Result<BTreeMap<String, Tensor>, CudaError> {
        let mut out = BTreeMap::new();
        for (name, v) in &self.graph.outputs {
            let t = download(
                &self.compute,
                self.ptr(*v),
                self.shape(*v),
                self.storage[v.index()],
                &format!("output `{name}`"),
            )?;
            out.insert(name.clone(), t);
        }
        Ok(out)
    }

    /// Device milliseconds per enqueue of the whole program, averaged over `iters` runs after
    /// `warmup` (inputs must be uploaded; measured with CUDA events on the compute stream).
    pub fn time(
        &mut self,
        ctx: &CudaRankCtx,
        warmup: usize,
        iters: usize,
    ) -> Result<f64, CudaError> {
        for _ in 0..warmup {
            self.enqueue(ctx)?;
        }
        self.synchronize(ctx)?;
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self
            .compute
            .record_event(timing)
            .map_err(CudaError::driver("record a timing event"))?;
        for _ in 0..iters {
            self.enqueue(ctx)?;
        }
        let end = self
            .compute
            .record_event(timing)
            .map_err(CudaError::driver("record a timing event"))?;
        self.synchronize(ctx)?;
        let ms = start
            .elapsed_ms(&end)
            .map_err(CudaError::driver("read a timing event"))?;
        Ok(ms as f64 / iters.max(1) as f64)
    }
}

impl Drop for CudaProgram {
    /// Buffers are freed stream-ordered on the compute stream; after a failed run the comm
    /// stream may still hold work that reads them, so drain both first (best effort: a failed
    /// run has aborted its communicators, so nothing waits forever).
    fn drop(&mut self) {
        let _ = self.comm.synchronize();
        let _ = self.compute.synchronize();
    }
}

/// Runs an unsharded graph on `dev` once: prepare, run, return the outputs.
pub fn execute_cuda(
    dev: &Arc<CudaDevice>,
    graph: &Graph,
    params: &ParamInit,
    inputs: &BTreeMap<String, Tensor>,
    opts: CudaOptions,
) -> Result<BTreeMap<String, Tensor>, CudaError> {
    let ctx = CudaRankCtx::new();
    CudaProgram::prepare(dev.clone(), graph, params, &ctx, opts)?.run(inputs, &ctx)
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardc_compiler::ir::{ParamView, TensorType};

    #[test]
    fn host_parameters_are_whole_named_f32_tensors() {
        let ty = TensorType::plain(DType::Bf16, &[2, 3]);
        let w = Tensor::f32(vec![2, 3], vec![1.0; 6]);
        let tensors = BTreeMap::from([("w".to_string(), w.clone())]);
        let whole = ParamSource::whole("w");
        assert_eq!(host_param(&tensors, &whole, &ty).unwrap(), w);
        // Missing, not whole, another shape, not f32: each an error naming the tensor.
        let missing = host_param(&tensors, &ParamSource::whole("v"), &ty).unwrap_err();
        assert!(missing.to_string().contains("`v`"), "{missing}");
        let view = ParamSource {
            view: Some(ParamView {
                dim: 0,
                start: 0,
                len: 1,
            }),
            ..whole.clone()
        };
        assert!(host_param(&tensors, &view, &ty).is_err());
        let other = TensorType::plain(DType::F32, &[3, 2]);
        let shape = host_param(&tensors, &whole, &other).unwrap_err();
        assert!(shape.to_string().contains("[3, 2]"), "{shape}");
        let ids = BTreeMap::from([("w".to_string(), Tensor::i32(vec![2, 3], vec![0; 6]))]);
        assert!(host_param(&ids, &whole, &ty).is_err());
    }
}
