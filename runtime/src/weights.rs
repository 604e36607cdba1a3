//! Checkpoint access: memory-mapped safetensors files (one file or a sharded checkpoint with
//! `model.safetensors.index.json`), and the loader that turns a [`ParamSource`] into this
//! rank's f32 tensor.
//!
//! Pre: checkpoint files are not modified while a [`Weights`] maps them.
//! Post: [`Weights::load`] returns exactly `local.shape()` elements, read straight from the
//! mapped bytes (only the chunk this rank holds is read), converted from F32/BF16/F16 to f32
//! and rounded to the parameter's declared float precision. A file whose header does not
//! describe its bytes is a [`RuntimeError::BadCheckpoint`] naming the tensor at fault and the
//! sizes involved (a truncated download says how many bytes are missing).

use crate::{RuntimeError, Tensor};
use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::tensor::TensorInfo;
use safetensors::{Dtype, SafeTensorError, SafeTensors};
use shardc_compiler::ir::{DType, ParamSource, TensorType};
use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The single-file checkpoint name inside a model directory.
const SINGLE_FILE: &str = "model.safetensors";
/// The sharded-checkpoint index name inside a model directory.
const INDEX_FILE: &str = "model.safetensors.index.json";

/// One mapped safetensors file.
struct MappedFile {
    mmap: Mmap,
    /// Where it was opened from.
    path: PathBuf,
    /// Start offsets of the tensors found finite ([`Weights::check_finite`]), so each is
    /// scanned once however many parameters, views and ranks read it.
    finite: Mutex<BTreeSet<usize>>,
}

/// Where one stored tensor lives.
#[derive(Clone, Debug)]
struct Entry {
    /// Index into `Weights::files`.
    file: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Absolute byte offset of the first element in the mapped file.
    start: usize,
    /// Absolute byte offset one past the last element.
    end: usize,
}

/// A checkpoint opened for reading: every stored tensor by name, data memory-mapped.
pub struct Weights {
    path: PathBuf,
    files: Vec<MappedFile>,
    tensors: BTreeMap<String, Entry>,
}

impl std::fmt::Debug for Weights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Weights")
            .field("path", &self.path)
            .field("files", &self.files.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

/// The `weight_map` of a sharded checkpoint's index.
#[derive(serde::Deserialize)]
struct Index {
    weight_map: BTreeMap<String, String>,
}

/// The safetensors format's limit on the header length, bytes.
const MAX_HEADER: u64 = 100_000_000;

/// What is wrong with a safetensors file `read_metadata` refused, in one line naming the
/// tensor at fault where there is one, and the sizes involved.
fn header_problem(bytes: &[u8], err: &SafeTensorError) -> String {
    let len = bytes.len();
    let n = bytes
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("invariant: 8 bytes")));
    match (err, n) {
        (SafeTensorError::HeaderTooSmall, _) | (_, None) => {
            format!("{len} bytes, too short for the 8-byte header length")
        }
        (SafeTensorError::HeaderTooLarge | SafeTensorError::InvalidHeaderLength, Some(n)) => {
            if n > MAX_HEADER {
                format!("header length {n} (the first 8 bytes) exceeds the format's limit of {MAX_HEADER} bytes")
            } else {
                format!(
                    "header length {n} (the first 8 bytes) runs past the end of the file ({len} bytes)"
                )
            }
        }
        (SafeTensorError::InvalidHeader(e), _) => format!("header is not UTF-8: {e}"),
        (SafeTensorError::InvalidHeaderDeserialization(e), Some(n)) => {
            entry_parse_problem(bytes, n)
                .unwrap_or_else(|| format!("header is not valid safetensors JSON: {e}"))
        }
        (SafeTensorError::InvalidOffset(name), _) => format!(
            "tensor `{name}`: data_offsets do not start where the previous tensor's data ends"
        ),
        (_, Some(n)) => entries_problem(bytes, n)
            .unwrap_or_else(|| format!("{err} ({len} bytes, header of {n})")),
    }
}

/// The header entry that does not parse as a tensor (`dtype`, `shape`, `data_offsets`) or as
/// the string map `__metadata__`, when the header is otherwise JSON.
fn entry_parse_problem(bytes: &[u8], n: u64) -> Option<String> {
    let header = bytes.get(8..8usize.checked_add(usize::try_from(n).ok()?)?)?;
    let map: BTreeMap<String, serde_json::Value> = serde_json::from_slice(header).ok()?;
    map.into_iter().find_map(|(k, v)| {
        if k == "__metadata__" {
            let e = serde_json::from_value::<Option<BTreeMap<String, String>>>(v).err()?;
            Some(format!("`__metadata__`: {e} (a map of strings)"))
        } else {
            let e = serde_json::from_value::<TensorInfo>(v).err()?;
            Some(format!("tensor `{k}`: {e}"))
        }
    })
}

/// The first tensor (in data order) whose dtype and shape disagree with its offsets, or the
/// data's end disagreeing with the file's.
fn entries_problem(bytes: &[u8], n: u64) -> Option<String> {
    let header = bytes.get(8..8usize.checked_add(usize::try_from(n).ok()?)?)?;
    let map: BTreeMap<String, serde_json::Value> = serde_json::from_slice(header).ok()?;
    let mut entries: Vec<(String, TensorInfo)> = map
        .into_iter()
        .filter(|(k, _)| k != "__metadata__")
        .filter_map(|(k, v)| Some((k, serde_json::from_value(v).ok()?)))
        .collect();
    entries.sort_by_key(|(_, e)| e.data_offsets);
    for (name, e) in &entries {
        let (start, end) = e.data_offsets;
        let bits = e
            .shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .and_then(|x| x.checked_mul(e.dtype.bitsize()));
        let Some(bits) = bits else {
            return Some(format!(
                "tensor `{name}`: shape {:?} of {:?} overflows the byte count",
                e.shape, e.dtype
            ));
        };
        if bits % 8 != 0 || end < start || end - start != bits / 8 {
            return Some(format!(
                "tensor `{name}`: {:?} {:?} needs {} bytes but data_offsets [{start}, {end}] hold {}",
                e.dtype,
                e.shape,
                bits.div_ceil(8),
                end as i128 - start as i128
            ));
        }
    }
    let data_end = entries
        .iter()
        .map(|(_, e)| e.data_offsets.1)
        .max()
        .unwrap_or(0) as u64;
    let have = (bytes.len() as u64).checked_sub(8 + n)?;
    match data_end.cmp(&have) {
        std::cmp::Ordering::Equal => None,
        std::cmp::Ordering::Greater => Some(format!(
            "truncated: the header's tensors need {data_end} bytes of data, the file holds {have}"
        )),
        std::cmp::Ordering::Less => Some(format!(
            "{} bytes after the last tensor's data (the header's tensors end at data byte {data_end}, the file holds {have})",
            have - data_end
        )),
    }
}

impl Weights {
    /// Opens a checkpoint: a model directory (holding `model.safetensors` or
    /// `model.safetensors.index.json` plus its shards), a `.safetensors` file, or an index file.
    pub fn open(path: impl AsRef<Path>) -> Result<Weights, RuntimeError> {
        let path = path.as_ref();
        if path.is_dir() {
            let index = path.join(INDEX_FILE);
            let single = path.join(SINGLE_FILE);
            if index.is_file() {
                Weights::open_index(path, &index)
            } else if single.is_file() {
                Weights::open_files(path, &[single])
            } else {
                Err(RuntimeError::NoCheckpoint {
                    path: path.to_path_buf(),
                })
            }
        } else if path.extension().is_some_and(|e| e == "json") {
            Weights::open_index(path, path)
        } else {
            Weights::open_files(path, &[path.to_path_buf()])
        }
    }

    fn open_index(root: &Path, index: &Path) -> Result<Weights, RuntimeError> {
        let text = std::fs::read_to_string(index).map_err(|source| RuntimeError::Io {
            path: index.to_path_buf(),
            source,
        })?;
        let parsed: Index = serde_json::from_str(&text).map_err(|source| RuntimeError::Index {
            path: index.to_path_buf(),
            source,
        })?;
        let dir = index.parent().unwrap_or(Path::new("."));
        let files: BTreeSet<&String> = parsed.weight_map.values().collect();
        let paths: Vec<PathBuf> = files.into_iter().map(|f| dir.join(f)).collect();
        Weights::open_files(root, &paths)
    }

    fn open_files(root: &Path, paths: &[PathBuf]) -> Result<Weights, RuntimeError> {
        let mut files = Vec::with_capacity(paths.len());
        let mut tensors = BTreeMap::new();
        for (fi, p) in paths.iter().enumerate() {
            let io = |source| RuntimeError::Io {
                path: p.clone(),
                source,
            };
            if p.is_dir() {
                return Err(RuntimeError::BadCheckpoint {
                    path: p.clone(),
                    msg: "a directory, not a safetensors file".into(),
                });
            }
            let file = File::open(p).map_err(io)?;
            // SAFETY: the map is read-only and checkpoints are not modified while open (the
            // module's precondition); every access is bounds-checked against the header, which
            // `read_metadata` validated against the file length.
            let mmap = unsafe { Mmap::map(&file) }.map_err(io)?;
            let (n, meta) =
                SafeTensors::read_metadata(&mmap).map_err(|e| RuntimeError::BadCheckpoint {
                    path: p.clone(),
                    msg: header_problem(&mmap, &e),
                })?;
            let base = 8 + n;
            for (name, info) in meta.tensors() {
                tensors.entry(name).or_insert(Entry {
                    file: fi,
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    start: base + info.data_offsets.0,
                    end: base + info.data_offsets.1,
                });
            }
            files.push(MappedFile {
                mmap,
                path: p.clone(),
                finite: Mutex::default(),
            });
        }
        Ok(Weights {
            path: root.to_path_buf(),
            files,
            tensors,
        })
    }

    /// The path the checkpoint was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Names of every stored tensor, sorted.
    pub fn names(&self) -> Vec<String> {
        self.tensors.keys().cloned().collect()
    }

    /// The stored shape of a tensor.
    pub fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.tensors.get(name).map(|e| e.shape.clone())
    }

    /// The stored dtype of a tensor (safetensors name: `F32`, `BF16`, ...).
    pub fn dtype(&self, name: &str) -> Option<String> {
        self.tensors.get(name).map(|e| format!("{:?}", e.dtype))
    }

    /// A whole stored tensor as f32 (no view, stack, transpose or sharding).
    pub fn get(&self, name: &str) -> Result<Tensor, RuntimeError> {
        let e = self.entry(name)?;
        let ty = TensorType::plain(DType::F32, &e.shape);
        self.load(&ParamSource::whole(name), &ty, &|_| None)
    }

    fn entry(&self, name: &str) -> Result<&Entry, RuntimeError> {
        let e = self
            .tensors
            .get(name)
            .ok_or_else(|| RuntimeError::MissingTensor {
                name: name.to_string(),
                file: self.path.clone(),
            })?;
        if !matches!(e.dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16) {
            return Err(RuntimeError::TensorDType {
                name: name.to_string(),
                dtype: format!("{:?}", e.dtype),
            });
        }
        Ok(e)
    }

    /// Checks that the checkpoint holds what parameter `src` of local type `local` binds: its
    /// stored tensor(s), of the shape the graph implies, in a float dtype (what
    /// [`Weights::load`] checks before reading).
    pub fn check_binding(&self, src: &ParamSource, local: &TensorType) -> Result<(), RuntimeError> {
        self.bind(src, local).map(|_| ())
    }

    /// The stored names and entries parameter `src` of local type `local` reads, checked.
    fn bind(
        &self,
        src: &ParamSource,
        local: &TensorType,
    ) -> Result<(Vec<String>, Vec<&Entry>), RuntimeError> {
        if local.dtype == DType::I32 {
            return Err(RuntimeError::ParamDType {
                name: src.name.clone(),
                dtype: local.dtype,
            });
        }
        let local_shape = local.shape();
        // The global (pre-shard) tensor in graph layout.
        let mut global = local_shape.clone();
        for s in &src.shards {
            if s.dim >= global.len() || s.parts == 0 {
                return Err(RuntimeError::Unsupported {
                    op: "param",
                    detail: format!(
                        "shard of dim {} into {} parts for `{}` of rank {}",
                        s.dim,
                        s.parts,
                        src.name,
                        global.len()
                    ),
                });
            }
            global[s.dim] *= s.parts;
        }
        let stacked = src.stack.is_some();
        let n = src.stack.unwrap_or(1);
        let names: Vec<String> = (0..n).map(|i| src.stored_name(i)).collect();
        let entries = names
            .iter()
            .map(|nm| self.entry(nm))
            .collect::<Result<Vec<_>, _>>()?;
        let per_entry: &[usize] = if stacked {
            if global.first() != Some(&n) {
                let mut found = vec![n];
                found.extend(block_shape(&entries[0].shape, src));
                return Err(RuntimeError::TensorShape {
                    name: src.name.clone(),
                    expected: global,
                    found,
                });
            }
            &global[1..]
        } else {
            &global
        };
        for (nm, e) in names.iter().zip(&entries) {
            check_stored(nm, &e.shape, src, per_entry)?;
        }
        Ok((names, entries))
    }

    /// Loads this rank's chunk of a parameter as an f32 tensor of shape `local.shape()`.
    ///
    /// The stored tensor(s) `src.stored_name(i)` (for `i in 0..n`, stacked along a new dim 0,
    /// when `src.stack == Some(n)`) are read through, in order: `view` (a sub-block along a
    /// dim of each stored tensor), `transposed` (swap of each stored tensor's last two dims),
    /// then `shards` (chunk `coord` of `parts` along `dim`, with `coords(axis) == Some((coord,
    /// axis size))`). A shape mismatch is reported in the stored layout: the shape the graph
    /// implies (local shape × shard parts, un-transposed) against the stored one. The result
    /// is rounded to `local.dtype` (bf16/f16) and kept as f32.
    pub fn load(
        &self,
        src: &ParamSource,
        local: &TensorType,
        coords: &dyn Fn(&str) -> Option<(usize, usize)>,
    ) -> Result<Tensor, RuntimeError> {
        let (names, entries) = self.bind(src, local)?;
        let local_shape = local.shape();
        let stacked = src.stack.is_some();
        let n = src.stack.unwrap_or(1);

        // Strided access into each stored tensor, in graph layout.
        let stored = &entries[0].shape;
        let mut shape = stored.clone();
        let mut strides = row_major_strides(stored);
        let mut offset = 0usize;
        if let Some(v) = src.view {
            offset += v.start * strides[v.dim];
            shape[v.dim] = v.len;
        }
        if src.transposed {
            let r = shape.len();
            shape.swap(r - 2, r - 1);
            strides.swap(r - 2, r - 1);
        }
        // Stack entries kept by this rank.
        let (mut lo, mut count) = (0usize, n);
        for s in &src.shards {
            let (coord, size) = coords(&s.axis).ok_or_else(|| RuntimeError::MissingAxis {
                axis: s.axis.clone(),
            })?;
            if size != s.parts || coord >= size {
                return Err(RuntimeError::AxisSize {
                    axis: s.axis.clone(),
                    expected: s.parts,
                    found: size,
                });
            }
            if stacked && s.dim == 0 {
                count /= s.parts;
                lo += coord * count;
            } else {
                let d = s.dim - usize::from(stacked);
                shape[d] /= s.parts;
                offset += coord * shape[d] * strides[d];
            }
        }

        for (nm, e) in names[lo..lo + count].iter().zip(&entries[lo..lo + count]) {
            self.check_finite(nm, e)?;
        }
        let mut out = Vec::with_capacity(local.numel());
        for e in &entries[lo..lo + count] {
            let bytes = &self.files[e.file].mmap[e.start..e.end];
            gather(bytes, e.dtype, &shape, &strides, offset, &mut out);
        }
        debug_assert_eq!(out.len(), local.numel(), "invariant: loaded element count");
        round_to(local.dtype, &mut out);
        Ok(Tensor::f32(local_shape, out))
    }
}

impl Weights {
    /// Checks that every element of stored tensor `name` (entry `e`) is finite; otherwise a
    /// [`RuntimeError::NonFiniteWeight`] with their count and the first one. The whole stored
    /// tensor is scanned (once per file and tensor), whatever part of it a rank reads.
    fn check_finite(&self, name: &str, e: &Entry) -> Result<(), RuntimeError> {
        let file = &self.files[e.file];
        let lock = || file.finite.lock().unwrap_or_else(|p| p.into_inner());
        if lock().contains(&e.start) {
            return Ok(());
        }
        let bytes = &file.mmap[e.start..e.end];
        let (mut count, mut first) = (0usize, None);
        let mut see = |i: usize, x: f32| {
            if !x.is_finite() {
                count += 1;
                first.get_or_insert((i, x));
            }
        };
        match e.dtype {
            Dtype::F32 => bytes
                .chunks_exact(4)
                .enumerate()
                .for_each(|(i, c)| see(i, f32::from_le_bytes([c[0], c[1], c[2], c[3]]))),
            Dtype::BF16 => bytes.chunks_exact(2).enumerate().for_each(|(i, c)| {
                see(
                    i,
                    bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32(),
                )
            }),
            Dtype::F16 => bytes.chunks_exact(2).enumerate().for_each(|(i, c)| {
                see(i, f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            }),
            _ => unreachable!("invariant: dtype checked by Weights::entry"),
        }
        match first {
            None => {
                lock().insert(e.start);
                Ok(())
            }
            Some((first, value)) => Err(RuntimeError::NonFiniteWeight {
                file: file.path.clone(),
                name: name.to_string(),
                count,
                first,
                value,
            }),
        }
    }
}

/// Row-major strides (in elements) of a shape.
pub(crate) fn row_major_strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// The graph-layout shape a stored tensor gives after `view` and `transposed` (best effort,
/// for error messages).
fn block_shape(stored: &[usize], src: &ParamSource) -> Vec<usize> {
    let mut s = stored.to_vec();
    if let Some(v) = src.view {
        if v.dim < s.len() {
            s[v.dim] = v.len;
        }
    }
    if src.transposed && s.len() >= 2 {
        let r = s.len();
        s.swap(r - 2, r - 1);
    }
    s
}

/// Checks one stored tensor against the per-entry graph-layout shape `want`, reporting in the
/// stored layout.
fn check_stored(
    name: &str,
    stored: &[usize],
    src: &ParamSource,
    want: &[usize],
) -> Result<(), RuntimeError> {
    let mismatch = |expected: Vec<usize>| RuntimeError::TensorShape {
        name: name.to_string(),
        expected,
        found: stored.to_vec(),
    };
    let mut exp = want.to_vec();
    if src.transposed {
        if exp.len() < 2 {
            return Err(mismatch(exp));
        }
        let r = exp.len();
        exp.swap(r - 2, r - 1);
    }
    if let Some(v) = src.view {
        if v.dim >= exp.len() || exp.len() != stored.len() {
            return Err(mismatch(exp));
        }
        if v.len != exp[v.dim] {
            // The view itself disagrees with the parameter's type: show the block it selects.
            let mut found = stored.to_vec();
            found[v.dim] = v.len;
            return Err(RuntimeError::TensorShape {
                name: name.to_string(),
                expected: exp,
                found,
            });
        }
        exp[v.dim] = stored[v.dim].max(v.start + v.len);
    }
    if exp != stored {
        return Err(mismatch(exp));
    }
    Ok(())
}

/// Appends the elements of a strided view of `bytes` (row-major over `shape`) to `out` as f32.
fn gather(
    bytes: &[u8],
    dtype: Dtype,
    shape: &[usize],
    strides: &[usize],
    offset: usize,
    out: &mut Vec<f32>,
) {
    if shape.contains(&0) {
        return;
    }
    let Some((&inner, outer_shape)) = shape.split_last() else {
        out.push(read(bytes, dtype, offset));
        return;
    };
    let inner_stride = strides[shape.len() - 1];
    let outer_strides = &strides[..shape.len() - 1];
    let mut idx = vec![0usize; outer_shape.len()];
    loop {
        let base = offset
            + idx
                .iter()
                .zip(outer_strides)
                .map(|(i, s)| i * s)
                .sum::<usize>();
        if inner_stride == 1 {
            convert_run(bytes, dtype, base, inner, out);
        } else {
            out.extend((0..inner).map(|j| read(bytes, dtype, base + j * inner_stride)));
        }
        // Odometer over the outer dims.
        let mut d = outer_shape.len();
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < outer_shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

/// Element `i` of a little-endian buffer as f32.
fn read(bytes: &[u8], dtype: Dtype, i: usize) -> f32 {
    match dtype {
        Dtype::F32 => f32::from_le_bytes(
            bytes[4 * i..4 * i + 4]
                .try_into()
                .expect("invariant: 4 bytes"),
        ),
        Dtype::BF16 => {
            bf16::from_bits(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])).to_f32()
        }
        Dtype::F16 => f16::from_bits(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])).to_f32(),
        _ => unreachable!("invariant: dtype checked by Weights::entry"),
    }
}

/// Elements `start..start + n` of a little-endian buffer, appended as f32.
fn convert_run(bytes: &[u8], dtype: Dtype, start: usize, n: usize, out: &mut Vec<f32>) {
    match dtype {
        Dtype::F32 => out.extend(
            bytes[4 * start..4 * (start + n)]
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        ),
        Dtype::BF16 => out.extend(
            bytes[2 * start..2 * (start + n)]
                .chunks_exact(2)
                .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()),
        ),
        Dtype::F16 => out.extend(
            bytes[2 * start..2 * (start + n)]
                .chunks_exact(2)
                .map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()),
        ),
        _ => unreachable!("invariant: dtype checked by Weights::entry"),
    }
}

/// Rounds f32 values to a lower float precision in place (no-op for f32).
pub(crate) fn round_to(dtype: DType, v: &mut [f32]) {
    match dtype {
        DType::Bf16 => v.iter_mut().for_each(|x| *x = bf16::from_f32(*x).to_f32()),
        DType::F16 => v.iter_mut().for_each(|x| *x = f16::from_f32(*x).to_f32()),
        DType::F32 | DType::I32 => {}
    }
}
