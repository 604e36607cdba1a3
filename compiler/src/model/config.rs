//! HuggingFace `config.json` → [`ModelConfig`], a normalised description of the five supported
//! architectures. Accepts transformers 4 and 5 layouts (`rope_theta` at the top level or under
//! `rope_parameters`; `head_dim` absent or null; `rope_scaling` or `rope_parameters` for the
//! scaling type).

use super::limits::{LimitError, MAX_DIM};
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
        /// What the config says.
        found: String,
    },
    /// A key is missing, has the wrong type or an invalid value.
    #[error("{key}: {msg}")]
    Key {
        /// The key (`rope_scaling.factor` for nested ones).
        key: String,
        /// What is wrong.
        msg: String,
    },
    /// The config asks for something shardc does not implement.
    #[error("unsupported config: {0}")]
    Unsupported(String),
    /// A size beyond a hard limit or the memory budget.
    #[error(transparent)]
    Limit(#[from] LimitError),
    /// An error in the config file `path`.
    #[error("{path}: {inner}")]
    At {
        /// The config file.
        path: PathBuf,
        /// The error.
        inner: Box<ModelError>,
    },
}

impl ModelError {
    /// An error in the config field (or option) `key`.
    pub fn key(key: impl Into<String>, msg: String) -> ModelError {
        ModelError::Key {
            key: key.into(),
            msg,
        }
    }

    /// This error as one in the config file `path` (errors that name their file already are
    /// returned as they are).
    pub fn at(self, path: &Path) -> ModelError {
        match self {
            e @ (ModelError::Io { .. } | ModelError::Json { .. } | ModelError::At { .. }) => e,
            e => ModelError::At {
                path: path.to_path_buf(),
                inner: Box::new(e),
            },
        }
    }
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

/// Typed reads of one JSON object's keys, with errors that name the key (`prefix` names a
/// nested object: `rope_scaling.`). `null` reads as absent.
struct Fields<'a> {
    o: &'a Map<String, Value>,
    prefix: &'a str,
}

impl<'a> Fields<'a> {
    fn new(o: &'a Map<String, Value>) -> Fields<'a> {
        Fields { o, prefix: "" }
    }

    fn err(&self, k: &str, msg: String) -> ModelError {
        ModelError::key(format!("{}{k}", self.prefix), msg)
    }

    fn get(&self, k: &str) -> Option<&'a Value> {
        self.o.get(k).filter(|v| !v.is_null())
    }

    /// A non-negative integer.
    fn usize(&self, k: &str) -> Result<Option<usize>, ModelError> {
        let Some(v) = self.get(k) else {
            return Ok(None);
        };
        if let Some(x) = v.as_u64() {
            return usize::try_from(x)
                .map(Some)
                .map_err(|_| self.err(k, format!("{x} does not fit in this machine's usize")));
        }
        Err(self.err(
            k,
            if v.is_i64() {
                format!("expected a non-negative integer, found {v}")
            } else {
                format!("expected an integer, found {v}")
            },
        ))
    }

    /// A count: an integer ≥ 1.
    fn count(&self, k: &str) -> Result<Option<usize>, ModelError> {
        match self.usize(k)? {
            Some(0) => Err(self.err(k, "must be > 0 (found 0)".into())),
            x => Ok(x),
        }
    }

    /// A size: an integer in 1..=[`MAX_DIM`].
    fn size(&self, k: &str) -> Result<Option<usize>, ModelError> {
        match self.count(k)? {
            Some(x) if x > MAX_DIM => Err(self.err(
                k,
                format!("must be at most {MAX_DIM} (found {x}; ids and dimensions are int32)"),
            )),
            x => Ok(x),
        }
    }

    /// A required size.
    fn req_size(&self, k: &str) -> Result<usize, ModelError> {
        self.size(k)?.ok_or_else(|| self.err(k, "missing".into()))
    }

    /// Field `k` through `read` when present; an error expecting `what` when `read` refuses it.
    fn typed<T>(
        &self,
        k: &str,
        what: &str,
        read: impl Fn(&'a Value) -> Option<T>,
    ) -> Result<Option<T>, ModelError> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => read(v)
                .map(Some)
                .ok_or_else(|| self.err(k, format!("expected {what}, found {v}"))),
        }
    }

    fn f64(&self, k: &str) -> Result<Option<f64>, ModelError> {
        self.typed(k, "a number", Value::as_f64)
    }

    /// A finite float32 > 0 (`default` when absent).
    fn positive_f32(&self, k: &str, default: f64) -> Result<f32, ModelError> {
        let x = self.f64(k)?.unwrap_or(default);
        let f = x as f32;
        if f.is_finite() && f > 0.0 {
            Ok(f)
        } else {
            let found = self.get(k).map_or_else(|| x.to_string(), Value::to_string);
            Err(self.err(
                k,
                format!("must be finite and > 0 in float32 (found {found})"),
            ))
        }
    }

    fn bool(&self, k: &str, default: bool) -> Result<bool, ModelError> {
        Ok(self
            .typed(k, "true or false", Value::as_bool)?
            .unwrap_or(default))
    }

    fn str(&self, k: &str) -> Result<Option<&'a str>, ModelError> {
        self.typed(k, "a string", Value::as_str)
    }

    fn object(&self, k: &str) -> Result<Option<&'a Map<String, Value>>, ModelError> {
        self.typed(k, "an object", Value::as_object)
    }
}

fn activation(f: &Fields, key: &str, default: &str) -> Result<UnaryOp, ModelError> {
    Ok(match f.str(key)?.unwrap_or(default) {
        "silu" | "swish" => UnaryOp::Silu,
        "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => UnaryOp::GeluTanh,
        "gelu" => UnaryOp::GeluErf,
        "relu" => UnaryOp::Relu,
        other => {
            return Err(f.err(
                key,
                format!(
                    "unsupported activation {other:?} (supported: silu, gelu, gelu_new, \
                     gelu_pytorch_tanh, relu)"
                ),
            ))
        }
    })
}

fn rope_spec(f: &Fields) -> Result<RopeSpec, ModelError> {
    // transformers 5: everything under `rope_parameters`; 4: `rope_theta` + `rope_scaling`.
    let params = f.object("rope_parameters")?.map(|o| Fields {
        o,
        prefix: "rope_parameters.",
    });
    let theta = match &params {
        Some(p) if p.get("rope_theta").is_some() => p.positive_f32("rope_theta", 10000.0)?,
        _ => f.positive_f32("rope_theta", 10000.0)?,
    };
    let scaling = match f.object("rope_scaling")? {
        Some(o) => Some(Fields {
            o,
            prefix: "rope_scaling.",
        }),
        None => params,
    };
    let scaling = match scaling {
        None => None,
        Some(s) => {
            let ty = match s.str("rope_type")? {
                Some(t) => t,
                None => s.str("type")?.unwrap_or("default"),
            };
            let need = |k: &str| -> Result<(), ModelError> {
                match s.get(k) {
                    Some(_) => Ok(()),
                    None => Err(s.err(k, format!("missing (required by rope_type {ty:?})"))),
                }
            };
            match ty {
                "default" => None,
                "linear" => {
                    need("factor")?;
                    Some(RopeScaling::Linear {
                        factor: Float(s.positive_f32("factor", 1.0)?),
                    })
                }
                "llama3" => {
                    for k in [
                        "factor",
                        "low_freq_factor",
                        "high_freq_factor",
                        "original_max_position_embeddings",
                    ] {
                        need(k)?;
                    }
                    let low = s.positive_f32("low_freq_factor", 1.0)?;
                    let high = s.positive_f32("high_freq_factor", 4.0)?;
                    if high <= low {
                        return Err(s.err(
                            "high_freq_factor",
                            format!("must be greater than low_freq_factor {low} (found {high})"),
                        ));
                    }
                    Some(RopeScaling::Llama3 {
                        factor: Float(s.positive_f32("factor", 1.0)?),
                        low_freq_factor: Float(low),
                        high_freq_factor: Float(high),
                        original_max_positions: s
                            .size("original_max_position_embeddings")?
                            .expect("invariant: checked present"),
                    })
                }
                other => {
                    return Err(s.err(
                        "rope_type",
                        format!("unsupported {other:?} (supported: default, linear, llama3)"),
                    ))
                }
            }
        }
    };
    Ok(RopeSpec {
        theta: Float(theta),
        style: RopeStyle::Half,
        scaling,
    })
}

/// The config keys of a few fields, per architecture (for error messages).
pub(crate) struct Keys {
    pub(crate) layers: &'static str,
    pub(crate) hidden: &'static str,
    pub(crate) ffn: &'static str,
    kv_heads: &'static str,
    head_dim: &'static str,
}

impl ModelConfig {
    /// Interprets a parsed `config.json`: every size positive and within
    /// [`MAX_DIM`](super::MAX_DIM), the shape consistent, norm ε and RoPE parameters finite and
    /// positive (the sizes that need the graph are checked by `ModelConfig::from_json`).
    pub(super) fn parse(v: &Value) -> Result<ModelConfig, ModelError> {
        let o = v.as_object().ok_or_else(|| {
            ModelError::key(
                "<root>",
                format!("expected a JSON object, found {}", json_kind(v)),
            )
        })?;
        let f = Fields::new(o);
        let arch = match f.str("model_type")? {
            Some("gpt2") => Arch::Gpt2,
            Some("llama") => Arch::Llama,
            Some("mistral") => Arch::Mistral,
            Some("qwen2") => Arch::Qwen2,
            Some("mixtral") => Arch::Mixtral,
            Some(other) => {
                return Err(ModelError::UnknownModelType {
                    found: other.to_string(),
                })
            }
            None => {
                return Err(f.err(
                    "model_type",
                    "missing (supported: gpt2, llama, mistral, qwen2, mixtral)".into(),
                ))
            }
        };
        let cfg = if arch == Arch::Gpt2 {
            Self::gpt2(&f)?
        } else {
            Self::llama_like(arch, &f)?
        };
        cfg.check()?;
        Ok(cfg)
    }

    fn gpt2(f: &Fields) -> Result<ModelConfig, ModelError> {
        let hidden = f.req_size("n_embd")?;
        let heads = f.req_size("n_head")?;
        if f.bool("scale_attn_by_inverse_layer_idx", false)? {
            return Err(ModelError::Unsupported(
                "scale_attn_by_inverse_layer_idx = true".into(),
            ));
        }
        if hidden % heads != 0 {
            return Err(f.err(
                "n_head",
                format!("n_embd {hidden} is not divisible by {heads} heads"),
            ));
        }
        Ok(ModelConfig {
            arch: Arch::Gpt2,
            vocab: f.req_size("vocab_size")?,
            hidden,
            layers: f
                .count("n_layer")?
                .ok_or_else(|| f.err("n_layer", "missing".into()))?,
            heads,
            kv_heads: heads,
            head_dim: hidden / heads,
            ffn: match f.size("n_inner")? {
                Some(n) => n,
                None => 4usize
                    .checked_mul(hidden)
                    .filter(|&n| n <= MAX_DIM)
                    .ok_or_else(|| {
                        f.err(
                            "n_embd",
                            format!("{hidden}: the default MLP width 4 × n_embd exceeds {MAX_DIM}"),
                        )
                    })?,
            },
            max_positions: f.req_size("n_positions")?,
            norm: NormKind::Layer,
            eps: f.positive_f32("layer_norm_epsilon", 1e-5)?,
            act: activation(f, "activation_function", "gelu_new")?,
            gated_mlp: false,
            rope: None,
            tied: f.bool("tie_word_embeddings", true)?,
            qkv_bias: true,
            o_bias: true,
            mlp_bias: true,
            window: None,
            moe: None,
        })
    }

    fn llama_like(arch: Arch, f: &Fields) -> Result<ModelConfig, ModelError> {
        let hidden = f.req_size("hidden_size")?;
        let heads = f.req_size("num_attention_heads")?;
        let kv_heads = f.size("num_key_value_heads")?.unwrap_or(heads);
        let head_dim = match f.size("head_dim")? {
            Some(d) => d,
            None if hidden % heads == 0 => hidden / heads,
            None => {
                return Err(f.err(
                    "num_attention_heads",
                    format!(
                        "hidden_size {hidden} is not divisible by {heads} heads (and head_dim is \
                         not given)"
                    ),
                ))
            }
        };
        let attention_bias = f.bool("attention_bias", false)?;
        let layers = f
            .count("num_hidden_layers")?
            .ok_or_else(|| f.err("num_hidden_layers", "missing".into()))?;
        let window = match arch {
            Arch::Mistral | Arch::Mixtral => f.size("sliding_window")?,
            Arch::Qwen2 if f.bool("use_sliding_window", false)? => {
                let w = f.size("sliding_window")?;
                let max_window_layers = f.usize("max_window_layers")?;
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
                experts: f.req_size("num_local_experts")?,
                top_k: f.req_size("num_experts_per_tok")?,
            })
        } else {
            None
        };
        Ok(ModelConfig {
            arch,
            vocab: f.req_size("vocab_size")?,
            hidden,
            layers,
            heads,
            kv_heads,
            head_dim,
            ffn: f.req_size("intermediate_size")?,
            max_positions: f.size("max_position_embeddings")?.unwrap_or(2048),
            norm: NormKind::Rms,
            eps: f.positive_f32("rms_norm_eps", 1e-6)?,
            act: activation(f, "hidden_act", "silu")?,
            gated_mlp: true,
            rope: Some(rope_spec(f)?),
            tied: f.bool("tie_word_embeddings", false)?,
            qkv_bias: arch == Arch::Qwen2 || attention_bias,
            o_bias: attention_bias,
            mlp_bias: arch == Arch::Llama && f.bool("mlp_bias", false)?,
            window,
            moe,
        })
    }

    /// The config keys of this architecture.
    pub(crate) fn keys(&self) -> Keys {
        if self.arch == Arch::Gpt2 {
            Keys {
                layers: "n_layer",
                hidden: "n_embd",
                ffn: "n_inner",
                kv_heads: "n_head",
                head_dim: "n_embd",
            }
        } else {
            Keys {
                layers: "num_hidden_layers",
                hidden: "hidden_size",
                ffn: "intermediate_size",
                kv_heads: "num_key_value_heads",
                head_dim: "head_dim",
            }
        }
    }

    /// Parameters as the shapes give them (an upper bound of the exact count: biases and
    /// norms of every flavour counted).
    pub(super) fn params_estimate(&self) -> u128 {
        let (h, v) = (self.hidden as u128, self.vocab as u128);
        let q = self.heads as u128 * self.head_dim as u128;
        let kv = self.kv_heads as u128 * self.head_dim as u128;
        let attn = h * (q + 2 * kv) + q * h + q + 2 * kv + h;
        let experts = self.moe.map_or(1, |m| m.experts) as u128;
        let mlp = experts * 3 * (h * self.ffn as u128 + self.ffn as u128 + h)
            + self.moe.map_or(0, |m| m.experts) as u128 * h;
        let layer = attn + mlp + 4 * h;
        let positions = if self.rope.is_none() {
            self.max_positions as u128 * h
        } else {
            0
        };
        layer * self.layers as u128 + 2 * v * h + positions + 2 * h
    }

    fn check(&self) -> Result<(), ModelError> {
        let k = self.keys();
        let bad = |key: &str, msg: String| Err(ModelError::key(key, msg));
        if self.vocab < 2 {
            return bad(
                "vocab_size",
                format!("must be at least 2 (found {})", self.vocab),
            );
        }
        if self.heads % self.kv_heads != 0 {
            return bad(
                k.kv_heads,
                format!(
                    "{} heads is not a multiple of {} KV heads",
                    self.heads, self.kv_heads
                ),
            );
        }
        if self.rope.is_some() && self.head_dim % 2 != 0 {
            return bad(
                k.head_dim,
                format!(
                    "must be even for rotary embeddings (found {})",
                    self.head_dim
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

/// `an array`, `a string`, ... for messages.
fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}
