//! The passes of the compile driver (`compile::compile`) as data: their names and order
//! ([`Pass`]), and the [`PassLog`] every pass reports to — it checks the pass's result (when
//! verifying), takes the `--dump-after` dump and times the pass.

use crate::ir::Graph;
use crate::shard::{Annotations, Mesh, ShardedGraph};
use std::fmt::Write as _;
use std::time::{Duration, Instant};
use thiserror::Error;

/// One pass of the driver, in pipeline order (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Pass {
    /// The logical forward graph.
    Build,
    /// The training graph: forward, backward, accumulation, AdamW (training only).
    Autodiff,
    /// The strategies' layouts.
    Annotate,
    /// Layout propagation and reshards: the SPMD program.
    Partition,
    /// Gradients and loss in their natural layout; shard-local ids for embedding gradients
    /// (training only).
    GradLayout,
    /// The e-graph rewriter.
    Rewrite,
    /// DDP gradient buckets (training only).
    Buckets,
    /// The step (each pipeline chunk's) cut into the micro-batch's program and the
    /// once-per-step program (training only).
    Split,
    /// Parameter all-gathers (ZeRO-3 / FSDP) issued one layer ahead of their use, so they
    /// overlap the previous layer's compute (training only).
    Prefetch,
    /// Pipeline chunks and instructions (pipelines only).
    Stages,
    /// Steps, buffers, memory and communication accounting.
    Schedule,
    /// The plan, verified.
    Plan,
}

impl Pass {
    /// Every pass, in order.
    pub const ALL: [Pass; 12] = [
        Pass::Build,
        Pass::Autodiff,
        Pass::Annotate,
        Pass::Partition,
        Pass::GradLayout,
        Pass::Rewrite,
        Pass::Buckets,
        Pass::Split,
        Pass::Prefetch,
        Pass::Stages,
        Pass::Schedule,
        Pass::Plan,
    ];

    /// The name `--dump-after` takes.
    pub fn name(self) -> &'static str {
        match self {
            Pass::Build => "build",
            Pass::Autodiff => "autodiff",
            Pass::Annotate => "annotate",
            Pass::Partition => "partition",
            Pass::GradLayout => "grad-layout",
            Pass::Rewrite => "rewrite",
            Pass::Buckets => "buckets",
            Pass::Split => "split",
            Pass::Prefetch => "prefetch",
            Pass::Stages => "stages",
            Pass::Schedule => "schedule",
            Pass::Plan => "plan",
        }
    }

    /// The pass named `name`; the error lists the valid names.
    pub fn from_name(name: &str) -> Result<Pass, UnknownPass> {
        Pass::ALL
            .into_iter()
            .find(|p| p.name() == name)
            .ok_or_else(|| UnknownPass {
                name: name.to_string(),
                valid: Pass::ALL.map(Pass::name).join(", "),
            })
    }

    /// Whether the pass runs for a job: `train` (training step), `pipelined` (a `pp` axis).
    pub fn runs_for(self, train: bool, pipelined: bool) -> bool {
        match self {
            Pass::Autodiff | Pass::GradLayout | Pass::Buckets => train,
            Pass::Split | Pass::Prefetch => train,
            Pass::Stages => pipelined,
            _ => true,
        }
    }
}

impl std::fmt::Display for Pass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// `--dump-after` names no pass.
#[derive(Debug, Clone, Error)]
#[error("unknown pass `{name}`; passes: {valid}")]
pub struct UnknownPass {
    /// The name given.
    pub name: String,
    /// Valid names.
    pub valid: String,
}

/// A pass's result that fails its check: a compiler bug, reported rather than panicking.
#[derive(Debug, Clone, Error)]
#[error("after pass `{pass}`{}: {msg}", .chunk.map(|c| format!(" (pipeline chunk {c})")).unwrap_or_default())]
pub struct VerifyError {
    /// The pass.
    pub pass: Pass,
    /// The pipeline chunk, when compiling one.
    pub chunk: Option<usize>,
    /// What is wrong (the first error; the node, field or step it names).
    pub msg: String,
}

/// The text IR of a program after a pass (`--dump-after`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PassDump {
    /// The pass.
    pub pass: Pass,
    /// The pipeline chunk (`None`: the whole program).
    pub chunk: Option<usize>,
    /// The text: the graph (see [`crate::ir::text`]), then each value's layout as comments
    /// on SPMD programs.
    pub text: String,
}

/// Wall time of one pass (of one chunk).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PassTiming {
    /// The pass.
    pub pass: Pass,
    /// The pipeline chunk, when compiling one.
    pub chunk: Option<usize>,
    /// Time since the previous pass ended.
    pub elapsed: Duration,
}

/// What the driver records and checks after each pass: the verifier (on by default in debug
/// and test builds), the dump of one pass, the time of each.
#[derive(Clone, Debug)]
pub struct PassLog {
    /// Check every pass's result.
    pub verify: bool,
    /// Dump the program after this pass.
    pub dump_after: Option<Pass>,
    /// The dumps taken.
    pub dumps: Vec<PassDump>,
    /// Per pass (and chunk), its time.
    pub timings: Vec<PassTiming>,
    pub(crate) chunk: Option<usize>,
    last: Instant,
}

impl Default for PassLog {
    /// Verify in debug and test builds, no dump.
    fn default() -> PassLog {
        PassLog::new(cfg!(debug_assertions), None)
    }
}

impl PassLog {
    /// A log that verifies when `verify` and dumps after `dump_after`.
    pub fn new(verify: bool, dump_after: Option<Pass>) -> PassLog {
        PassLog {
            verify,
            dump_after,
            dumps: Vec::new(),
            timings: Vec::new(),
            chunk: None,
            last: Instant::now(),
        }
    }

    /// An empty log with this one's settings, for a candidate compilation whose result may be
    /// dropped (see [`PassLog::join`]).
    pub(crate) fn fork(&self) -> PassLog {
        PassLog {
            chunk: self.chunk,
            ..PassLog::new(self.verify, self.dump_after)
        }
    }

    /// Takes back two forks: the dumps of the one whose result was `kept`, the pass times of
    /// both (both compilations ran).
    pub(crate) fn join(&mut self, kept: PassLog, dropped: PassLog) {
        self.dumps.extend(kept.dumps);
        self.timings.extend(kept.timings);
        self.timings.extend(dropped.timings);
        self.last = Instant::now();
    }

    /// Total time of `pass` over all chunks.
    pub fn time_of(&self, pass: Pass) -> Duration {
        self.timings
            .iter()
            .filter(|t| t.pass == pass)
            .map(|t| t.elapsed)
            .sum()
    }

    fn time(&mut self, pass: Pass) {
        let now = Instant::now();
        self.timings.push(PassTiming {
            pass,
            chunk: self.chunk,
            elapsed: now - self.last,
        });
        self.last = now;
    }

    fn fail(&self, pass: Pass, msg: String) -> VerifyError {
        VerifyError {
            pass,
            chunk: self.chunk,
            msg,
        }
    }

    fn dump(&mut self, pass: Pass, text: impl FnOnce() -> String) {
        if self.dump_after == Some(pass) {
            self.dumps.push(PassDump {
                pass,
                chunk: self.chunk,
                text: text(),
            });
        }
    }

    /// After a pass producing a logical graph: the IR verifier.
    pub(crate) fn graph(&mut self, pass: Pass, g: &Graph) -> Result<(), VerifyError> {
        self.time(pass);
        if self.verify {
            if let Err(errs) = crate::ir::verify(g) {
                return Err(self.fail(pass, errs[0].to_string()));
            }
        }
        self.dump(pass, || g.to_string());
        self.last = Instant::now();
        Ok(())
    }

    /// After `annotate`: the graph verified, every annotation of its value's rank over axes of
    /// `mesh`, once each.
    pub(crate) fn annotated(
        &mut self,
        g: &Graph,
        mesh: &Mesh,
        ann: &Annotations,
    ) -> Result<(), VerifyError> {
        let pass = Pass::Annotate;
        self.time(pass);
        if self.verify {
            for (&v, s) in &ann.values {
                if v.index() >= g.len() {
                    return Err(self.fail(pass, format!("annotation of {v}, not a node")));
                }
                crate::plan::check_layout(s, g.ty(v).rank(), mesh)
                    .map_err(|m| self.fail(pass, format!("{v} `{}`: {m}", g.node(v).name)))?;
            }
            for (name, s) in &ann.outputs {
                let Some(v) = g.output(name) else {
                    return Err(self.fail(pass, format!("annotation of `{name}`, not an output")));
                };
                crate::plan::check_layout(s, g.ty(v).rank(), mesh)
                    .map_err(|m| self.fail(pass, format!("output `{name}`: {m}")))?;
            }
        }
        self.dump(pass, || {
            let mut t = g.to_string();
            for (v, s) in &ann.values {
                let _ = writeln!(
                    t,
                    "// {v}: {}  ({})",
                    s.display(mesh),
                    ann.why.get(v).map_or("", String::as_str)
                );
            }
            for (name, s) in &ann.outputs {
                let _ = writeln!(t, "// output {name}: {}", s.display(mesh));
            }
            t
        });
        self.last = Instant::now();
        Ok(())
    }

    /// After a pass producing an SPMD program: every type re-derived, every layout of its
    /// node's rank over distinct axes of the mesh, every collective on a mesh axis of its size.
    pub(crate) fn sharded(&mut self, pass: Pass, sg: &ShardedGraph) -> Result<(), VerifyError> {
        self.time(pass);
        if self.verify {
            crate::plan::check_program(&sg.graph, &sg.shardings, &sg.mesh)
                .map_err(|e| self.fail(pass, e.to_string()))?;
            if sg.provenance.len() != sg.graph.len() {
                return Err(self.fail(
                    pass,
                    format!(
                        "{} provenance entries for {} nodes",
                        sg.provenance.len(),
                        sg.graph.len()
                    ),
                ));
            }
        }
        self.dump(pass, || sharded_text(sg));
        self.last = Instant::now();
        Ok(())
    }

    /// After `stages`, `schedule` or `plan`: the text is given; `check` runs when verifying.
    pub(crate) fn other(
        &mut self,
        pass: Pass,
        check: impl FnOnce() -> Result<(), String>,
        text: impl FnOnce() -> String,
    ) -> Result<(), VerifyError> {
        self.time(pass);
        if self.verify {
            check().map_err(|m| self.fail(pass, m))?;
        }
        self.dump(pass, text);
        self.last = Instant::now();
        Ok(())
    }
}

/// An SPMD program as text: the graph, then `// %N: layout` for every value.
pub fn sharded_text(sg: &ShardedGraph) -> String {
    let mut t = sg.graph.to_string();
    let _ = writeln!(t, "// mesh {}", sg.mesh);
    for (i, s) in sg.shardings.iter().enumerate() {
        let _ = writeln!(t, "// %{i}: {}", s.display(&sg.mesh));
    }
    t
}
