//! Training steps on the CUDA backend: the training [`Plan`]'s program (forward, backward and
//! AdamW in one SPMD program) run on a GPU each step, its outputs assembled and committed by
//! the CPU trainer's own code (`train::train_step_with`), so a step's loss, gradients and
//! updated state are checked and kept exactly as on the CPU.
//!
//! Unsharded, the prepared program (arena, kernels, GEMM plans) stays on the device from step
//! to step and only the state and batch travel; with [`CudaOptions::graphs`] the third step on
//! replays the second's CUDA graph (the state and batch are written into the same buffers, and
//! AdamW reads each step's constants from device memory). On a mesh every rank runs on the one GPU as a
//! virtual rank with the `local-gpu` communicators, prepared afresh each step. Plans with a
//! pipeline or with a separate micro-batch step program are refused by name, and so is bf16
//! (it would store the weights and AdamW moments in bf16: see [`CudaTrainer::new`]).

use super::{run_spmd_local_gpu, CudaDevice, CudaError, CudaOptions, CudaProgram, CudaRankCtx};
use super::{GpuDType, ParamInit};
use crate::train::{train_step_with, Batch, StepOutput, TrainError, TrainState};
use crate::Weights;
use shardc_compiler::plan::Plan;
use std::sync::Arc;

/// Runs training steps of one plan on a GPU. See the module docs.
pub struct CudaTrainer<'p> {
    dev: Arc<CudaDevice>,
    plan: &'p Plan,
    weights: &'p Weights,
    opts: CudaOptions,
    /// The unsharded program, prepared on the first step.
    single: Option<CudaProgram>,
}

fn backend(e: impl std::error::Error + Send + Sync + 'static) -> TrainError {
    TrainError::Backend(Box::new(e))
}

impl<'p> CudaTrainer<'p> {
    /// A trainer of `plan` on `dev` (`weights` gives any parameter the program reads as a
    /// checkpoint tensor rather than as a step input).
    pub fn new(
        dev: Arc<CudaDevice>,
        plan: &'p Plan,
        weights: &'p Weights,
        opts: CudaOptions,
    ) -> Result<CudaTrainer<'p>, TrainError> {
        if plan.pipeline.is_some() {
            return Err(TrainError::PlanKind(
                "the CUDA backend trains plans without a pipeline (a mesh without pp); run \
                 pipelines on the CPU backend"
                    .into(),
            ));
        }
        if plan.train.is_none() {
            return Err(TrainError::PlanKind(
                "a forward plan given to the CUDA trainer".into(),
            ));
        }
        if opts.graphs && plan.mesh.world_size() > 1 {
            return Err(TrainError::PlanKind(
                "CUDA graphs capture one rank's launches: a mesh's ranks communicate, and runs \
                 that communicate cannot be captured (train on a mesh without CUDA graphs)"
                    .into(),
            ));
        }
        if opts.dtype == GpuDType::Bf16 {
            // Every float the backend stores is bf16: the weights and AdamW moments would be
            // rounded every step, and the updates and weight decay below their half-ulp lost.
            return Err(TrainError::PlanKind(
                "the CUDA backend trains in f32 (--dtype f32): in bf16 it would keep the weights \
                 and AdamW moments in bf16, rounding away small updates and the weight decay \
                 (mixed precision with f32 master weights is not implemented)"
                    .into(),
            ));
        }
        Ok(CudaTrainer {
            dev,
            plan,
            weights,
            opts,
            single: None,
        })
    }

    /// One step: the state and batch up, the program, the outputs down, assembled and
    /// committed to `state` (left as it was when the step fails or is not finite).
    pub fn step(
        &mut self,
        state: &mut TrainState,
        batch: &Batch,
    ) -> Result<StepOutput, TrainError> {
        let CudaTrainer {
            dev,
            plan,
            weights,
            opts,
            single,
        } = self;
        let params = ParamInit::Weights(weights);
        train_step_with(plan, state, batch, |inputs| {
            if plan.mesh.world_size() > 1 {
                return run_spmd_local_gpu(dev, &plan.program, &plan.mesh, &params, inputs, opts)
                    .map_err(backend);
            }
            let ctx = CudaRankCtx::new();
            let program = match single {
                Some(p) => p,
                None => single.insert(
                    CudaProgram::prepare(dev.clone(), &plan.program, &params, &ctx, opts.clone())
                        .map_err(backend)?,
                ),
            };
            let out: Result<_, CudaError> = program.run(inputs, &ctx);
            Ok(vec![out.map_err(backend)?])
        })
    }
}
