//! A config's sizes against the limits: the forward IR within the memory budget (measured by
//! building a one-layer graph), the activations within byte accounting, at most
//! [`MAX_LAYERS`] layers and [`MAX_PARAMS`] parameters; and the public constructors, which
//! parse a `config.json` and then check these.

use super::build::{build_forward, BuildOptions};
use super::config::{ModelConfig, ModelError};
use super::limits::{
    check_budget, human_bytes, product, IrWork, ACCOUNTING_LIMIT, MAX_LAYERS, MAX_PARAMS,
};
use serde_json::Value;
use std::path::Path;

impl ModelConfig {
    /// Reads a `config.json`, or the `config.json` inside a model directory. Errors name the
    /// file.
    pub fn from_path(path: &Path) -> Result<ModelConfig, ModelError> {
        let file = if path.is_dir() {
            path.join("config.json")
        } else {
            path.to_path_buf()
        };
        let text = std::fs::read_to_string(&file).map_err(|e| ModelError::Io {
            path: file.clone(),
            msg: e.to_string(),
        })?;
        let v: Value = serde_json::from_str(&text).map_err(|e| ModelError::Json {
            path: file.clone(),
            msg: e.to_string(),
        })?;
        ModelConfig::from_json(&v).map_err(|e| e.at(&file))
    }

    /// Interprets a parsed `config.json`: every size positive and within
    /// [`MAX_DIM`](super::MAX_DIM), the shape consistent, norm ε and RoPE parameters finite and
    /// positive, the forward IR within the memory budget and at most [`MAX_LAYERS`] layers.
    pub fn from_json(v: &Value) -> Result<ModelConfig, ModelError> {
        let cfg = ModelConfig::parse(v)?;
        cfg.check_size()?;
        Ok(cfg)
    }

    /// The sizes that need more than the config's fields.
    fn check_size(&self) -> Result<(), ModelError> {
        let k = self.keys();
        let bad = |key: &str, msg: String| Err(ModelError::key(key, msg));
        // The forward graph within the memory budget, the hard limits on layers (which bound
        // the time of what is built per layer) and parameters (which keep byte counts in 64
        // bits).
        self.check_ir(IrWork::Graph)?;
        if self.layers > MAX_LAYERS {
            return bad(
                k.layers,
                format!(
                    "at most {MAX_LAYERS} layers are supported (found {})",
                    self.layers
                ),
            );
        }
        let params = self.params_estimate();
        if params > MAX_PARAMS {
            return bad(
                &format!(
                    "{}={}, {}={}, {}={}, vocab_size={}",
                    k.hidden, self.hidden, k.ffn, self.ffn, k.layers, self.layers, self.vocab
                ),
                format!(
                    "the model would have ~{:.2e} parameters, more than the {:.2e} shardc supports",
                    params as f64, MAX_PARAMS as f64
                ),
            );
        }
        Ok(())
    }
}

/// Resident bytes per forward-graph node, measured on the bundled models (peak RSS over node
/// count, rounded up ~2×): the graph alone, a forward plan, a training step per micro-batch.
const BYTES_PER_NODE_GRAPH: u128 = 1 << 10;
const BYTES_PER_NODE_FORWARD: u128 = 6 << 10;
const BYTES_PER_NODE_TRAIN: u128 = 24 << 10;

impl ModelConfig {
    /// The config key of the layer count (`num_hidden_layers`, `n_layer`).
    pub fn layers_key(&self) -> &'static str {
        self.keys().layers
    }

    /// Nodes of the forward graph: `(base, per layer)`, counted on one- and two-layer graphs of
    /// this config. `None` when the small graphs cannot be built.
    fn graph_nodes(&self) -> Option<(u128, u128)> {
        let count = |layers: usize| -> Option<u128> {
            let mut c = self.clone();
            c.layers = layers;
            build_forward(&c, BuildOptions::new(1, 1))
                .ok()
                .map(|g| g.len() as u128)
        };
        let (one, two) = (count(1)?, count(2)?);
        let per_layer = two.checked_sub(one)?;
        Some((one.saturating_sub(per_layer), per_layer))
    }

    /// Estimated resident bytes of the IR for `work` (see [`IrWork`]).
    pub fn ir_bytes(&self, work: IrWork) -> u128 {
        // Without a small graph (an unbuildable config fails later with its own error), a
        // generous 64 nodes per layer.
        let (base, per_layer) = self.graph_nodes().unwrap_or((64, 64));
        let nodes = base + per_layer * self.layers as u128;
        let per_node = match work {
            IrWork::Graph => BYTES_PER_NODE_GRAPH,
            IrWork::Forward => BYTES_PER_NODE_FORWARD,
            IrWork::Train { micro_batches } => {
                BYTES_PER_NODE_FORWARD + BYTES_PER_NODE_TRAIN * micro_batches as u128
            }
        };
        nodes.saturating_mul(per_node)
    }

    /// An error naming the layer count (and micro-batches) when the IR for `work` would not
    /// fit the memory cap.
    pub fn check_ir(&self, work: IrWork) -> Result<(), ModelError> {
        let need = self.ir_bytes(work);
        check_budget(need, || {
            let mut what = format!("{}={}", self.layers_key(), self.layers);
            if let IrWork::Train { micro_batches } = work {
                if micro_batches > 1 {
                    what += &format!(" with {micro_batches} micro-batches");
                }
            }
            what + ": the IR"
        })?;
        Ok(())
    }

    /// Estimated bytes of one training step's activations at `batch` × `seq` (every layer's
    /// tensors, attention scores included, with headroom for gradients): only used to keep
    /// byte accounting in range.
    pub fn activation_bytes(&self, batch: usize, seq: usize) -> u128 {
        let (b, t) = (batch as u128, seq as u128);
        let bt = b.saturating_mul(t);
        let widest = [
            self.hidden as u128,
            self.ffn as u128 * self.moe.map_or(1, |m| m.top_k) as u128,
            self.vocab as u128,
            self.heads as u128 * self.head_dim as u128,
            self.moe.map_or(0, |m| m.experts) as u128,
        ]
        .into_iter()
        .max()
        .unwrap_or(0);
        let scores = product(&[bt, self.heads as u128, t]);
        let per_layer = product(&[16, bt, widest]).saturating_add(scores);
        // f32 elements, ×4 for backward, recomputation and optimizer temporaries.
        product(&[per_layer, self.layers as u128 + 1, 16])
    }

    /// An error naming `what` (the flags that set batch and sequence, `--batch 8 × --seq 4096`)
    /// when a step's activations would leave the range byte accounting can represent
    /// ([`ACCOUNTING_LIMIT`]).
    pub fn check_activations(
        &self,
        what: &str,
        batch: usize,
        seq: usize,
    ) -> Result<(), ModelError> {
        let need = self.activation_bytes(batch, seq);
        if need <= ACCOUNTING_LIMIT {
            return Ok(());
        }
        Err(ModelError::Key {
            key: what.to_string(),
            msg: format!(
                "a step's activations would be ~{}, beyond the {} shardc can account",
                human_bytes(need),
                human_bytes(ACCOUNTING_LIMIT)
            ),
        })
    }
}
