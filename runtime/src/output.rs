//! Every file shardc writes goes through here: to a temporary file in the target directory,
//! renamed into place only when complete, so a failed or killed command never leaves a partial
//! file or a truncated input behind; and never onto a file the command reads, unless the user
//! says `--overwrite` (and then still atomically: readers holding the old file keep it).
//!
//! Directories (checkpoints) are built whole beside the target and published by one rename:
//! tensors first, the manifest (`config.json`) last, then the directory swapped into place.

use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use thiserror::Error;

/// Why an output was not written.
#[derive(Debug, Error)]
pub enum OutputError {
    /// The output is (or holds) a file the command reads.
    #[error(
        "{flag} {out}: would overwrite the input {input}; choose another path, or pass --overwrite \
         (the input is then replaced atomically)"
    )]
    OverInput {
        /// The flag that named the output.
        flag: String,
        /// The output path.
        out: PathBuf,
        /// The input it would replace.
        input: PathBuf,
    },
    /// A directory output that holds files shardc did not write.
    #[error(
        "{flag} {out}: the directory holds {found}, which is not part of a shardc checkpoint; \
         choose a new or empty directory"
    )]
    ForeignFiles {
        /// The flag that named the output.
        flag: String,
        /// The output directory.
        out: PathBuf,
        /// The first foreign entry.
        found: String,
    },
    /// The output path itself is unusable (a directory where a file is wanted, or the reverse).
    #[error("{flag} {out}: {msg}")]
    Path {
        /// The flag that named the output.
        flag: String,
        /// The output path.
        out: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// An I/O error while writing.
    #[error("writing {path}: {source}")]
    Io {
        /// The file being written.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> OutputError + '_ {
    move |source| OutputError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The files a command reads, checked against each output it is asked to write.
#[derive(Clone, Debug, Default)]
pub struct Outputs {
    inputs: Vec<PathBuf>,
    overwrite: bool,
}

impl Outputs {
    /// `overwrite`: the user's `--overwrite`.
    pub fn new(overwrite: bool) -> Outputs {
        Outputs {
            inputs: Vec::new(),
            overwrite,
        }
    }

    /// Records an input: a file, or a directory whose files (a model directory) are all read.
    pub fn input(mut self, path: &Path) -> Outputs {
        if let Ok(md) = fs::metadata(path) {
            if md.is_dir() {
                if let Ok(rd) = fs::read_dir(path) {
                    let mut files: Vec<PathBuf> = rd
                        .flatten()
                        .map(|e| e.path())
                        .filter(|p| p.is_file())
                        .collect();
                    files.sort();
                    self.inputs.extend(files);
                }
            } else {
                self.inputs.push(path.to_path_buf());
            }
        }
        self
    }

    /// Records every path of `paths` that is set.
    pub fn inputs<'a>(self, paths: impl IntoIterator<Item = Option<&'a Path>>) -> Outputs {
        paths.into_iter().flatten().fold(self, Outputs::input)
    }

    /// Checks that the file `out` (named by `flag`) may be written: not a directory, not one
    /// of the inputs unless `--overwrite`.
    pub fn check_file(&self, flag: &str, out: &Path) -> Result<(), OutputError> {
        if out.is_dir() {
            return Err(OutputError::Path {
                flag: flag.into(),
                out: out.to_path_buf(),
                msg: "is a directory; give a file path".into(),
            });
        }
        if out.file_name().is_none() {
            return Err(OutputError::Path {
                flag: flag.into(),
                out: out.to_path_buf(),
                msg: "names no file".into(),
            });
        }
        if !self.overwrite {
            if let Some(input) = self.inputs.iter().find(|i| same_file(i, out)) {
                return Err(OutputError::OverInput {
                    flag: flag.into(),
                    out: out.to_path_buf(),
                    input: input.clone(),
                });
            }
        }
        Ok(())
    }

    /// Checks that the checkpoint directory `out` may be written: not a file, holding no input
    /// unless `--overwrite`, and (without `--overwrite`) nothing but an earlier checkpoint's
    /// files `expected`.
    pub fn check_dir(&self, flag: &str, out: &Path, expected: &[&str]) -> Result<(), OutputError> {
        self.check_dir_matching(flag, out, &|name| expected.contains(&name))
    }

    /// [`Outputs::check_dir`] with the entries an earlier output left told by `expected`
    /// (e.g. a sharded checkpoint's `latest` and `step-…` directories).
    pub fn check_dir_matching(
        &self,
        flag: &str,
        out: &Path,
        expected: &dyn Fn(&str) -> bool,
    ) -> Result<(), OutputError> {
        if out.is_file() {
            return Err(OutputError::Path {
                flag: flag.into(),
                out: out.to_path_buf(),
                msg: "is a file; give a directory".into(),
            });
        }
        if !out.is_dir() {
            return Ok(());
        }
        if !self.overwrite {
            for input in &self.inputs {
                let named = input
                    .file_name()
                    .map(|n| n.to_string_lossy())
                    .is_some_and(|n| expected(&n));
                if named && same_file(input, &out.join(input.file_name().unwrap_or_default()))
                    || fs::canonicalize(input)
                        .ok()
                        .zip(fs::canonicalize(out).ok())
                        .is_some_and(|(i, o)| i.starts_with(o))
                {
                    return Err(OutputError::OverInput {
                        flag: flag.into(),
                        out: out.to_path_buf(),
                        input: input.clone(),
                    });
                }
            }
            let mut entries: Vec<String> = fs::read_dir(out)
                .map_err(io_err(out))?
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| !expected(n))
                .collect();
            entries.sort();
            if let Some(found) = entries.into_iter().next() {
                return Err(OutputError::ForeignFiles {
                    flag: flag.into(),
                    out: out.to_path_buf(),
                    found,
                });
            }
        }
        Ok(())
    }

    /// Checks, then writes the file atomically.
    pub fn write(&self, flag: &str, out: &Path, bytes: &[u8]) -> Result<(), OutputError> {
        self.check_file(flag, out)?;
        write_atomic(out, bytes)
    }
}

/// Whether two paths name the same existing file (same device and inode on Unix).
fn same_file(a: &Path, b: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        match (fs::metadata(a), fs::metadata(b)) {
            (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
            _ => false,
        }
    }
    #[cfg(not(unix))]
    {
        match (fs::canonicalize(a), fs::canonicalize(b)) {
            (Ok(x), Ok(y)) => x == y,
            _ => false,
        }
    }
}

static SERIAL: AtomicU64 = AtomicU64::new(0);

/// A fresh hidden name beside `path`: `.NAME.tmp-PID-N`.
fn temp_beside(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map_or_else(|| "out".into(), |n| n.to_string_lossy().into_owned());
    let n = SERIAL.fetch_add(1, Ordering::Relaxed);
    let tmp = format!(".{name}.tmp-{}-{n}", std::process::id());
    path.parent()
        .filter(|p| !p.as_os_str().is_empty())
        .map_or_else(|| PathBuf::from(&tmp), |p| p.join(&tmp))
}

/// Removes a temporary file or directory on drop unless disarmed.
struct TempGuard(Option<PathBuf>);

impl Drop for TempGuard {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = if p.is_dir() {
                fs::remove_dir_all(&p)
            } else {
                fs::remove_file(&p)
            };
        }
    }
}

/// Writes `bytes` to `path` atomically: a temporary file in the same directory, flushed to
/// disk, then renamed over `path`. On any error the temporary file is removed and `path` is
/// untouched.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), OutputError> {
    write_atomic_with(path, |f| f.write_all(bytes))
}

/// [`write_atomic`] for content produced by a writer.
pub fn write_atomic_with(
    path: &Path,
    fill: impl FnOnce(&mut io::BufWriter<fs::File>) -> io::Result<()>,
) -> Result<(), OutputError> {
    let tmp = temp_beside(path);
    let file = fs::File::create(&tmp).map_err(io_err(path))?;
    let mut guard = TempGuard(Some(tmp.clone()));
    let mut w = io::BufWriter::new(file);
    fill(&mut w).map_err(io_err(path))?;
    let file = w.into_inner().map_err(|e| io_err(path)(e.into_error()))?;
    file.sync_all().map_err(io_err(path))?;
    drop(file);
    fs::rename(&tmp, path).map_err(io_err(path))?;
    guard.0 = None;
    Ok(())
}

/// A directory being built beside its destination, published whole by [`StagedDir::publish`];
/// dropped unpublished, it is removed and the destination is untouched.
pub struct StagedDir {
    dest: PathBuf,
    guard: TempGuard,
}

impl StagedDir {
    /// Starts staging the directory `dest` (whose parent is created if missing).
    pub fn new(dest: &Path) -> Result<StagedDir, OutputError> {
        if let Some(parent) = dest.parent().filter(|p| !p.as_os_str().is_empty()) {
            fs::create_dir_all(parent).map_err(io_err(parent))?;
        }
        let tmp = temp_beside(dest);
        fs::create_dir(&tmp).map_err(io_err(dest))?;
        Ok(StagedDir {
            dest: dest.to_path_buf(),
            guard: TempGuard(Some(tmp)),
        })
    }

    /// Starts staging the directory `dest` at the given hidden path `stage` beside it (a
    /// name every process of a job can compute, so each writes its own files into it); a
    /// stale `stage` a killed run left is removed first.
    pub fn at(dest: &Path, stage: &Path) -> Result<StagedDir, OutputError> {
        if stage.exists() {
            fs::remove_dir_all(stage).map_err(io_err(stage))?;
        }
        fs::create_dir_all(stage).map_err(io_err(stage))?;
        Ok(StagedDir {
            dest: dest.to_path_buf(),
            guard: TempGuard(Some(stage.to_path_buf())),
        })
    }

    /// Where file `name` is staged.
    pub fn path(&self, name: &str) -> PathBuf {
        self.guard
            .0
            .as_ref()
            .expect("invariant: unpublished")
            .join(name)
    }

    /// Writes the staged file `name`.
    pub fn write(&self, name: &str, bytes: &[u8]) -> Result<(), OutputError> {
        write_atomic(&self.path(name), bytes)
    }

    /// Puts the directory in place of `dest` in one step: a new `dest` by a rename; an existing
    /// one by an atomic exchange (Linux), its old content then removed. Files of an existing
    /// `dest` that the staged directory lacks are kept (moved over first), so a model
    /// directory's other files (tokenizer, …) survive an `--overwrite`.
    pub fn publish(self) -> Result<(), OutputError> {
        self.publish_dropping(&|_| false)
    }

    /// [`StagedDir::publish`], except that entries of an existing `dest` that `stale` names
    /// (an earlier output's files this one does not write: a sharded export's shards
    /// replaced by one file) are dropped rather than kept.
    pub fn publish_dropping(mut self, stale: &dyn Fn(&str) -> bool) -> Result<(), OutputError> {
        let tmp = self.guard.0.clone().expect("invariant: unpublished");
        if !self.dest.exists() {
            fs::rename(&tmp, &self.dest).map_err(io_err(&self.dest))?;
            self.guard.0 = None;
            return Ok(());
        }
        // Keep the destination's other entries: hard-link (else copy) them into the stage.
        for e in fs::read_dir(&self.dest)
            .map_err(io_err(&self.dest))?
            .flatten()
        {
            let target = tmp.join(e.file_name());
            if target.exists() || stale(&e.file_name().to_string_lossy()) {
                continue;
            }
            let src = e.path();
            if src.is_dir() {
                copy_dir(&src, &target).map_err(io_err(&src))?;
            } else if fs::hard_link(&src, &target).is_err() {
                fs::copy(&src, &target).map_err(io_err(&src))?;
            }
        }
        exchange(&tmp, &self.dest).map_err(io_err(&self.dest))?;
        // `tmp` now holds the old directory: the guard removes it.
        Ok(())
    }
}

fn copy_dir(src: &Path, dst: &Path) -> io::Result<()> {
    fs::create_dir_all(dst)?;
    for e in fs::read_dir(src)?.flatten() {
        let (s, d) = (e.path(), dst.join(e.file_name()));
        if s.is_dir() {
            copy_dir(&s, &d)?;
        } else {
            fs::copy(&s, &d)?;
        }
    }
    Ok(())
}

/// Swaps two paths atomically where the OS can (`renameat2(RENAME_EXCHANGE)`), else moves
/// `b` aside and `a` into place.
fn exchange(a: &Path, b: &Path) -> io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        use std::ffi::CString;
        use std::os::unix::ffi::OsStrExt;
        let ca = CString::new(a.as_os_str().as_bytes())?;
        let cb = CString::new(b.as_os_str().as_bytes())?;
        // SAFETY: two valid NUL-terminated paths relative to the working directory.
        let rc = unsafe {
            libc::renameat2(
                libc::AT_FDCWD,
                ca.as_ptr(),
                libc::AT_FDCWD,
                cb.as_ptr(),
                libc::RENAME_EXCHANGE,
            )
        };
        if rc == 0 {
            return Ok(());
        }
    }
    let aside = temp_beside(b);
    fs::rename(b, &aside)?;
    if let Err(e) = fs::rename(a, b) {
        let _ = fs::rename(&aside, b);
        return Err(e);
    }
    fs::rename(&aside, a)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atomic_write_replaces_whole_and_leaves_no_temp() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("out.json");
        write_atomic(&p, b"first").unwrap();
        write_atomic(&p, b"second").unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"second");
        let names: Vec<_> = fs::read_dir(d.path()).unwrap().flatten().collect();
        assert_eq!(names.len(), 1, "{names:?}");
    }

    #[test]
    fn failed_write_keeps_the_old_file_and_no_temp() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("out.json");
        write_atomic(&p, b"old").unwrap();
        let e = write_atomic_with(&p, |w| {
            w.write_all(b"partial")?;
            Err(io::Error::other("disk full"))
        })
        .unwrap_err();
        assert!(e.to_string().contains("out.json"), "{e}");
        assert_eq!(fs::read(&p).unwrap(), b"old");
        assert_eq!(fs::read_dir(d.path()).unwrap().count(), 1);
    }

    #[test]
    fn inputs_are_refused_unless_overwrite() {
        let d = tempfile::tempdir().unwrap();
        let model = d.path().join("model");
        fs::create_dir(&model).unwrap();
        fs::write(model.join("config.json"), "{}").unwrap();
        let o = Outputs::new(false).input(&model);
        let e = o
            .check_file("--out", &model.join("config.json"))
            .unwrap_err();
        assert!(e.to_string().contains("would overwrite the input"), "{e}");
        let e = o.check_dir("--save", &model, &["config.json"]).unwrap_err();
        assert!(e.to_string().contains("--save"), "{e}");
        let ok = Outputs::new(true).input(&model);
        ok.check_file("--out", &model.join("config.json")).unwrap();
        ok.check_dir("--save", &model, &["config.json"]).unwrap();
        // A directory holding other files is refused without --overwrite.
        let other = d.path().join("other");
        fs::create_dir(&other).unwrap();
        fs::write(other.join("notes.txt"), "x").unwrap();
        let e = Outputs::new(false)
            .check_dir("--save", &other, &["config.json"])
            .unwrap_err();
        assert!(e.to_string().contains("notes.txt"), "{e}");
    }

    #[test]
    fn staged_dir_publishes_whole_or_not_at_all() {
        let d = tempfile::tempdir().unwrap();
        let dest = d.path().join("ckpt");
        let s = StagedDir::new(&dest).unwrap();
        s.write("a", b"1").unwrap();
        drop(s);
        assert!(!dest.exists());
        assert_eq!(fs::read_dir(d.path()).unwrap().count(), 0);
        let s = StagedDir::new(&dest).unwrap();
        s.write("a", b"1").unwrap();
        s.publish().unwrap();
        assert_eq!(fs::read(dest.join("a")).unwrap(), b"1");
        fs::write(dest.join("keep"), "k").unwrap();
        let s = StagedDir::new(&dest).unwrap();
        s.write("a", b"2").unwrap();
        s.publish().unwrap();
        assert_eq!(fs::read(dest.join("a")).unwrap(), b"2");
        assert_eq!(fs::read(dest.join("keep")).unwrap(), b"k");
        assert_eq!(fs::read_dir(d.path()).unwrap().count(), 1);
    }
}
