//! HuggingFace `config.json` → [`ModelConfig`], a normalised description of the five supported
//! architectures. Accepts transformers 4 and 5 layouts (`rope_theta` at the top level or under
//! `rope_parameters`; `head_dim` absent or null; `rope_scaling` or `rope_parameters` for the
//! scaling type).

use crate::ir::{Float, RopeScaling, RopeSpec, RopeStyle, UnaryOp};
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};
use thiserror::Error;

/// An error reading or interpreting a model config.
#[derive(Debug, Error)]
pub enum ModelError {
    /// The file could not be read.
    #[error("cannot read {path}: {msg}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The OS error.
        msg: String,
    },
    /// The file is not valid JSON.
    #[error("{path}: malformed JSON: {msg}")]
    Json {
        /// The path.
        path: PathBuf,
        /// The parser's message.
        msg: String,
    },
    /// `model_type` is not one of the supported architectures.
    #[error("unknown model_type {found:?}: supported are gpt2, llama, mistral, qwen2, mixtral")]
    UnknownModelType {
        /// What the config says (empty when absent).
        found: String,
    },
    /// A required key is missing or has the wrong type.
    #[error("config key `{key}`: {msg}")]
    Key {
        /// The key.
        key: String,
        /// What is wrong.
        msg: String,
    },
    /// The config asks for something shardc does not implement.
    #[error("unsupported config: {0}")]
    Unsupported(String),
}

/// The supported architectures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arch {
    /// GPT-2: learned positions, LayerNorm, fused QKV Conv1D, GeLU MLP, tied head.
    Gpt2,
    /// Llama 1/2/3: RMSNorm, RoPE, GQA, SwiGLU.
    Llama,
    /// Mistral: Llama plus sliding-window attention.
    Mistral,
    /// Qwen2: Llama plus q/k/v biases.
    Qwen2,
    /// Mixtral: Mistral with a top-k mixture of SwiGLU experts.
    Mixtral,
}

impl Arch {
    /// The HF `model_type` string.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Gpt2 => "gpt2",
            Arch::Llama => "llama",
            Arch::Mistral => "mistral",
            Arch::Qwen2 => "qwen2",
            Arch::Mixtral => "mixtral",
        }
    }
}

/// Normalisation flavour.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormKind {
    /// RMSNorm (weight only).
    Rms,
    /// LayerNorm (weight and bias).
    Layer,
}

/// Mixture-of-experts settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeConfig {
    /// Experts per layer.
    pub experts: usize,
    /// Experts per token.
    pub top_k: usize,
}

/// A normalised model description.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// Architecture.
    pub arch: Arch,
    /// Vocabulary size.
    pub vocab: usize,
    /// Model width.
    pub hidden: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// MLP (or expert) intermediate width.
    pub ffn: usize,
    /// Maximum positions.
    pub max_positions: usize,
    /// Norm flavour.
    pub norm: NormKind,
    /// Norm ε.
    pub eps: f32,
    /// MLP activation.
    pub act: UnaryOp,
    /// Gated (SwiGLU) MLP rather than plain two-layer.
    pub gated_mlp: bool,
    /// Rotary embedding (None: learned absolute positions).
    pub rope: Option<RopeSpec>,
    /// lm_head shares the embedding matrix.
    pub tied: bool,
    /// Biases on q/k/v projections.
    pub qkv_bias: bool,
    /// Bias on the attention output projection.
    pub o_bias: bool,
    /// Biases on MLP projections.
    pub mlp_bias: bool,
    /// Sliding attention window.
    pub window: Option<usize>,
    /// Mixture of experts.
    pub moe: Option<MoeConfig>,
}

fn obj_get<'a>(o: &'a Map<String, Value>, k: &str) -> Option<&'a Value> {
    o.get(k).filter(|v| !v.is_null())
}

fn get_usize(o: &Map<String, Value>, k: &str) -> Result<Option<usize>, ModelError> {
    match obj_get(o, k) {
        None => Ok(None),
        Some(v) => v
            .as_u64()
            .map(|x| Some(x as usize))
            .ok_or_else(|| ModelError::Key {
                key: k.into(),
                msg: format!("expected a non-negative integer, found {v}"),
            }),
    }
}

fn req_usize(o: &Map<String, Value>, k: &str) -> Result<usize, ModelError> {
    match get_usize(o, k)? {
        Some(0) => Err(ModelError::Key {
            key: k.into(),
            msg: "must be positive".into(),
        }),
        Some(x) => Ok(x),
        None => Err(ModelError::Key {
            key: k.into(),
            msg: "missing".into(),
        }),
    }
}

fn get_f64(o: &Map<String, Value>, k: &str) -> Result<Option<f64>, ModelError> {
    match obj_get(o, k) {
        None => Ok(None),
        Some(v) => v.as_f64().map(Some).ok_or_else(|| ModelError::Key {
            key: k.into(),
            msg: format!("expected a number, found {v}"),
        }),
    }
}

fn get_bool(o: &Map<String, Value>, k: &str, default: bool) -> Result<bool, ModelError> {
    match obj_get(o, k) {
        None => Ok(default),
        Some(v) => v.as_bool().ok_or_else(|| ModelError::Key {
            key: k.into(),
            msg: format!("expected true/false, found {v}"),
        }),
    }
}

fn activation(name: &str, key: &str) -> Result<UnaryOp, ModelError> {
    Ok(match name {
        "silu" | "swish" => UnaryOp::Silu,
        "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => UnaryOp::GeluTanh,
        "gelu" => UnaryOp::GeluErf,
        "relu" => UnaryOp::Relu,
        other => {
            return Err(ModelError::Key {
                key: key.into(),
                msg: format!("unsupported activation {other:?} (supported: silu, gelu, gelu_new, gelu_pytorch_tanh, relu)"),
            })
        }
    })
}

fn rope_spec(o: &Map<String, Value>) -> Result<RopeSpec, ModelError> {
    // transformers 5: everything under `rope_parameters`; 4: `rope_theta` + `rope_scaling`.
    let params = obj_get(o, "rope_parameters").and_then(Value::as_object);
    let theta = match params
        .map(|p| get_f64(p, "rope_theta"))
        .transpose()?
        .flatten()
    {
        Some(t) => t,
        None => get_f64(o, "rope_theta")?.unwrap_or(10000.0),
    };
    let scaling_obj = obj_get(o, "rope_scaling")
        .and_then(Value::as_object)
        .or(params);
    let scaling = match scaling_obj {
        None => None,
        Some(s) => {
            let ty = obj_get(s, "rope_type")
                .or_else(|| obj_get(s, "type"))
                .and_then(Value::as_str)
                .unwrap_or("default");
            let factor = |k: &str| -> Result<f64, ModelError> {
                get_f64(s, k)?.ok_or_else(|| ModelError::Key {
                    key: format!("rope_scaling.{k}"),
                    msg: format!("missing (required by rope_type {ty:?})"),
                })
            };
            match ty {
                "default" => None,
                "linear" => Some(RopeScaling::Linear {
                    factor: Float(factor("factor")? as f32),
                }),
                "llama3" => Some(RopeScaling::Llama3 {
                    factor: Float(factor("factor")? as f32),
                    low_freq_factor: Float(factor("low_freq_factor")? as f32),
                    high_freq_factor: Float(factor("high_freq_factor")? as f32),
                    original_max_positions: get_usize(s, "original_max_position_embeddings")?
                        .ok_or_else(|| ModelError::Key {
                            key: "rope_scaling.original_max_position_embeddings".into(),
                            msg: "missing (required by rope_type \"llama3\")".into(),
                        })?,
                }),
                other => {
                    return Err(ModelError::Unsupported(format!(
                        "rope_type {other:?} (supported: default, linear, llama3)"
                    )))
                }
            }
        }
    };
    Ok(RopeSpec {
        theta: Float(theta as f32),
        style: RopeStyle::Half,
        scaling,
    })
}

impl ModelConfig {
    /// Reads a `config.json`, or the `config.json` inside a model directory.
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
        ModelConfig::from_json(&v)
    }

    /// Interprets a parsed `config.json`.
    pub fn from_json(v: &Value) -> Result<ModelConfig, ModelError> {
        let o = v.as_object().ok_or_else(|| ModelError::Key {
            key: "<root>".into(),
            msg: "expected a JSON object".into(),
        })?;
        let model_type = obj_get(o, "model_type")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        let arch = match model_type.as_str() {
            "gpt2" => Arch::Gpt2,
            "llama" => Arch::Llama,
            "mistral" => Arch::Mistral,
            "qwen2" => Arch::Qwen2,
            "mixtral" => Arch::Mixtral,
            _ => return Err(ModelError::UnknownModelType { found: model_type }),
        };
        let cfg = if arch == Arch::Gpt2 {
            Self::gpt2(o)?
        } else {
            Self::llama_like(arch, o)?
        };
        cfg.check()?;
        Ok(cfg)
    }

    fn gpt2(o: &Map<String, Value>) -> Result<ModelConfig, ModelError> {
        let hidden = req_usize(o, "n_embd")?;
        let heads = req_usize(o, "n_head")?;
        if get_bool(o, "scale_attn_by_inverse_layer_idx", false)? {
            return Err(ModelError::Unsupported(
                "scale_attn_by_inverse_layer_idx = true".into(),
            ));
        }
        let act = obj_get(o, "activation_function")
            .and_then(Value::as_str)
            .unwrap_or("gelu_new");
        Ok(ModelConfig {
            arch: Arch::Gpt2,
            vocab: req_usize(o, "vocab_size")?,
            hidden,
            layers: req_usize(o, "n_layer")?,
            heads,
            kv_heads: heads,
            head_dim: hidden / heads,
            ffn: get_usize(o, "n_inner")?.unwrap_or(4 * hidden),
            max_positions: req_usize(o, "n_positions")?,
            norm: NormKind::Layer,
            eps: get_f64(o, "layer_norm_epsilon")?.unwrap_or(1e-5) as f32,
            act: activation(act, "activation_function")?,
            gated_mlp: false,
            rope: None,
            tied: get_bool(o, "tie_word_embeddings", true)?,
            qkv_bias: true,
            o_bias: true,
            mlp_bias: true,
            window: None,
            moe: None,
        })
    }

    fn llama_like(arch: Arch, o: &Map<String, Value>) -> Result<ModelConfig, ModelError> {
        let hidden = req_usize(o, "hidden_size")?;
        let heads = req_usize(o, "num_attention_heads")?;
        let kv_heads = get_usize(o, "num_key_value_heads")?.unwrap_or(heads);
        let head_dim = match get_usize(o, "head_dim")? {
            Some(d) => d,
            None if hidden % heads == 0 => hidden / heads,
            None => {
                return Err(ModelError::Key {
                    key: "num_attention_heads".into(),
                    msg: format!("hidden_size {hidden} is not divisible by {heads} heads (and head_dim is not given)"),
                })
            }
        };
        let act = obj_get(o, "hidden_act")
            .and_then(Value::as_str)
            .unwrap_or("silu");
        let attention_bias = get_bool(o, "attention_bias", false)?;
        let window = match arch {
            Arch::Mistral | Arch::Mixtral => get_usize(o, "sliding_window")?,
            Arch::Qwen2 if get_bool(o, "use_sliding_window", false)? => {
                let w = get_usize(o, "sliding_window")?;
                let max_window_layers = get_usize(o, "max_window_layers")?;
                let layers = req_usize(o, "num_hidden_layers")?;
                if max_window_layers.is_some_and(|m| m < layers) {
                    return Err(ModelError::Unsupported(
                        "qwen2 with sliding window on only some layers (max_window_layers)".into(),
                    ));
                }
                w
            }
            _ => None,
        };
        let moe = if arch == Arch::Mixtral {
            Some(MoeConfig {
                experts: req_usize(o, "num_local_experts")?,
                top_k: req_usize(o, "num_experts_per_tok")?,
            })
        } else {
            None
        };
        Ok(ModelConfig {
            arch,
            vocab: req_usize(o, "vocab_size")?,
            hidden,
            layers: req_usize(o, "num_hidden_layers")?,
            heads,
            kv_heads,
            head_dim,
            ffn: req_usize(o, "intermediate_size")?,
            max_positions: get_usize(o, "max_position_embeddings")?.unwrap_or(2048),
            norm: NormKind::Rms,
            eps: get_f64(o, "rms_norm_eps")?.unwrap_or(1e-6) as f32,
            act: activation(act, "hidden_act")?,
            gated_mlp: true,
            rope: Some(rope_spec(o)?),
            tied: get_bool(o, "tie_word_embeddings", false)?,
            qkv_bias: arch == Arch::Qwen2 || attention_bias,
            o_bias: attention_bias,
            mlp_bias: arch == Arch::Llama && get_bool(o, "mlp_bias", false)?,
            window,
            moe,
        })
    }

    fn check(&self) -> Result<(), ModelError> {
        let bad = |key: &str, msg: String| {
            Err(ModelError::Key {
                key: key.into(),
                msg,
            })
        };
        if self.heads % self.kv_heads != 0 {
            return bad(
                "num_key_value_heads",
                format!(
                    "{} heads is not a multiple of {} KV heads",
                    self.heads, self.kv_heads
                ),
            );
        }
        if self.head_dim == 0 || (self.rope.is_some() && self.head_dim % 2 != 0) {
            return bad(
                "head_dim",
                format!("{} must be positive and even", self.head_dim),
            );
        }
        if self.arch == Arch::Gpt2 && self.hidden % self.heads != 0 {
            return bad(
                "n_head",
                format!(
                    "n_embd {} is not divisible by {} heads",
                    self.hidden, self.heads
                ),
            );
        }
        if let Some(m) = self.moe {
            if m.top_k > m.experts {
                return bad(
                    "num_experts_per_tok",
                    format!("{} exceeds {} experts", m.top_k, m.experts),
                );
            }
        }
        Ok(())
    }
}
