//! The CUDA backend's memory and fusion plan, executed on the CPU, for f32 and for bf16
//! storage: every value is written to its arena slot, whose 2-byte cells record who wrote them
//! (an element covers its storage size), and read back only while every cell of it still names
//! it; a fused group computes everything it writes at its head (the early writes the GPU does),
//! skipped nodes are not run, and a reshape alias is read from its root's cells. The outputs
//! must equal those of the same graph evaluated node by node with no arena. A plan that lets a
//! later value clobber bytes still to be read (the error names both), skips a node something
//! else needs, or misplaces a sibling GEMM's output fails here without a GPU.
//! Routed expert GEMMs (`cuda::Routing`) keep only their routed rows, by the gates their source
//! read when it ran (what `moe_route_index` sees), and every row they drop must be zero in the
//! dense result; a routed weight gradient sums over the routed rows only, so the rows it skips
//! of its zero-row operand must be zero. A routed GEMM whose unrouted rows nothing reads leaves
//! them unwritten: they read as NaN, and the outputs still equal the reference. A forward
//! attention whose output and lse rows a flash backward group reads marks the lse rows' cells in
//! the tail of its slot; when the group runs, the output and the marks must be intact.

use shardc_compiler::compile::{compile, CompileSpec, Job};
use shardc_compiler::ir::{DType, Graph, Op, ValueId};
use shardc_compiler::model::{build_forward, BuildOptions, ModelConfig};
use shardc_compiler::shard::Mesh;
use shardc_compiler::train::{Precision, TrainOptions};
use shardc_runtime::cuda::{
    plan_memory_routed, zero_rows, Action, ArenaPlan, FlashBwd, FusedGroup, FusionPlan, GpuDType,
    RoutedGemm, Routing, Storage,
};
use shardc_runtime::{eval_op, Buffer, Tensor};
use std::collections::HashMap;
use std::path::Path;

fn config(model: &str) -> ModelConfig {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hf-tiny");
    ModelConfig::from_path(&dir.join(model)).expect("fixture config")
}

/// Deterministic host values for every input and parameter of `g`: floats in ±0.1 (norm
/// weights near 1 would do as well: any values exercise the plan), i32 ids below `ids`.
fn leaves(g: &Graph, ids: i32) -> HashMap<ValueId, Tensor> {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut out = HashMap::new();
    for v in g.ids() {
        let node = g.node(v);
        if !matches!(node.op, Op::Input { .. } | Op::Param(_)) {
            continue;
        }
        let (shape, n) = (node.ty.shape(), node.ty.numel());
        let t = if node.ty.dtype == DType::I32 {
            Tensor::i32(
                shape,
                (0..n).map(|_| (next() % ids as u64) as i32).collect(),
            )
        } else if node.name.contains("step") {
            Tensor::f32(shape, vec![1.0; n])
        } else {
            let unit = |x: u64| (x >> 40) as f32 / (1u64 << 24) as f32;
            Tensor::f32(shape, (0..n).map(|_| 0.2 * unit(next()) - 0.1).collect())
        };
        out.insert(v, t);
    }
    out
}

/// `g` evaluated node by node, every value kept: the reference.
fn reference(g: &Graph, leaves: &HashMap<ValueId, Tensor>) -> Vec<Option<Tensor>> {
    let mut vals: Vec<Option<Tensor>> = vec![None; g.len()];
    for v in g.ids() {
        let node = g.node(v);
        let t = match leaves.get(&v) {
            Some(t) => t.clone(),
            None => {
                let ins: Vec<&Tensor> = node
                    .inputs
                    .iter()
                    .map(|i| vals[i.index()].as_ref().expect("defined"))
                    .collect();
                eval_op(&node.op, &ins, &node.ty)
                    .unwrap_or_else(|e| panic!("{} ({}): {e}", node.name, node.op.mnemonic()))
            }
        };
        vals[v.index()] = Some(t);
    }
    vals
}

/// Who last wrote a 2-byte cell of the arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cell {
    Empty,
    /// Element `.1` of a value.
    Elem(ValueId, usize),
    /// Row `.1` of the lse rows a forward attention keeps for its backward.
    Lse(ValueId, usize),
}

/// A run of `g` in the arena of `arena` (planned for storage dtype `dt`) with the fusion
/// decisions of `fusion`. The arena is tracked cell by cell (2 bytes): each element of a value
/// covers its storage size (2 bytes in bf16, 4 in f32 and for i32) at its slot's offset, and
/// records who wrote it; a read of a value requires every cell of it to still name it, so any
/// plan that lets a later value clobber bytes still to be read fails, at either dtype. The
/// values themselves are kept in f32, so the outputs equal the reference's to the bit.
struct Sim<'a> {
    g: &'a Graph,
    dt: GpuDType,
    arena: &'a ArenaPlan,
    fusion: &'a FusionPlan,
    leaves: &'a HashMap<ValueId, Tensor>,
    /// Every value of the reference run.
    want: &'a [Option<Tensor>],
    /// The arena's 2-byte cells.
    cells: Vec<Cell>,
    /// Each value written to its slot: what it was written as, and the elements left
    /// unwritten (a routed GEMM's unrouted rows, a packed value's unstored ones), NaN in it
    /// (whatever the arena held).
    written: HashMap<ValueId, (Tensor, Vec<bool>)>,
    routing: Routing,
    /// `cuda::zero_rows` of the graph.
    zero: Vec<Option<ValueId>>,
    /// The gates each routing source read when it ran.
    gates: HashMap<ValueId, Tensor>,
    /// Rows the routed GEMMs dropped.
    dropped: usize,
    /// Rows the routed GEMMs left unwritten (NaN here).
    unwritten: usize,
}

impl Sim<'_> {
    /// The first cell of `v`'s slot and the cells per element.
    fn cells_of(&self, v: ValueId) -> (usize, usize) {
        let slot = self.arena.slots[v.index()]
            .unwrap_or_else(|| panic!("{}: no slot", self.g.node(v).name));
        let elem = Storage::of(self.g.node(v).ty.dtype, self.dt).size_bytes();
        ((slot.offset / 2) as usize, elem / 2)
    }

    /// Where each element of `v` sits in its slot, in elements: its own index for a dense
    /// value; for a packed one (`Routing::packed`) within its routed row's packed row (expert by
    /// expert, each expert's tokens in order), `None` for a row its gates do not route.
    fn positions(&self, v: ValueId) -> Vec<Option<usize>> {
        let n = self.g.ty(v).numel();
        let Some(p) = self.routing.packed[v.index()] else {
            return (0..n).map(Some).collect();
        };
        let gates = self.gates[&p.source].as_f32().expect("f32 gates");
        let experts = self.g.ty(v).shape()[0];
        let tokens = n / (experts * p.width);
        let mut row_of = vec![None; experts * tokens];
        let mut next = 0;
        for e in 0..experts {
            for t in 0..tokens {
                if gates[t * experts + e] != 0.0 {
                    row_of[e * tokens + t] = Some(next);
                    next += 1;
                }
            }
        }
        assert!(
            next <= p.rows,
            "{}: {next} routed rows in a packing of {}",
            self.g.node(v).name,
            p.rows
        );
        (0..n)
            .map(|i| row_of[i / p.width].map(|r| r * p.width + i % p.width))
            .collect()
    }

    /// Writes `t` as `v`'s value, but for the elements `skip` names and those a packed value
    /// does not hold (all NaN in the value: whatever the arena held).
    fn store(&mut self, v: ValueId, t: &Tensor, skip: Option<Vec<bool>>) {
        let slot = self.arena.slots[v.index()].expect("slot");
        let (at, per) = self.cells_of(v);
        let stored = self.routing.stored_numel(self.g, v);
        assert!(
            (2 * per * stored) as u64 <= slot.size,
            "{}: {stored} elements in a {}-byte slot",
            self.g.node(v).name,
            slot.size
        );
        let pos = self.positions(v);
        let unwritten: Vec<bool> = (0..t.numel())
            .map(|i| pos[i].is_none() || skip.as_ref().is_some_and(|s| s[i]))
            .collect();
        let mut t = t.clone();
        if let Buffer::F32(x) = &mut t.data {
            for (x, &u) in x.iter_mut().zip(&unwritten) {
                if u {
                    *x = f32::NAN;
                }
            }
        }
        for (i, p) in pos.iter().enumerate() {
            if let (Some(p), false) = (p, unwritten[i]) {
                self.cells[at + p * per..at + (p + 1) * per].fill(Cell::Elem(v, i));
            }
        }
        self.written.insert(v, (t, unwritten));
    }

    /// `v`'s value read from its cells: each must still name `v` (or be one `v` left
    /// unwritten, NaN in the value already).
    fn read_cells(&self, v: ValueId) -> Tensor {
        let (t, skip) = &self.written[&v];
        let (at, per) = self.cells_of(v);
        let pos = self.positions(v);
        for i in 0..t.numel() {
            let Some(p) = pos[i].filter(|_| !skip[i]) else {
                continue;
            };
            for &c in &self.cells[at + p * per..at + (p + 1) * per] {
                if c != Cell::Elem(v, i) {
                    let by = match c {
                        Cell::Elem(w, _) | Cell::Lse(w, _) => self.g.node(w).name.as_str(),
                        Cell::Empty => "nothing",
                    };
                    panic!(
                        "{} ({:?}): element {i} was overwritten by {by} before this read",
                        self.g.node(v).name,
                        self.dt
                    );
                }
            }
        }
        t.clone()
    }

    /// Value `v` as the GPU would read it now. Inside a fused group (`within`), a value the
    /// plan never writes (a chain's intermediate, flash probabilities) is computed from its
    /// operands, as the fused launch does; anywhere else reading one is a planning error.
    fn load(&self, v: ValueId, within: Option<&mut HashMap<ValueId, Tensor>>) -> Tensor {
        let node = self.g.node(v);
        if let Some(t) = self.leaves.get(&v) {
            return t.clone();
        }
        if let Some(root) = self.arena.aliases[v.index()] {
            let mut t = self.load(root, within);
            t.shape = node.ty.shape();
            return t;
        }
        if self.written.contains_key(&v) {
            return self.read_cells(v);
        }
        let Some(cache) = within else {
            panic!(
                "{} ({}) is read before anything wrote it",
                node.name,
                node.op.mnemonic()
            );
        };
        if let Some(t) = cache.get(&v) {
            return t.clone();
        }
        let ins: Vec<Tensor> = node
            .inputs
            .iter()
            .map(|&i| self.load(i, Some(&mut *cache)))
            .collect();
        let refs: Vec<&Tensor> = ins.iter().collect();
        let t = eval_op(&node.op, &refs, &node.ty).expect("eval");
        cache.insert(v, t.clone());
        t
    }

    /// Routed GEMM `v`'s result `t` cut to its routed rows: every other row must already be
    /// zero (the routing's promise), and is written as zero, or as NaN where the GPU leaves it
    /// unwritten (`Routing::unfilled`: whatever the arena held; nothing may read it).
    /// Returns the elements left unwritten, if any.
    fn keep_routed_rows(&mut self, v: ValueId, t: &mut Tensor) -> Option<Vec<bool>> {
        let r = self.routing.gemms[v.index()].expect("routed");
        let name = self.g.node(v).name.clone();
        self.skip_rows(&name, &r, t, false);
        self.dropped += self.unrouted(&r).len();
        let packed = self.routing.packed[v.index()].is_some();
        if self.routing.unfilled[v.index()].is_none() && !packed {
            return None;
        }
        let width = t.numel() / (r.experts * r.tokens);
        let mut skip = vec![false; t.numel()];
        let Buffer::F32(out) = &mut t.data else {
            panic!("f32 result")
        };
        for (e, n) in self.unrouted(&r) {
            let row = (e * r.tokens + n) * width..(e * r.tokens + n + 1) * width;
            out[row.clone()].fill(f32::NAN);
            skip[row].fill(true);
            self.unwritten += 1;
        }
        Some(skip)
    }

    /// The `(expert, token)` rows `r`'s source did not route.
    fn unrouted(&self, r: &RoutedGemm) -> Vec<(usize, usize)> {
        let gates = self.gates[&r.source].as_f32().expect("f32 gates");
        (0..r.experts)
            .flat_map(|e| (0..r.tokens).map(move |n| (e, n)))
            .filter(|&(e, n)| gates[n * r.experts + e] == 0.0)
            .collect()
    }

    /// The rows of `t` (`[E, tokens, width]`) that `r`'s source did not route, set to zero
    /// (what the routed kernels, reading the routed rows only, see): each must be zero, or (an
    /// operand, `garbage_ok`) left unwritten by a routed GEMM upstream (all NaN here).
    fn skip_rows(&self, name: &str, r: &RoutedGemm, t: &mut Tensor, garbage_ok: bool) {
        let width = t.numel() / (r.experts * r.tokens);
        let rows = self.unrouted(r);
        let Buffer::F32(out) = &mut t.data else {
            panic!("f32 operand")
        };
        for (e, n) in rows {
            let row = &mut out[(e * r.tokens + n) * width..][..width];
            let unwritten = garbage_ok && row.iter().all(|x| x.is_nan());
            assert!(
                unwritten || row.iter().all(|&x| x == 0.0),
                "{name}: expert {e}, token {n} is not routed but its row is not zero"
            );
            row.fill(0.0);
        }
    }

    /// The cells of forward attention `a`'s saved lse rows (f32, 2 cells each), from its
    /// slot's start.
    fn lse_cells(&self, a: ValueId) -> std::ops::Range<usize> {
        let at = self
            .fusion
            .saved_lse(self.g, a, self.dt)
            .expect("saved lse");
        let ty = &self.g.node(a).ty;
        let start = self.cells_of(a).0 + at / 2;
        start..start + 2 * (ty.numel() / ty.last())
    }

    fn run(mut self) -> (Vec<(String, Tensor)>, usize, usize) {
        for v in self.g.ids() {
            if self.leaves.contains_key(&v) {
                continue;
            }
            match self.fusion.actions[v.index()] {
                Action::Skip => {}
                Action::Run => {
                    let node = self.g.node(v);
                    let mut ins: Vec<Tensor> =
                        node.inputs.iter().map(|&i| self.load(i, None)).collect();
                    // A routed GEMM reads its activation's routed rows only; a routed weight
                    // gradient both operands' (those with zero rows).
                    let (gemm, wg) = (
                        self.routing.gemms[v.index()],
                        self.routing.weight_grads[v.index()],
                    );
                    if let Some(r) = gemm.or(wg) {
                        let operands = if gemm.is_some() { 1 } else { 2 };
                        for (i, x) in ins.iter_mut().enumerate().take(operands) {
                            let id = node.inputs[i];
                            if self.zero[id.index()].is_some() {
                                self.skip_rows(&self.g.node(id).name, &r, x, true);
                            }
                        }
                        if wg.is_some() {
                            self.dropped += self.unrouted(&r).len();
                        }
                    }
                    let refs: Vec<&Tensor> = ins.iter().collect();
                    let mut t = eval_op(&node.op, &refs, &node.ty).expect("eval");
                    let skip = gemm.and_then(|_| self.keep_routed_rows(v, &mut t));
                    // A source's gates route the rows of what it writes (packed or not).
                    if self.routing.sources.iter().any(|&(s, _, _)| s == v) {
                        self.gates.insert(v, ins[1].clone());
                    }
                    self.store(v, &t, skip);
                    if self.fusion.saved_lse(self.g, v, self.dt).is_some() {
                        let cells = self.lse_cells(v);
                        let start = cells.start;
                        for c in cells {
                            self.cells[c] = Cell::Lse(v, (c - start) / 2);
                        }
                    }
                }
                Action::Fused(i) => {
                    // Everything the group writes is computed first, then written: the launch
                    // reads its operands before its results land.
                    let group = &self.fusion.groups[i];
                    if let FusedGroup::AttentionBwd(FlashBwd {
                        forward: Some(a), ..
                    }) = group
                    {
                        let name = &self.g.node(*a).name;
                        let o = self.load(*a, None);
                        let want = self.want[a.index()].as_ref().expect("reference");
                        assert!(
                            o.data == want.data,
                            "{name}: output clobbered before its backward"
                        );
                        let cells = self.lse_cells(*a);
                        let start = cells.start;
                        assert!(
                            cells
                                .into_iter()
                                .all(|c| self.cells[c] == Cell::Lse(*a, (c - start) / 2)),
                            "{name}: lse rows clobbered before its backward"
                        );
                    }
                    let mut cache = HashMap::new();
                    let outs: Vec<(ValueId, Tensor)> = group
                        .writes()
                        .into_iter()
                        .map(|w| (w, self.load(w, Some(&mut cache))))
                        .collect();
                    for (w, t) in outs {
                        self.store(w, &t, None);
                    }
                }
            }
        }
        let outs = self
            .g
            .outputs
            .iter()
            .map(|(name, v)| (name.clone(), self.load(*v, None)))
            .collect();
        (outs, self.dropped, self.unwritten)
    }
}

/// Runs `g`'s plan in its arena, unfused and fused (with routed expert GEMMs), planned for f32
/// and for bf16 storage, and compares every output with the reference: equal to the bit (the
/// same CPU kernels in the same order; the cells only track who wrote the bytes).
/// Returns the fused groups by label, the rows the routed GEMMs dropped and the rows they left
/// unwritten (NaN in the run; the outputs equal to the bit show nothing read them).
fn check(g: &Graph, what: &str, ids: i32) -> (HashMap<&'static str, usize>, usize, usize) {
    let leaves = leaves(g, ids);
    let want = reference(g, &leaves);
    let mut labels = HashMap::new();
    let (mut dropped, mut unwritten) = (0, 0);
    for (dt, fuse) in [GpuDType::F32, GpuDType::Bf16]
        .into_iter()
        .flat_map(|dt| [(dt, false), (dt, true)])
    {
        let routing = Routing::of(g, fuse, dt);
        let (arena, fusion) = plan_memory_routed(g, dt, fuse, &routing.packed);
        if fuse && dt == GpuDType::F32 {
            let packed = routing.packed.iter().flatten().count();
            if packed > 0 {
                labels.insert("packed values", packed);
            }
        }
        let sim = Sim {
            g,
            dt,
            arena: &arena,
            fusion: &fusion,
            leaves: &leaves,
            want: &want,
            cells: vec![Cell::Empty; (arena.total / 2) as usize],
            written: HashMap::new(),
            routing,
            zero: zero_rows(g),
            gates: HashMap::new(),
            dropped: 0,
            unwritten: 0,
        };
        let (outs, d, u) = sim.run();
        if dt == GpuDType::F32 {
            dropped += d;
            unwritten += u;
        }
        for (name, got) in outs {
            let v = g
                .outputs
                .iter()
                .find(|(n, _)| *n == name)
                .expect("output")
                .1;
            let want = want[v.index()].as_ref().expect("reference");
            assert_eq!(got.shape, want.shape, "{what} {dt:?} fuse={fuse}: `{name}`");
            assert!(
                got.data == want.data,
                "{what} {dt:?} fuse={fuse}: output `{name}` differs from the reference"
            );
        }
        if fuse && dt == GpuDType::F32 {
            for grp in &fusion.groups {
                *labels.entry(grp.label()).or_insert(0) += 1;
                if let FusedGroup::AttentionBwd(FlashBwd {
                    forward: Some(_), ..
                }) = grp
                {
                    *labels
                        .entry("attention_bwd from saved forward")
                        .or_insert(0) += 1;
                }
            }
        }
    }
    (labels, dropped, unwritten)
}

/// Forward programs of every fixture model: Llama's k/v and gate/up and Mixtral's k/v run as
/// sibling GEMMs (their outputs one block), next to the other fused groups; Mixtral's expert
/// GEMMs on their routed rows (half of them: top-2 of 4 experts), none writing the other rows:
/// the combine skips them; the `[E, tokens, ·]` values stored as their routed rows only.
#[test]
fn forward_plans_compute_the_graph_in_their_arena() {
    for (model, siblings) in [("llama", 2), ("mixtral", 1), ("gpt2", 0)] {
        let cfg = config(model);
        let g = build_forward(&cfg, BuildOptions::new(2, 8)).expect("graph");
        let (labels, dropped, unwritten) = check(&g, model, 16);
        assert_eq!(
            labels.get("sibling gemms").copied().unwrap_or(0),
            siblings * cfg.layers,
            "{model}: {labels:?}"
        );
        // Mixtral: 3 expert GEMMs a layer, 16 tokens, 2 of 4 experts not chosen per token.
        let want = if model == "mixtral" {
            cfg.layers * 3 * 16 * 2
        } else {
            0
        };
        assert_eq!(dropped, want, "{model}");
        assert_eq!(unwritten, want, "{model}");
        // Mixtral: the dispatch, gate, up, silu, the SwiGLU product and the down projection
        // stored packed.
        let packed = if model == "mixtral" {
            6 * cfg.layers
        } else {
            0
        };
        assert_eq!(labels.get("packed values").copied().unwrap_or(0), packed);
    }
}

/// An unsharded training step (forward, backward, AdamW): its flash attention backward groups,
/// every other fused group and (Mixtral) the routed expert GEMMs of the forward and of the
/// backward's activation gradients, their unrouted rows unwritten, leave the step's outputs
/// unchanged. Its weights are inputs
/// (the optimizer updates them), so no sibling GEMMs form.
#[test]
fn training_plans_compute_the_step_in_their_arena() {
    for model in ["llama", "gpt2", "mixtral"] {
        let cfg = config(model);
        let mut spec = CompileSpec::new(
            cfg.clone(),
            model,
            Job::Train(Box::new(TrainOptions::new(2, 8, Mesh::single()))),
        );
        spec.precision = Precision::f32();
        let g = compile(&spec).expect("training plan").program;
        let (labels, dropped, unwritten) = check(&g, model, 16);
        // Mixtral: 6 expert GEMMs (forward, activation gradients) and 3 weight gradients; no
        // GEMM writes its unrouted rows (every reader skips them).
        let per_layer = if model == "mixtral" {
            cfg.layers * 16 * 2
        } else {
            0
        };
        assert_eq!(dropped, 9 * per_layer, "{model}");
        assert_eq!(unwritten, 6 * per_layer, "{model}");
        // Mixtral: every [E, tokens, ·] value stored packed: the forward's six, their saved
        // views, and the backward's eight (the combine's gradient, the down projection's
        // activation gradient, the SwiGLU product's two, silu's, the gate and up projections'
        // and their sum).
        let packed = if model == "mixtral" {
            20 * cfg.layers
        } else {
            0
        };
        assert_eq!(labels.get("packed values").copied().unwrap_or(0), packed);
        // Every layer's backward reads its forward's output and lse.
        for label in ["attention_bwd", "attention_bwd from saved forward"] {
            assert_eq!(
                labels.get(label).copied(),
                Some(cfg.layers),
                "{model}: {labels:?}"
            );
        }
        assert_eq!(labels.get("sibling gemms"), None, "{model}: {labels:?}");
    }
}

/// Under activation recompute the backward's flash groups read the recomputed forward
/// attention (the one of the q, k, v they differentiate by), and selective recompute too.
#[test]
fn recompute_plans_read_the_recomputed_forward_attention() {
    use shardc_compiler::autodiff::Recompute;
    for recompute in [Recompute::Full, Recompute::Selective] {
        let cfg = config("llama");
        let mut opts = TrainOptions::new(2, 8, Mesh::single());
        opts.recompute = recompute;
        let mut spec = CompileSpec::new(cfg.clone(), "llama", Job::Train(Box::new(opts)));
        spec.precision = Precision::f32();
        let g = compile(&spec).expect("training plan").program;
        let (labels, _, _) = check(&g, &format!("llama {recompute:?}"), 16);
        for label in ["attention_bwd", "attention_bwd from saved forward"] {
            assert_eq!(
                labels.get(label).copied(),
                Some(cfg.layers),
                "{recompute:?}: {labels:?}"
            );
        }
    }
}
