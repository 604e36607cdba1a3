//! The on-disk PTX cache.
//!
//! A compiled kernel is stored as `<dir>/<key>.ptx`, where the key is the blake3 hash of
//! everything that determines the PTX: the source name (it is embedded by `-lineinfo`), the
//! source text, the full NVRTC option list, the arch and the NVRTC version. The directory is
//! `$SHARDC_CACHE_DIR/ptx`, else `$XDG_CACHE_HOME/shardc/ptx`, else `~/.cache/shardc/ptx`.
//! Writes go to a temporary file that is then renamed, so concurrent compilers (several ranks,
//! parallel tests) never see a torn file. A cache that cannot be read or written only costs a
//! recompile: it is never an error.

use std::fmt;
use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Bumped when the key derivation or file format changes, so old entries are ignored.
const FORMAT_TAG: &[u8] = b"shardc-ptx-cache-v1";

/// blake3 of (source name, source, options, arch, NVRTC version): names one cache entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CacheKey([u8; 32]);

impl CacheKey {
    /// The key for compiling `src` (named `source_name`) for `arch` with exactly `options`
    /// (the full list NVRTC receives, `-lineinfo` included) under NVRTC `nvrtc_version`.
    pub fn new(
        source_name: &str,
        src: &str,
        options: &[String],
        arch: &str,
        nvrtc_version: (i32, i32),
    ) -> CacheKey {
        let mut h = blake3::Hasher::new();
        let mut field = |bytes: &[u8]| {
            // Length-prefixed, so ("ab", "c") and ("a", "bc") hash differently.
            h.update(&(bytes.len() as u64).to_le_bytes());
            h.update(bytes);
        };
        field(FORMAT_TAG);
        field(source_name.as_bytes());
        field(src.as_bytes());
        field(&(options.len() as u64).to_le_bytes());
        for o in options {
            field(o.as_bytes());
        }
        field(arch.as_bytes());
        field(&nvrtc_version.0.to_le_bytes());
        field(&nvrtc_version.1.to_le_bytes());
        CacheKey(*h.finalize().as_bytes())
    }

    /// The 32 hash bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Display for CacheKey {
    /// 64 lowercase hex digits.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

/// What the cache did for one compile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheOutcome {
    /// The PTX came from the cache; NVRTC did not run.
    Hit,
    /// NVRTC ran and the result was stored.
    Stored,
    /// NVRTC ran; the cache is disabled or could not be written.
    NotStored,
}

/// A directory of cached PTX files, or no caching at all.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PtxCache {
    dir: Option<PathBuf>,
}

impl PtxCache {
    /// A cache in `dir` (created on first store).
    pub fn new(dir: impl Into<PathBuf>) -> PtxCache {
        PtxCache {
            dir: Some(dir.into()),
        }
    }

    /// No caching: every compile runs NVRTC.
    pub fn disabled() -> PtxCache {
        PtxCache { dir: None }
    }

    /// The default cache (see the module docs for the directory); disabled when no directory
    /// can be determined.
    pub fn from_env() -> PtxCache {
        PtxCache {
            dir: default_dir(|k| std::env::var_os(k)),
        }
    }

    /// The cache directory, if caching.
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// The file an entry lives in.
    pub fn path(&self, key: &CacheKey) -> Option<PathBuf> {
        self.dir.as_ref().map(|d| d.join(format!("{key}.ptx")))
    }

    /// The cached PTX for `key`, if present and plausible (it has a `.version` directive).
    pub fn load(&self, key: &CacheKey) -> Option<String> {
        let text = fs::read_to_string(self.path(key)?).ok()?;
        text.contains(".version").then_some(text)
    }

    /// Stores `ptx` under `key` atomically (temp file + rename).
    pub fn store(&self, key: &CacheKey, ptx: &str) -> CacheOutcome {
        let (Some(dir), Some(path)) = (self.dir.as_ref(), self.path(key)) else {
            return CacheOutcome::NotStored;
        };
        static NEXT_TMP: AtomicU64 = AtomicU64::new(0);
        let tmp = dir.join(format!(
            "{key}.ptx.tmp.{}.{}",
            std::process::id(),
            NEXT_TMP.fetch_add(1, Ordering::Relaxed)
        ));
        let written = fs::create_dir_all(dir)
            .and_then(|()| fs::File::create(&tmp))
            .and_then(|mut f| f.write_all(ptx.as_bytes()))
            .and_then(|()| fs::rename(&tmp, &path));
        match written {
            Ok(()) => CacheOutcome::Stored,
            Err(_) => {
                let _ = fs::remove_file(&tmp);
                CacheOutcome::NotStored
            }
        }
    }
}

/// `$SHARDC_CACHE_DIR/ptx`, `$XDG_CACHE_HOME/shardc/ptx` or `$HOME/.cache/shardc/ptx` (the first
/// variable that is set and non-empty wins).
fn default_dir(var: impl Fn(&str) -> Option<std::ffi::OsString>) -> Option<PathBuf> {
    let set = |k: &str| var(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(d) = set("SHARDC_CACHE_DIR") {
        return Some(d.join("ptx"));
    }
    if let Some(d) = set("XDG_CACHE_HOME") {
        return Some(d.join("shardc").join("ptx"));
    }
    set("HOME").map(|h| h.join(".cache").join("shardc").join("ptx"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(src: &str, opts: &[&str], arch: &str, v: (i32, i32)) -> CacheKey {
        let opts: Vec<String> = opts.iter().map(|s| s.to_string()).collect();
        CacheKey::new("k.cu", src, &opts, arch, v)
    }

    #[test]
    fn key_is_stable() {
        // Pinned: a change here invalidates every cache on disk; bump FORMAT_TAG deliberately.
        let k = key(
            "extern \"C\" __global__ void f() {}",
            &["-lineinfo"],
            "sm_90",
            (13, 0),
        );
        assert_eq!(
            k,
            key(
                "extern \"C\" __global__ void f() {}",
                &["-lineinfo"],
                "sm_90",
                (13, 0)
            )
        );
        assert_eq!(k.to_string().len(), 64);
        assert_eq!(
            k.to_string(),
            "868f11f4a23003cf4121ed805773b231bc747fba6c1f4968c8998ec12bef026b",
            "cache key derivation changed"
        );
    }

    #[test]
    fn key_depends_on_every_field() {
        let base = key("src", &["-lineinfo"], "sm_90", (13, 0));
        assert_ne!(base, key("src ", &["-lineinfo"], "sm_90", (13, 0)));
        assert_ne!(base, key("src", &["-lineinfo", "-G"], "sm_90", (13, 0)));
        assert_ne!(base, key("src", &[], "sm_90", (13, 0)));
        assert_ne!(base, key("src", &["-lineinfo"], "sm_80", (13, 0)));
        assert_ne!(base, key("src", &["-lineinfo"], "sm_90", (13, 1)));
        assert_ne!(base, key("src", &["-lineinfo"], "sm_90", (12, 9)));
        let other_name = CacheKey::new("j.cu", "src", &["-lineinfo".into()], "sm_90", (13, 0));
        assert_ne!(base, other_name);
        // Field boundaries matter.
        assert_ne!(
            key("src", &["ab", "c"], "sm_90", (13, 0)),
            key("src", &["a", "bc"], "sm_90", (13, 0))
        );
    }

    #[test]
    fn store_then_load() {
        let dir = tempfile::tempdir().expect("invariant: temp dir");
        let cache = PtxCache::new(dir.path().join("nested").join("ptx"));
        let k = key("src", &[], "sm_90", (13, 0));
        assert_eq!(cache.load(&k), None);
        let ptx = "//\n.version 9.0\n.target sm_90\n";
        assert_eq!(cache.store(&k, ptx), CacheOutcome::Stored);
        assert_eq!(cache.load(&k).as_deref(), Some(ptx));
        // No temporary files left behind.
        let names: Vec<_> = std::fs::read_dir(cache.dir().expect("invariant: enabled"))
            .expect("invariant: dir exists")
            .map(|e| e.expect("invariant: entry").file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from(format!("{k}.ptx"))]);
    }

    #[test]
    fn corrupt_entry_is_a_miss() {
        let dir = tempfile::tempdir().expect("invariant: temp dir");
        let cache = PtxCache::new(dir.path());
        let k = key("src", &[], "sm_90", (13, 0));
        std::fs::write(cache.path(&k).expect("invariant: enabled"), "garbage").expect("write");
        assert_eq!(cache.load(&k), None);
    }

    #[test]
    fn disabled_cache() {
        let cache = PtxCache::disabled();
        let k = key("src", &[], "sm_90", (13, 0));
        assert_eq!(cache.store(&k, ".version 9.0"), CacheOutcome::NotStored);
        assert_eq!(cache.load(&k), None);
    }

    #[test]
    fn default_dir_precedence() {
        use std::ffi::OsString;
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| OsString::from(v))
            }
        };
        assert_eq!(
            default_dir(env(&[("SHARDC_CACHE_DIR", "/c"), ("HOME", "/h")])),
            Some(PathBuf::from("/c/ptx"))
        );
        assert_eq!(
            default_dir(env(&[
                ("SHARDC_CACHE_DIR", ""),
                ("XDG_CACHE_HOME", "/x"),
                ("HOME", "/h")
            ])),
            Some(PathBuf::from("/x/shardc/ptx"))
        );
        assert_eq!(
            default_dir(env(&[("HOME", "/h")])),
            Some(PathBuf::from("/h/.cache/shardc/ptx"))
        );
        assert_eq!(default_dir(env(&[])), None);
    }
}
