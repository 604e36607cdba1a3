//! Host-side planning of a CUDA run, with no GPU involved (unit-tested on CPU): the storage
//! dtype of each value, the activation arena, and which node chains run as one fused launch.
//!
//! - Storage: `i32` values stay `i32`; every float value (whatever the graph declares) is
//!   stored in the backend's dtype, f32 or bf16.
//! - Arena: [`shardc_compiler::schedule::arena`] (first-fit over live ranges) on the graph
//!   retyped to the storage dtypes, so a bf16 run needs half the bytes. Inputs and parameters
//!   live outside the arena.
//! - Fusion: a group is issued at its *head* node and writes its *tail* node's slot early;
//!   the nodes in between are skipped. A group is only formed when (a) its intermediates have
//!   no other users and are not outputs, (b) every extra operand is available at the head
//!   (a parameter, or a non-collective value defined before the head), and (c) the tail's slot
//!   overlaps no other value live between head and tail ([`early_write_ok`]), so writing it
//!   early clobbers nothing. [`plan_memory`] makes (c) hold for the operands of the head: the
//!   arena is planned with the tail also "using" them, so their bytes are not reused by it.
//! - Aliases: a `Reshape` of a computed value is a view of its operand's slot (tensors are
//!   contiguous, so every reshape is one), not a copy: [`plan_memory`] gives it its *root*'s
//!   slot (the first value up a chain of reshapes that is not one), plans the arena with the
//!   root live until the alias's last use, and skips the node. A reshape of an input or a
//!   parameter (no arena slot) stays a device copy.
//! - Sibling GEMMs: `MatMul`s of one activation by parameters of one shape (a grouped-query
//!   layer's k/v, gate/up; q/k/v without grouped heads) run as one strided-batched GEMM that
//!   reads the activation once (batch stride 0). Their outputs are planned as one block (the
//!   first one's node holds `k` equal 256-byte-rounded slots, live until the last reader of any
//!   of them; the others take no bytes of their own) and their weights are uploaded into one
//!   buffer the same way ([`sibling_stride`]).

pub use super::dtype::{GpuDType, Storage};
use super::flash::{flash_candidates, saved_forward_bytes, saved_lse_offset, FlashBwd};
use super::gemm::Epilogue;
use super::routed::Packed;
use shardc_compiler::ir::{DType, EwExpr, EwStep, Graph, Node, Op, TensorType, UnaryOp, ValueId};
use shardc_compiler::schedule::arena;
use shardc_kernels::launch::split_kv_reserve_bytes;
use shardc_kernels::{FusedExpr, FusedUnary};

/// A byte range of the arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    /// Offset from the arena base (256-byte aligned).
    pub offset: u64,
    /// Bytes (rounded up to 256).
    pub size: u64,
}

impl Slot {
    /// Whether two slots share a byte.
    pub fn overlaps(&self, other: &Slot) -> bool {
        self.offset < other.offset + other.size && other.offset < self.offset + self.size
    }
}

/// The activation arena of a graph: a slot per computed value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArenaPlan {
    /// Slot of each value (None for inputs and parameters); an alias has its root's slot.
    pub slots: Vec<Option<Slot>>,
    /// Arena size in bytes (the peak of live activations).
    pub total: u64,
    /// The root of each `Reshape` that aliases it (see the module docs); `None` elsewhere.
    pub aliases: Vec<Option<ValueId>>,
}

impl ArenaPlan {
    /// The arena `schedule::arena` plans for `ag` (the planning graph of `n` values), with
    /// the members of each sibling block at their offsets in the block its first member holds,
    /// and each alias in its root's slot.
    fn of(
        ag: &Graph,
        n: usize,
        aliases: Vec<Option<ValueId>>,
        blocks: &[&SiblingGemms],
    ) -> ArenaPlan {
        let (slots, total) = arena(ag);
        let mut out = vec![None; n];
        for s in slots {
            out[s.value.index()] = Some(Slot {
                offset: s.offset,
                size: s.size,
            });
        }
        for b in blocks {
            if let Some(base) = out[b.mms[0].index()] {
                for (i, m) in b.mms.iter().enumerate() {
                    out[m.index()] = Some(Slot {
                        offset: base.offset + i as u64 * b.out_stride,
                        size: b.out_stride,
                    });
                }
            }
        }
        for (v, root) in aliases.iter().enumerate() {
            if let Some(r) = root {
                out[v] = out[r.index()];
            }
        }
        ArenaPlan {
            slots: out,
            total,
            aliases,
        }
    }
}

impl ArenaPlan {
    /// Two values of `g` (the graph planned) that share bytes while both live, if any: the
    /// arena's invariant, with each alias counted as its root (sharing its bytes by design, and
    /// keeping it live until the alias's last use). `None` when it holds.
    pub fn live_overlap(&self, g: &Graph) -> Option<(ValueId, ValueId)> {
        let root = |v: usize| self.aliases[v].map_or(v, |r| r.index());
        let mut last = last_uses(g);
        for v in 0..g.len() {
            let r = root(v);
            last[r] = last[r].max(last[v]);
        }
        for (v, &lv) in last.iter().enumerate() {
            for w in v + 1..=lv.min(g.len().saturating_sub(1)) {
                if root(w) == root(v) {
                    continue;
                }
                if let (Some(a), Some(b)) = (self.slots[v], self.slots[w]) {
                    if a.overlaps(&b) {
                        return Some((ValueId(v as u32), ValueId(w as u32)));
                    }
                }
            }
        }
        None
    }
}

/// The root of every `Reshape` of `g` that can alias its operand's slot: the operand's own
/// root, when that is a computed value stored like the reshape.
pub fn reshape_aliases(g: &Graph, dt: GpuDType) -> Vec<Option<ValueId>> {
    let mut roots: Vec<Option<ValueId>> = vec![None; g.len()];
    for v in g.ids() {
        let node = g.node(v);
        if !matches!(node.op, Op::Reshape) {
            continue;
        }
        let x = node.inputs[0];
        let root = roots[x.index()].unwrap_or(x);
        let computed = !matches!(g.node(root).op, Op::Input { .. } | Op::Param(_));
        let same = Storage::of(g.ty(root).dtype, dt) == Storage::of(node.ty.dtype, dt);
        if computed && same {
            roots[v.index()] = Some(root);
        }
    }
    roots
}

/// The graph with every float value retyped to `dt` (what the device stores).
pub fn retyped(g: &Graph, dt: GpuDType) -> Graph {
    let mut r = g.clone();
    for n in &mut r.nodes {
        if n.ty.dtype != DType::I32 {
            n.ty.dtype = dt.ir();
        }
    }
    r
}

/// The arena of `g` stored in `dt`, by `shardc_compiler::schedule::arena`.
pub fn plan_arena(g: &Graph, dt: GpuDType) -> ArenaPlan {
    ArenaPlan::of(&retyped(g, dt), g.len(), vec![None; g.len()], &[])
}

/// Index of each value's last use (its own index when unused; `len` for graph outputs), the
/// live ranges `schedule::arena` allocates by.
pub fn last_uses(g: &Graph) -> Vec<usize> {
    let n = g.len();
    let mut last: Vec<usize> = (0..n).collect();
    for v in g.ids() {
        for &i in &g.node(v).inputs {
            last[i.index()] = last[i.index()].max(v.index());
        }
    }
    for &(_, v) in &g.outputs {
        last[v.index()] = n;
    }
    last
}

/// A chain of nodes run as one launch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FusedGroup {
    /// `MatMul` [→ `Add(bias)`] [→ `gelu_tanh`] as one cuBLASLt call with an epilogue.
    Gemm {
        /// The MatMul (head).
        mm: ValueId,
        /// The bias parameter, with a bias epilogue.
        bias: Option<ValueId>,
        /// The last node of the chain, whose slot receives the result.
        out: ValueId,
        /// The epilogue.
        epilogue: Epilogue,
    },
    /// `Add(x, r)` → `RmsNorm(sum, w)` as one `add_rmsnorm` launch writing both.
    AddRmsNorm {
        /// The Add (head); its value is still materialised.
        add: ValueId,
        /// The RmsNorm (tail).
        norm: ValueId,
    },
    /// `AttentionProbs` and its three `AttentionGrad`s as the FlashAttention-2 backward
    /// (`flash.rs`): the probabilities skipped (no bytes), the gradients written at the first.
    AttentionBwd(FlashBwd),
    /// Sibling `MatMul`s as one strided-batched GEMM (see the module docs).
    Siblings(SiblingGemms),
    /// `Unary(silu)(g)` → `Mul(·, u)` as one `swiglu` launch.
    SwiGlu {
        /// The silu (head).
        silu: ValueId,
        /// The Mul (tail).
        mul: ValueId,
        /// The silu's operand.
        gate: ValueId,
        /// The Mul's other operand.
        up: ValueId,
    },
}

impl FusedGroup {
    /// The node the group is issued at.
    pub fn head(&self) -> ValueId {
        match self {
            FusedGroup::Gemm { mm, .. } => *mm,
            FusedGroup::AddRmsNorm { add, .. } => *add,
            FusedGroup::AttentionBwd(f) => f.head(),
            FusedGroup::Siblings(s) => s.mms[0],
            FusedGroup::SwiGlu { silu, .. } => *silu,
        }
    }

    /// The node whose slot is written early (the last of them).
    pub fn tail(&self) -> ValueId {
        match self {
            FusedGroup::Gemm { out, .. } => *out,
            FusedGroup::AddRmsNorm { norm, .. } => *norm,
            FusedGroup::AttentionBwd(f) => f.tail(),
            FusedGroup::Siblings(s) => s.mms[s.mms.len() - 1],
            FusedGroup::SwiGlu { mul, .. } => *mul,
        }
    }

    /// Every value the group's launches write.
    pub fn writes(&self) -> Vec<ValueId> {
        match self {
            FusedGroup::AddRmsNorm { add, norm } => vec![*add, *norm],
            FusedGroup::AttentionBwd(f) => f.grads().to_vec(),
            FusedGroup::Siblings(s) => s.mms.clone(),
            other => vec![other.tail()],
        }
    }

    /// Short name for reports (`gemm+bias+gelu`, `add+rmsnorm`, `attention_bwd`,
    /// `sibling gemms`, `swiglu`).
    pub fn label(&self) -> &'static str {
        match self {
            FusedGroup::Gemm { epilogue, .. } => match epilogue {
                Epilogue::None => "gemm",
                Epilogue::Bias => "gemm+bias",
                Epilogue::GeluBias => "gemm+bias+gelu",
                Epilogue::Gelu => "gemm+gelu",
            },
            FusedGroup::AddRmsNorm { .. } => "add+rmsnorm",
            FusedGroup::AttentionBwd(_) => "attention_bwd",
            FusedGroup::Siblings(_) => "sibling gemms",
            FusedGroup::SwiGlu { .. } => "swiglu",
        }
    }
}

/// `MatMul { transpose_b }` nodes `mms` (in graph order, at least two) of one activation by
/// distinct parameters of one 2-D shape, run as one GEMM of batch `mms.len()`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SiblingGemms {
    /// The MatMuls; the first is the head.
    pub mms: Vec<ValueId>,
    /// Bytes from one output to the next in the arena (one output's bytes, rounded up to 256).
    pub out_stride: u64,
    /// Bytes from one weight to the next in the group's weight buffer (likewise).
    pub w_stride: u64,
}

/// The distance in bytes between consecutive members of a sibling block holding `bytes` each:
/// `bytes` rounded up to 256 (every member stays 256-byte aligned, and the distance is a whole
/// number of elements of any dtype).
pub fn sibling_stride(bytes: usize) -> u64 {
    (bytes as u64).div_ceil(256) * 256
}

/// What the executor does at a node's step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Compute the node by itself.
    Run,
    /// Nothing: a fused group computed it (or made it unnecessary).
    Skip,
    /// Issue fused group `i` (this node is its head).
    Fused(usize),
}

/// The fusion decisions for a graph.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FusionPlan {
    /// Per node.
    pub actions: Vec<Action>,
    /// The groups (`Action::Fused` indexes them).
    pub groups: Vec<FusedGroup>,
}

impl FusionPlan {
    /// Where forward attention node `v` of `g` (stored as `dt`) writes its lse rows, as a byte
    /// offset into its own slot, when an attention backward group reads them
    /// ([`FlashBwd::forward`]); `None` when it writes none.
    pub fn saved_lse(&self, g: &Graph, v: ValueId, dt: GpuDType) -> Option<usize> {
        self.groups
            .iter()
            .any(|grp| matches!(grp, FusedGroup::AttentionBwd(f) if f.forward == Some(v)))
            .then(|| saved_lse_offset(g, v, dt))
    }
}

/// Whether writing `tail`'s slot while issuing `head` is safe: no value other than those in
/// `exclude` that is live somewhere in `[head, tail)` (defined before `tail`, last used at or
/// after `head`) overlaps `tail`'s slot.
pub fn early_write_ok(
    arena: &ArenaPlan,
    last: &[usize],
    head: ValueId,
    tail: ValueId,
    exclude: &[ValueId],
) -> bool {
    let Some(t) = arena.slots[tail.index()] else {
        return false;
    };
    (0..tail.index()).all(|w| {
        let live = last[w] >= head.index();
        let excluded = exclude.iter().any(|e| e.index() == w);
        match arena.slots[w] {
            Some(s) if live && !excluded => !s.overlaps(&t),
            _ => true,
        }
    })
}

/// The arena (with reshape aliases) and the fused groups of `g` stored in `dt` (no groups when
/// `fuse` is false); an alias's node is skipped.
///
/// Candidates come from pattern matching; the arena is planned on the graph with each
/// candidate's tail also using its head's operands (the fused launch reads them while writing
/// the tail); each candidate is then kept only if [`early_write_ok`] holds in that arena.
pub fn plan_memory(g: &Graph, dt: GpuDType, fuse: bool) -> (ArenaPlan, FusionPlan) {
    plan_memory_routed(g, dt, fuse, &[])
}

/// [`plan_memory`] with the values `packed` names (`Routing::packed`; an empty slice for none)
/// given only the bytes of their packed rows.
pub fn plan_memory_routed(
    g: &Graph,
    dt: GpuDType,
    fuse: bool,
    packed: &[Option<Packed>],
) -> (ArenaPlan, FusionPlan) {
    let mut flash = if fuse {
        flash_candidates(g)
    } else {
        Vec::new()
    };
    // A flash group whose early writes would clobber a live value (which its shape rules out,
    // see flash.rs) is dropped and the arena planned again without it.
    loop {
        let (arena, plan, rejected) = plan_with(g, dt, fuse, &flash, packed);
        match rejected {
            None => return (arena, plan),
            Some(i) => {
                flash.remove(i);
            }
        }
    }
}

/// [`plan_memory`] with the flash groups `flash`: the plan, or the index of a flash group that
/// cannot write its gradients early in it.
fn plan_with(
    g: &Graph,
    dt: GpuDType,
    fuse: bool,
    flash: &[(FlashBwd, Option<ValueId>)],
    packed: &[Option<Packed>],
) -> (ArenaPlan, FusionPlan, Option<usize>) {
    let n = g.len();
    let candidates = if fuse {
        candidate_groups(g, dt)
    } else {
        Vec::new()
    };
    let mut ag = retyped(g, dt);
    for (v, p) in packed.iter().enumerate() {
        if let Some(p) = p {
            let node = &mut ag.nodes[v];
            node.ty = TensorType::plain(node.ty.dtype, &[p.numel()]);
        }
    }
    for (group, _) in &candidates {
        if matches!(group, FusedGroup::Siblings(_)) {
            continue; // planned as a block below
        }
        let head_ops = g.node(group.head()).inputs.clone();
        ag.nodes[group.tail().index()].inputs.extend(head_ops);
    }
    // The probabilities of a flash group take no bytes; its last gradient "reads" their mask
    // (the launch reads it while writing all three) and the other two gradients, so the three
    // (written together) never share bytes.
    for (f, mask) in flash {
        let node = &mut ag.nodes[f.probs.index()];
        node.ty = TensorType::plain(node.ty.dtype, &[0]);
        let tail = f.tail();
        if let Some(m) = mask {
            ag.nodes[tail.index()].inputs.push(*m);
        }
        let others = f.grads().into_iter().filter(|&v| v != tail);
        ag.nodes[tail.index()].inputs.extend(others);
        // A forward attention the group reads holds its output and lse rows in one slot, live
        // until the group's last gradient (the launch reads it while writing all three).
        if let Some(a) = f.forward {
            let node = &mut ag.nodes[a.index()];
            let elems = saved_forward_bytes(g, a, dt) / node.ty.dtype.size_bytes();
            node.ty = TensorType::plain(node.ty.dtype, &[elems]);
            ag.nodes[tail.index()].inputs.push(a);
        }
    }
    // An alias takes no bytes of its own; its root stays live while any reader of the alias
    // (or an output naming it) is.
    let aliases = reshape_aliases(g, dt);
    for (v, root) in aliases.iter().enumerate() {
        if let Some(r) = root {
            lives_in(&mut ag, ValueId(v as u32), *r, "aliased");
        }
    }
    // A sibling block lives in its first member's node, sized for every member; the others take
    // no bytes and keep the block live while any of their readers (or an output) is.
    let blocks: Vec<&SiblingGemms> = candidates
        .iter()
        .filter_map(|(group, _)| match group {
            FusedGroup::Siblings(s) => Some(s),
            _ => None,
        })
        .collect();
    for b in &blocks {
        let head = b.mms[0];
        let (dtype, elem) = (ag.ty(head).dtype, ag.ty(head).dtype.size_bytes() as u64);
        let block = b.mms.len() as u64 * b.out_stride / elem;
        ag.nodes[head.index()].ty = TensorType::plain(dtype, &[block as usize]);
        for &m in &b.mms[1..] {
            lives_in(&mut ag, m, head, "sibling block");
        }
    }
    let mut arena = ArenaPlan::of(&ag, n, aliases, &blocks);
    let last = last_uses(&ag);
    for (f, _) in flash {
        arena.slots[f.probs.index()] = None;
    }
    let mut plan = FusionPlan {
        actions: vec![Action::Run; n],
        groups: Vec::new(),
    };
    for (v, root) in arena.aliases.iter().enumerate() {
        if root.is_some() {
            plan.actions[v] = Action::Skip;
        }
    }
    for (group, members) in candidates {
        let mut exclude = members.clone();
        exclude.push(group.head());
        let head = group.head();
        let ok = match &group {
            // Every member is written at the head; its slot was planned as a block, so this
            // holds by construction, and is checked.
            FusedGroup::Siblings(s) => s.mms[1..]
                .iter()
                .all(|&m| early_write_ok(&arena, &last, head, m, &exclude)),
            _ => early_write_ok(&arena, &last, head, group.tail(), &exclude),
        };
        if !ok {
            continue;
        }
        let gi = plan.groups.len();
        plan.actions[group.head().index()] = Action::Fused(gi);
        for m in &members {
            plan.actions[m.index()] = Action::Skip;
        }
        plan.groups.push(group);
    }
    for (i, (f, _)) in flash.iter().enumerate() {
        let grads = f.grads();
        let ok = grads
            .iter()
            .all(|&v| v == f.head() || early_write_ok(&arena, &last, f.head(), v, &grads));
        if !ok {
            return (arena, plan, Some(i));
        }
        plan.actions[f.probs.index()] = Action::Skip;
        for v in grads {
            plan.actions[v.index()] = Action::Skip;
        }
        plan.actions[f.head().index()] = Action::Fused(plan.groups.len());
        plan.groups.push(FusedGroup::AttentionBwd(*f));
    }
    (arena, plan, None)
}

/// In planning graph `ag`, `v` takes no bytes of its own and lives in `holder`'s: every reader
/// of `v` (and an output naming it, as `holder (why)`) keeps `holder` live.
fn lives_in(ag: &mut Graph, v: ValueId, holder: ValueId, why: &str) {
    let node = &mut ag.nodes[v.index()];
    node.ty = TensorType::plain(node.ty.dtype, &[0]);
    for user in &mut ag.nodes {
        if user.inputs.contains(&v) {
            user.inputs.push(holder);
        }
    }
    if ag.outputs.iter().any(|&(_, o)| o == v) {
        let name = format!("{} ({why})", ag.node(holder).name);
        ag.outputs.push((name, holder));
    }
}

/// Pattern-matched fused groups (non-overlapping, in head order) with their skipped members.
fn candidate_groups(g: &Graph, dt: GpuDType) -> Vec<(FusedGroup, Vec<ValueId>)> {
    let n = g.len();
    let users = g.users();
    let is_output = |v: ValueId| g.outputs.iter().any(|&(_, o)| o == v);
    let only_user = |v: ValueId| -> Option<ValueId> {
        match users[v.index()].as_slice() {
            [u] if !is_output(v) => Some(*u),
            _ => None,
        }
    };
    let is_param = |v: ValueId| matches!(g.node(v).op, Op::Param(_));
    let mut taken = vec![false; n];
    let mut out = Vec::new();
    for v in g.ids() {
        if taken[v.index()] {
            continue;
        }
        let group = match &g.node(v).op {
            Op::MatMul { .. } => gemm_group(g, v, &only_user, &is_param),
            Op::Add => add_rmsnorm_group(g, v, &users, &is_param),
            Op::Unary(UnaryOp::Silu) => swiglu_group(g, v, &only_user),
            _ => None,
        };
        let Some((group, members)) = group else {
            continue;
        };
        if members.iter().any(|m| taken[m.index()]) {
            continue;
        }
        taken[group.head().index()] = true;
        for m in &members {
            taken[m.index()] = true;
        }
        out.push((group, members));
    }
    for s in sibling_gemms(g, dt, &taken, &is_param) {
        let members = s.mms[1..].to_vec();
        out.push((FusedGroup::Siblings(s), members));
    }
    out
}

/// The sibling GEMMs of `g` stored in `dt` among the `MatMul`s no other group has `taken`: per
/// activation, the MatMuls with one `transpose_b` by distinct parameters of one 2-D shape and
/// dtype.
fn sibling_gemms(
    g: &Graph,
    dt: GpuDType,
    taken: &[bool],
    is_param: &dyn Fn(ValueId) -> bool,
) -> Vec<SiblingGemms> {
    // (activation, transpose_b, weight shape, weight dtype) → its MatMuls.
    type Key = (ValueId, bool, Vec<usize>, DType);
    let mut by_key: Vec<(Key, Vec<ValueId>)> = Vec::new();
    for v in g.ids() {
        let node = g.node(v);
        let Op::MatMul { transpose_b } = node.op else {
            continue;
        };
        let (a, w) = (node.inputs[0], node.inputs[1]);
        if taken[v.index()] || !is_param(w) || g.ty(w).rank() != 2 || node.ty.numel() == 0 {
            continue;
        }
        let key = (a, transpose_b, g.ty(w).shape(), g.ty(w).dtype);
        match by_key.iter_mut().find(|(k, _)| *k == key) {
            Some((_, mms)) => {
                if mms.iter().all(|&m| g.node(m).inputs[1] != w) {
                    mms.push(v);
                }
            }
            None => by_key.push((key, vec![v])),
        }
    }
    // A parameter has one address: a weight read by two groups' MatMuls (of two activations)
    // would need one in each block, so the later group is dropped.
    let mut used = vec![false; g.len()];
    by_key
        .into_iter()
        .filter(|(_, mms)| {
            let ok = mms.len() >= 2 && mms.iter().all(|&m| !used[g.node(m).inputs[1].index()]);
            if ok {
                for &m in mms {
                    used[g.node(m).inputs[1].index()] = true;
                }
            }
            ok
        })
        .map(|(_, mms)| {
            // One activation by one weight shape: the outputs are of one type, the weights too.
            let stride = |ty: &TensorType| {
                sibling_stride(ty.numel() * Storage::of(ty.dtype, dt).size_bytes())
            };
            let out_stride = stride(g.ty(mms[0]));
            let w_stride = stride(g.ty(g.node(mms[0]).inputs[1]));
            SiblingGemms {
                mms,
                out_stride,
                w_stride,
            }
        })
        .collect()
}

/// `MatMul` → `Add(bias param [N])` → `gelu_tanh`, any suffix of which exists.
fn gemm_group(
    g: &Graph,
    mm: ValueId,
    only_user: &dyn Fn(ValueId) -> Option<ValueId>,
    is_param: &dyn Fn(ValueId) -> bool,
) -> Option<(FusedGroup, Vec<ValueId>)> {
    let node = g.node(mm);
    if g.ty(node.inputs[1]).rank() != 2 {
        return None; // batched GEMMs take no epilogue
    }
    let n_out = node.ty.last();
    let mut members = Vec::new();
    let mut out = mm;
    let mut bias = None;
    if let Some(add) = only_user(mm) {
        let a = g.node(add);
        if matches!(a.op, Op::Add)
            && a.inputs[0] == mm
            && is_param(a.inputs[1])
            && g.ty(a.inputs[1]).shape() == [n_out]
        {
            bias = Some(a.inputs[1]);
            members.push(add);
            out = add;
        }
    }
    let mut gelu = false;
    if let Some(u) = only_user(out) {
        if matches!(g.node(u).op, Op::Unary(UnaryOp::GeluTanh)) {
            gelu = true;
            members.push(u);
            out = u;
        }
    }
    let epilogue = match (bias.is_some(), gelu) {
        (false, false) => return None,
        (true, false) => Epilogue::Bias,
        (true, true) => Epilogue::GeluBias,
        (false, true) => Epilogue::Gelu,
    };
    Some((
        FusedGroup::Gemm {
            mm,
            bias,
            out,
            epilogue,
        },
        members,
    ))
}

/// `Add(x, r)` (same shapes) → its first `RmsNorm(sum, w param)` user.
fn add_rmsnorm_group(
    g: &Graph,
    add: ValueId,
    users: &[Vec<ValueId>],
    is_param: &dyn Fn(ValueId) -> bool,
) -> Option<(FusedGroup, Vec<ValueId>)> {
    let a = g.node(add);
    if !g.ty(a.inputs[0]).same_shape(g.ty(a.inputs[1])) {
        return None;
    }
    let norm = *users[add.index()].iter().find(|&&u| {
        let un = g.node(u);
        matches!(un.op, Op::RmsNorm { .. }) && un.inputs[0] == add && is_param(un.inputs[1])
    })?;
    Some((FusedGroup::AddRmsNorm { add, norm }, vec![norm]))
}

/// `silu(gate)` → `Mul(silu, up)` (or `Mul(up, silu)`), `up` of the same shape, defined before
/// the silu and not a collective result.
fn swiglu_group(
    g: &Graph,
    silu: ValueId,
    only_user: &dyn Fn(ValueId) -> Option<ValueId>,
) -> Option<(FusedGroup, Vec<ValueId>)> {
    let mul = only_user(silu)?;
    let m = g.node(mul);
    if !matches!(m.op, Op::Mul) {
        return None;
    }
    let up = if m.inputs[0] == silu {
        m.inputs[1]
    } else {
        m.inputs[0]
    };
    let ok = up != silu
        && up.index() < silu.index()
        && g.ty(up).same_shape(g.ty(silu))
        && !g.node(up).op.is_collective();
    ok.then(|| {
        (
            FusedGroup::SwiGlu {
                silu,
                mul,
                gate: g.node(silu).inputs[0],
                up,
            },
            vec![mul],
        )
    })
}

/// The kernel expression of an IR elementwise program over `n_inputs` operands, when the
/// generator can express it: `Cast` to the storage precision (f32, or bf16 when the run is
/// bf16) is the identity; other casts are not expressible (`None`).
pub fn fused_expr(expr: &EwExpr, n_inputs: usize, dt: GpuDType) -> Option<FusedExpr> {
    let mut vals: Vec<FusedExpr> = (0..n_inputs).map(FusedExpr::input).collect();
    for s in &expr.steps {
        let arg = |i: u32| vals.get(i as usize).cloned();
        let e = match *s {
            EwStep::Add { a, b } => arg(a)? + arg(b)?,
            EwStep::Mul { a, b } => arg(a)? * arg(b)?,
            EwStep::Unary { f, x } => FusedExpr::unary(fused_unary(f), arg(x)?),
            EwStep::Scale { c, x } => FusedExpr::scale(arg(x)?, c.0),
            EwStep::Cast { to, x } => match (to, dt) {
                (DType::F32, _) | (DType::Bf16, GpuDType::Bf16) => arg(x)?,
                _ => return None,
            },
        };
        vals.push(e);
    }
    (!expr.steps.is_empty()).then(|| vals.pop()).flatten()
}

fn fused_unary(u: UnaryOp) -> FusedUnary {
    match u {
        UnaryOp::GeluTanh => FusedUnary::GeluTanh,
        UnaryOp::GeluErf => FusedUnary::GeluErf,
        UnaryOp::Silu => FusedUnary::Silu,
        UnaryOp::Relu => FusedUnary::Relu,
        UnaryOp::Exp => FusedUnary::Exp,
        UnaryOp::Neg => FusedUnary::Neg,
    }
}

/// Where an attention node's parts of the compute scratch go: the f32 copy of its mask (bf16
/// runs) at offset 0, then the split-KV workspace (256-byte aligned).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct AttentionScratch {
    /// Byte offset of the split-KV workspace in the compute scratch.
    pub workspace_offset: usize,
    /// Its bytes: `split_kv_reserve_bytes` of the node's shape, or 0 (no split-KV) without
    /// `split_kv`.
    pub workspace_bytes: usize,
}

impl AttentionScratch {
    /// Compute-scratch bytes the node needs in all.
    pub fn total(&self) -> usize {
        self.workspace_offset + self.workspace_bytes
    }
}

/// The compute-scratch layout of attention node `node` of `g` (q `[B, Tq, Hq, D]`, k `[B, S,
/// Hkv, D]`, optional mask as the 4th input) on a device with `sm_count` SMs, with room for the
/// split-KV workspace when `split_kv` (`CudaOptions::split_kv_attention`). Sized at plan time,
/// so no launch allocates.
pub(super) fn attention_scratch(
    g: &Graph,
    node: &Node,
    sm_count: usize,
    split_kv: bool,
) -> AttentionScratch {
    let mask_bytes = node.inputs.get(3).map_or(0, |&m| 4 * g.ty(m).numel());
    let (q, k) = (g.ty(node.inputs[0]).shape(), g.ty(node.inputs[1]).shape());
    let workspace_bytes = match (q.as_slice(), k.as_slice()) {
        ([b, t, hq, d], [_, s, hkv, _]) if split_kv => {
            split_kv_reserve_bytes([*b, *t, *s, *hq, *hkv, *d], sm_count)
        }
        _ => 0,
    };
    AttentionScratch {
        workspace_offset: mask_bytes.div_ceil(256) * 256,
        workspace_bytes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::fixture;
    use shardc_compiler::ir::{Float, TensorType};
    use shardc_compiler::model::{build_forward, BuildOptions};

    fn param(g: &mut Graph, name: &str, shape: &[usize]) -> ValueId {
        g.param(name, TensorType::plain(DType::F32, shape))
    }

    /// A bf16 training step: each layer's flash group reads its forward attention, whose slot
    /// holds the bf16 output, then (256 bytes rounded) the f32 lse rows, and shares no byte with
    /// the group's gradients. Without fusion no forward writes an lse.
    #[test]
    fn flash_groups_read_their_forwards_output_and_lse() {
        use shardc_compiler::compile::{compile, CompileSpec, Job};
        use shardc_compiler::shard::Mesh;
        use shardc_compiler::train::TrainOptions;
        let cfg = fixture("llama");
        let opts = TrainOptions::new(2, 16, Mesh::single());
        let spec = CompileSpec::new(cfg.clone(), "llama", Job::Train(Box::new(opts)));
        let g = compile(&spec).expect("training step").program;
        let dt = GpuDType::Bf16;
        let (arena, plan) = plan_memory(&g, dt, true);
        let mut groups = 0;
        for grp in &plan.groups {
            let FusedGroup::AttentionBwd(f) = grp else {
                continue;
            };
            let a = f.forward.expect("the forward attention is kept");
            assert!(matches!(g.node(a).op, Op::Attention(_)));
            let ty = g.ty(a);
            let out = (ty.numel() * 2).div_ceil(256) * 256;
            assert_eq!(plan.saved_lse(&g, a, dt), Some(out));
            let slot = arena.slots[a.index()].expect("slot");
            let want = (out + 4 * ty.numel() / ty.last()).div_ceil(256) * 256;
            assert_eq!(slot.size, want as u64, "{}", g.node(a).name);
            for d in f.grads() {
                let ds = arena.slots[d.index()].expect("gradient slot");
                assert!(
                    !slot.overlaps(&ds),
                    "{} and {}",
                    g.node(a).name,
                    g.node(d).name
                );
            }
            groups += 1;
        }
        assert_eq!(groups, cfg.layers);
        let (_, unfused) = plan_memory(&g, dt, false);
        assert!(g.ids().all(|v| unfused.saved_lse(&g, v, dt).is_none()));
    }

    #[test]
    fn arena_is_reused_and_halved_for_bf16() {
        let cfg = fixture("llama");
        let g = build_forward(&cfg, BuildOptions::new(2, 16)).unwrap();
        let a32 = plan_arena(&g, GpuDType::F32);
        let a16 = plan_arena(&g, GpuDType::Bf16);
        let sum: u64 = a32.slots.iter().flatten().map(|s| s.size).sum();
        // Liveness reuse: the peak is far below the sum of every activation.
        assert!(a32.total * 4 < sum, "arena {} vs sum {sum}", a32.total);
        // bf16 storage needs about half (256-byte rounding aside).
        assert!(
            a16.total <= a32.total / 2 + 256 * 64,
            "{} vs {}",
            a16.total,
            a32.total
        );
        // i32 values keep 4 bytes; floats shrink.
        assert_eq!(Storage::of(DType::I32, GpuDType::Bf16).size_bytes(), 4);
        assert_eq!(Storage::of(DType::F32, GpuDType::Bf16).size_bytes(), 2);
        // With fusion the arena grows by little (the tails' early live ranges).
        let (fused, _) = plan_memory(&g, GpuDType::F32, true);
        assert!(
            fused.total <= a32.total * 3 / 2,
            "{} vs {}",
            fused.total,
            a32.total
        );
        // No two values live at once share bytes, with and without fusion (and aliases).
        for arena in [&a32, &fused] {
            assert_eq!(
                arena.live_overlap(&g),
                None,
                "values overlap while both live"
            );
        }
        assert!(
            fused.aliases.iter().any(Option::is_some),
            "no reshape aliased"
        );
    }

    /// Plans the fixture `model`'s 2 × 16 forward graph at `dt` with fusion; checks that each
    /// layer has one group labelled `per_layer` and at least one labelled `at_least_per_layer`.
    /// Returns the graph and its fusion plan.
    fn fuses_per_layer(
        model: &str,
        dt: GpuDType,
        per_layer: &str,
        at_least_per_layer: &str,
    ) -> (Graph, FusionPlan) {
        let cfg = fixture(model);
        let g = build_forward(&cfg, BuildOptions::new(2, 16)).unwrap();
        let (_, plan) = plan_memory(&g, dt, true);
        let count = |l: &str| plan.groups.iter().filter(|x| x.label() == l).count();
        assert_eq!(count(per_layer), cfg.layers, "{:?}", plan.groups);
        assert!(count(at_least_per_layer) >= cfg.layers, "{:?}", plan.groups);
        (g, plan)
    }

    #[test]
    fn llama_fuses_add_rmsnorm_and_swiglu() {
        // 3 layers: each has a SwiGLU, and each layer's attention residual feeds the MLP norm.
        let (g, plan) = fuses_per_layer("llama", GpuDType::F32, "swiglu", "add+rmsnorm");
        // Members are skipped, heads issue their group.
        for (i, grp) in plan.groups.iter().enumerate() {
            assert_eq!(plan.actions[grp.head().index()], Action::Fused(i));
            assert_eq!(plan.actions[grp.tail().index()], Action::Skip);
        }
        // Without fusion only the reshape aliases are skipped, and they save bytes.
        let (plain, off) = plan_memory(&g, GpuDType::F32, false);
        assert!(off.groups.is_empty());
        for (v, a) in off.actions.iter().enumerate() {
            let skip = plain.aliases[v].is_some();
            assert_eq!(*a, if skip { Action::Skip } else { Action::Run }, "%{v}");
        }
        let no_alias = plan_arena(&g, GpuDType::F32);
        assert!(
            plain.total <= no_alias.total,
            "{} vs {}",
            plain.total,
            no_alias.total
        );
        assert_eq!(plain.live_overlap(&g), None);
    }

    #[test]
    fn sibling_gemms_share_an_activation_and_a_weight_shape() {
        // x·w1, x·w2 (one shape), x·w3 (another), y·w1 (w1 again, another activation), x·z (a
        // computed right operand): only {x·w1, x·w2} is a group.
        let mut g = Graph::new();
        let x = g.input("x", TensorType::plain(DType::F32, &[2, 5, 64]));
        let y = g.input("y", TensorType::plain(DType::F32, &[2, 5, 64]));
        let (w1, w2) = (
            param(&mut g, "w1", &[64, 24]),
            param(&mut g, "w2", &[64, 24]),
        );
        let w3 = param(&mut g, "w3", &[64, 40]);
        let w4 = param(&mut g, "w4", &[64, 24]);
        let mm = |g: &mut Graph, a, b, name: &str| {
            let v = g
                .add(Op::MatMul { transpose_b: false }, &[a, b], name)
                .unwrap();
            g.set_output(name, v);
            v
        };
        let a1 = mm(&mut g, x, w1, "a1");
        let a3 = mm(&mut g, x, w3, "a3");
        let a2 = mm(&mut g, x, w2, "a2");
        let b1 = mm(&mut g, y, w1, "b1");
        let b4 = mm(&mut g, y, w4, "b4");
        let z = g.add(Op::Unary(UnaryOp::Exp), &[w2], "z").unwrap();
        mm(&mut g, x, z, "c");
        let (arena, plan) = plan_memory(&g, GpuDType::Bf16, true);
        let siblings: Vec<&SiblingGemms> = plan
            .groups
            .iter()
            .filter_map(|grp| match grp {
                FusedGroup::Siblings(s) => Some(s),
                _ => None,
            })
            .collect();
        // y·w1 and y·w4 would share w1 with the first group: dropped.
        assert_eq!(siblings.len(), 1, "{:?}", plan.groups);
        let s = siblings[0];
        assert_eq!(s.mms, vec![a1, a2]);
        assert_eq!(s.out_stride, sibling_stride(2 * 5 * 24 * 2));
        assert_eq!(s.w_stride, sibling_stride(64 * 24 * 2));
        assert_eq!(plan.actions[a1.index()], Action::Fused(0));
        assert_eq!(plan.actions[a2.index()], Action::Skip);
        for v in [a3, b1, b4] {
            assert_eq!(plan.actions[v.index()], Action::Run);
        }
        // The outputs are one block: the second `out_stride` after the first, both outputs of
        // the graph and live to the end with nothing else in between.
        let (s1, s2) = (
            arena.slots[a1.index()].unwrap(),
            arena.slots[a2.index()].unwrap(),
        );
        assert_eq!(s2.offset, s1.offset + s.out_stride);
        assert_eq!(arena.live_overlap(&g), None);
        // Without fusion, no group and no block.
        let (_, off) = plan_memory(&g, GpuDType::Bf16, false);
        assert!(off.groups.is_empty());
    }

    #[test]
    fn gpt2_fuses_bias_and_gelu_epilogues() {
        fuses_per_layer("gpt2", GpuDType::Bf16, "gemm+bias+gelu", "gemm+bias");
    }

    #[test]
    fn early_write_refuses_clobbering_a_live_value() {
        // x → a = exp(x) ; b = 2a ; c = mm(b, w) ; d = c + bias. Writing d while the GEMM still
        // reads b is only safe if d's slot avoids b's.
        let mut g = Graph::new();
        let x = g.input("x", TensorType::plain(DType::F32, &[4, 64]));
        let a = g.add(Op::Unary(UnaryOp::Exp), &[x], "a").unwrap();
        let b = g.add(Op::Scale(Float(2.0)), &[a], "b").unwrap();
        let w = param(&mut g, "w", &[64, 64]);
        let c = g
            .add(Op::MatMul { transpose_b: false }, &[b, w], "c")
            .unwrap();
        let bias = param(&mut g, "bias", &[64]);
        let d = g.add(Op::Add, &[c, bias], "d").unwrap();
        g.set_output("d", d);
        // Without the extended live ranges first-fit hands d the bytes of b (dead after c).
        let plain = plan_arena(&g, GpuDType::F32);
        let last = last_uses(&g);
        assert_eq!(plain.slots[d.index()], plain.slots[b.index()]);
        assert!(!early_write_ok(&plain, &last, c, d, &[c]));
        // plan_memory keeps b alive until d, so the group is safe and formed.
        let (arena, plan) = plan_memory(&g, GpuDType::F32, true);
        assert_eq!(plan.groups.len(), 1, "{:?}", plan.groups);
        assert!(!arena.slots[d.index()]
            .unwrap()
            .overlaps(&arena.slots[b.index()].unwrap()));
    }

    #[test]
    fn attention_scratch_holds_mask_then_split_kv_workspace() {
        use shardc_compiler::ir::AttnSpec;
        use shardc_kernels::launch::split_kv_workspace_bytes;
        let spec = AttnSpec {
            causal: true,
            window: None,
            scale: Float(0.125),
            indexed: false,
        };
        let mut g = Graph::new();
        let ty = |shape: &[usize]| TensorType::plain(DType::F32, shape);
        let q = g.input("q", ty(&[1, 1, 32, 128]));
        let k = g.input("k", ty(&[1, 4099, 8, 128]));
        let v = g.input("v", ty(&[1, 4099, 8, 128]));
        let mask = g.input("mask", ty(&[1, 4099]));
        let plain = g
            .add(Op::Attention(spec), &[q, k, v], "plain")
            .expect("valid attention");
        let masked = g
            .add(Op::Attention(spec), &[q, k, v, mask], "masked")
            .expect("valid attention");
        // 132 SMs: 8 blocks per split, 50 splits wanted, 4099 / 256 = 16 allowed.
        let ws = split_kv_workspace_bytes([1, 1, 4099, 32, 8, 128], 16);
        let at = |v, split_kv| attention_scratch(&g, g.node(v), 132, split_kv);
        assert_eq!(at(plain, true).workspace_offset, 0);
        assert_eq!(at(plain, true).total(), ws);
        // The f32 mask (4 x 4099 bytes) first, the workspace 256-byte aligned after it.
        assert_eq!(at(masked, true).workspace_offset, 16_640);
        assert_eq!(at(masked, true).total(), 16_640 + ws);
        assert_eq!(at(masked, false).total(), 16_640);
        assert_eq!(at(plain, false).total(), 0);
    }
}
