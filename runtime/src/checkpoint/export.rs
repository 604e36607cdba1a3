//! A checkpoint's weights as a HuggingFace model directory: `config.json` and
//! `model.safetensors`, or shards of at most a given size (`model-00001-of-00003.safetensors`)
//! with `model.safetensors.index.json`, tensor names and dtypes as transformers writes them.

use super::{Checkpoint, CheckpointError};
use crate::output::StagedDir;
use half::{bf16, f16};
use safetensors::Dtype;
use std::collections::BTreeMap;
use std::path::Path;

/// The dtype an export writes tensors in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExportDType {
    /// Each tensor in the dtype the model stored it in (what transformers loaded).
    Source,
    /// f32 (what training holds: bit for bit).
    F32,
    /// bfloat16.
    BF16,
    /// float16.
    F16,
}

impl ExportDType {
    /// From `source`, `f32`, `bf16`, `f16`.
    pub fn from_name(name: &str) -> Option<ExportDType> {
        Some(match name {
            "source" => ExportDType::Source,
            "f32" => ExportDType::F32,
            "bf16" => ExportDType::BF16,
            "f16" => ExportDType::F16,
            _ => return None,
        })
    }

    fn of(self, stored: &str) -> Dtype {
        match self {
            ExportDType::Source => match stored {
                "BF16" => Dtype::BF16,
                "F16" => Dtype::F16,
                _ => Dtype::F32,
            },
            ExportDType::F32 => Dtype::F32,
            ExportDType::BF16 => Dtype::BF16,
            ExportDType::F16 => Dtype::F16,
        }
    }
}

/// What an export wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exported {
    /// Safetensors files written.
    pub files: Vec<String>,
    /// Tensors written.
    pub tensors: usize,
    /// Bytes of tensor data.
    pub bytes: u64,
}

/// The single-file name transformers uses.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The index transformers uses for a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// A tensor converted for writing: name, dtype, shape, little-endian bytes.
type Converted = (String, Dtype, Vec<usize>, Vec<u8>);

/// Whether `name` is one of the files an export writes (an earlier export's, replaced whole).
pub fn is_model_file(name: &str) -> bool {
    name == "config.json"
        || name == INDEX_FILE
        || (name.starts_with("model") && name.ends_with(".safetensors"))
}

/// Writes checkpoint `ck`'s weights to the HuggingFace directory `out` (built beside it and
/// put in place whole): every stored tensor in `dtype`, in files of at most `max_shard_bytes`
/// of tensor data (one file when they all fit; a tensor larger than the limit gets a file of
/// its own, as transformers does).
pub fn export(
    ck: &Checkpoint,
    out: &Path,
    dtype: ExportDType,
    max_shard_bytes: u64,
) -> Result<Exported, CheckpointError> {
    let stage = StagedDir::new(out)?;
    // Tensors in name order, each converted once, grouped into shards.
    let mut shards: Vec<Vec<Converted>> = vec![Vec::new()];
    let mut in_shard = 0u64;
    let mut total = 0u64;
    for (name, t) in &ck.manifest.tensors {
        let data = ck.read_block(
            name,
            shardc_compiler::checkpoint::StateKind::Param,
            &shardc_compiler::checkpoint::Block::whole(&t.shape),
        )?;
        let dt = dtype.of(&t.dtype);
        let bytes: Vec<u8> = match dt {
            Dtype::BF16 => data
                .iter()
                .flat_map(|&x| bf16::from_f32(x).to_le_bytes())
                .collect(),
            Dtype::F16 => data
                .iter()
                .flat_map(|&x| f16::from_f32(x).to_le_bytes())
                .collect(),
            _ => data.iter().flat_map(|x| x.to_le_bytes()).collect(),
        };
        let n = bytes.len() as u64;
        if in_shard > 0 && in_shard + n > max_shard_bytes {
            shards.push(Vec::new());
            in_shard = 0;
        }
        in_shard += n;
        total += n;
        shards
            .last_mut()
            .expect("invariant: one shard at least")
            .push((name.clone(), dt, t.shape.clone(), bytes));
    }
    let count = shards.len();
    let mut files = Vec::with_capacity(count);
    let mut weight_map = BTreeMap::new();
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    for (i, shard) in shards.iter().enumerate() {
        let file = if count == 1 {
            SINGLE_FILE.to_string()
        } else {
            format!("model-{:05}-of-{count:05}.safetensors", i + 1)
        };
        let path = stage.path(&file);
        let views = shard
            .iter()
            .map(|(n, dt, s, b)| {
                safetensors::tensor::TensorView::new(*dt, s.clone(), b)
                    .map(|v| (n.clone(), v))
                    .map_err(|e| CheckpointError::Manifest {
                        path: path.clone(),
                        msg: format!("tensor `{n}`: {e}"),
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        safetensors::tensor::serialize_to_file(views, Some(meta.clone()), &path).map_err(|e| {
            CheckpointError::Io {
                path: path.clone(),
                source: std::io::Error::other(e.to_string()),
            }
        })?;
        for (n, ..) in shard {
            weight_map.insert(n.clone(), file.clone());
        }
        files.push(file);
    }
    if count > 1 {
        let index = serde_json::json!({
            "metadata": { "total_size": total },
            "weight_map": weight_map,
        });
        stage.write(
            INDEX_FILE,
            serde_json::to_string_pretty(&index)
                .unwrap_or_default()
                .as_bytes(),
        )?;
    }
    let config = serde_json::to_string_pretty(&ck.manifest.model.config).unwrap_or_default();
    stage.write("config.json", config.as_bytes())?;
    stage.publish_dropping(&|name| is_model_file(name))?;
    Ok(Exported {
        files,
        tensors: ck.manifest.tensors.len(),
        bytes: total,
    })
}
