//! Deterministic fuzzing support for `tests/fuzz_inputs.rs`: a seeded RNG, mutators for bytes,
//! JSON and line-oriented text, a guarded case runner (panic message and location captured,
//! wall-clock timeout), a guarded run of the `shardc` binary, the check every error message
//! must pass, and the ledger of known failures in code owned by other modules.
//!
//! Every case is a pure function of (target, case index): a failure prints the index, what
//! was mutated and where the input was saved, so it reproduces without the rest of the run.
#![allow(dead_code)]

pub use crate::common::Rng;
use serde_json::{Map, Value};
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{mpsc, Once};
use std::time::{Duration, Instant};

/// The run's seed. Changing it changes every case; keep it fixed so CI is reproducible.
pub const SEED: u64 = 0x5EED_5A4D_C0DE_F022;

/// The fuzzers' draws from the tests' SplitMix64 stream.
impl Rng {
    /// The generator of case `case` of `target`.
    pub fn for_case(target: &str, case: usize) -> Rng {
        let mut h = SEED;
        for b in target.bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01B3);
        }
        let mut r = Rng(h ^ (case as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        r.next_u64();
        r
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }

    /// A random element.
    pub fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len())]
    }
}

// ---------------------------------------------------------------------------------------------
// Guarded execution.

/// How one case ended.
#[derive(Debug)]
pub enum Outcome<T> {
    /// The code under test returned.
    Done(T),
    /// It panicked (message, `file:line`).
    Panic { msg: String, at: String },
    /// It did not return within the timeout.
    Hang,
}

thread_local! {
    static LAST_PANIC: RefCell<Option<(String, String)>> = const { RefCell::new(None) };
}

static HOOK: Once = Once::new();

/// Threads whose name starts with this have their panics recorded instead of printed.
const CASE_THREAD: &str = "fuzz-case";

fn install_hook() {
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let ours = std::thread::current()
                .name()
                .is_some_and(|n| n.starts_with(CASE_THREAD));
            if !ours {
                previous(info);
                return;
            }
            let p = info.payload();
            let msg = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "<non-string panic payload>".into());
            let mut at = info
                .location()
                .map(|l| format!("{}:{}", l.file(), l.line()))
                .unwrap_or_default();
            if at.starts_with("/rustc/") {
                // Inside the standard library (an iterator's overflow check): name the
                // workspace frame that called it.
                if let Some(ours) = workspace_frame(&std::backtrace::Backtrace::force_capture()) {
                    at = format!("{ours} (via {at})");
                }
            }
            LAST_PANIC.with(|c| *c.borrow_mut() = Some((msg, at)));
        }));
    });
}

/// The first `path:line` of a backtrace inside this workspace's crates.
fn workspace_frame(bt: &std::backtrace::Backtrace) -> Option<String> {
    bt.to_string().lines().find_map(|l| {
        let loc = l.trim().strip_prefix("at ")?;
        let ours = ["compiler/src/", "runtime/src/", "kernels/src/", "src/cli/"]
            .iter()
            .any(|d| loc.contains(d));
        (ours && !loc.starts_with("/rustc/")).then(|| loc.trim_start_matches("./").to_string())
    })
}

/// Runs `f` on a thread of its own with a deadline; a panic is caught with its message and
/// location. A case past its deadline is reported as a hang (its thread is left behind: the
/// test fails anyway).
pub fn guarded<T: Send + 'static>(
    timeout: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> Outcome<T> {
    install_hook();
    let (tx, rx) = mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name(CASE_THREAD.to_string())
        .stack_size(16 << 20)
        .spawn(move || {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
            let out = match r {
                Ok(v) => Outcome::Done(v),
                Err(_) => {
                    let (msg, at) = LAST_PANIC
                        .with(|c| c.borrow_mut().take())
                        .unwrap_or_else(|| ("<unknown>".into(), String::new()));
                    Outcome::Panic { msg, at }
                }
            };
            let _ = tx.send(out);
        })
        .expect("spawning a fuzz case thread");
    match rx.recv_timeout(timeout) {
        Ok(out) => {
            let _ = spawned.join();
            out
        }
        Err(_) => Outcome::Hang,
    }
}

/// What a run of the `shardc` binary did.
#[derive(Debug)]
pub struct BinRun {
    /// Exit code (`None`: killed by a signal or by the timeout).
    pub code: Option<i32>,
    /// The run was killed at the timeout.
    pub timed_out: bool,
    /// Standard output.
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
}

/// Runs `shardc args...` with a deadline; past it the child is killed.
pub fn run_shardc(args: &[&str], timeout: Duration) -> BinRun {
    let mut child = Command::new(env!("CARGO_BIN_EXE_shardc"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawning shardc");
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            let _ = r.read_to_end(&mut buf);
            String::from_utf8_lossy(&buf).to_string()
        })
    };
    let out = drain(Box::new(child.stdout.take().expect("piped stdout")));
    let err = drain(Box::new(child.stderr.take().expect("piped stderr")));
    let deadline = Instant::now() + timeout;
    let mut timed_out = false;
    let status = loop {
        if let Some(s) = child.try_wait().expect("waiting for shardc") {
            break s;
        }
        if Instant::now() >= deadline {
            timed_out = true;
            let _ = child.kill();
            break child.wait().expect("reaping shardc");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    BinRun {
        code: status.code(),
        timed_out,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
    }
}

// ---------------------------------------------------------------------------------------------
// Error messages.

/// The contract of every error: one non-empty line, no panic text, naming at least one of
/// `names` (the file, field, tensor or flag the input can be wrong about).
pub fn check_message(msg: &str, names: &[&str]) -> Result<(), String> {
    let m = msg.trim_end();
    if m.trim().is_empty() {
        return Err("empty error message".into());
    }
    if m.contains('\n') {
        return Err(format!("error message spans several lines: {m:?}"));
    }
    if m.contains("panicked") {
        return Err(format!("error message reports a panic: {m:?}"));
    }
    if !names.iter().any(|n| !n.is_empty() && m.contains(n)) {
        return Err(format!(
            "error message names none of the input's files, fields or tensors: {m:?}"
        ));
    }
    Ok(())
}

/// A case's verdict: `None` when the input was accepted, `Some(message)` when it was rejected
/// with an error that passed [`check_message`].
pub type Verdict = Option<String>;

/// An error `msg` for an input whose files, fields and tensors are `names`: a verdict when it
/// passes [`check_message`].
pub fn reject(msg: &str, names: &[&str]) -> Result<Verdict, String> {
    check_message(msg, names).map(|()| Some(msg.to_string()))
}

/// The binary's contract for a bad input: exit code 1 with one `error: ` line on stderr that
/// passes [`check_message`]; for a good one exit code 0.
pub fn check_bin(run: &BinRun, names: &[&str]) -> Result<Verdict, String> {
    if run.timed_out {
        return Err("timed out".into());
    }
    match run.code {
        Some(0) => Ok(None),
        Some(1) => {
            let err = run.stderr.trim_end();
            let last = err.lines().last().unwrap_or("");
            if err.lines().filter(|l| !l.starts_with("warning: ")).count() != 1 {
                return Err(format!("stderr is not one line: {err:?}"));
            }
            let Some(msg) = last.strip_prefix("error: ") else {
                return Err(format!("stderr does not start with `error: `: {err:?}"));
            };
            reject(msg, names)
        }
        Some(c) => Err(format!("exit code {c}; stderr: {}", run.stderr.trim_end())),
        None => Err(format!(
            "killed by a signal; stderr: {}",
            run.stderr.trim_end()
        )),
    }
}

// ---------------------------------------------------------------------------------------------
// Known failures in code owned by other modules.

/// A failure the fuzzer once found, kept with its reproducer. Cases that hit it fail the run;
/// `SHARDC_FUZZ_STRICT=0` only counts and reports them (while a fix is under way).
#[derive(Debug)]
pub struct Known {
    /// Short id (printed in the summary).
    pub id: &'static str,
    /// The module that owns the fix.
    pub owner: &'static str,
    /// A panic whose location contains this path...
    pub file: &'static str,
    /// ...and whose message contains this text.
    pub msg: &'static str,
    /// A minimal input that reproduces it.
    pub repro: &'static str,
}

/// Whether known failures fail the run as well (the default).
pub fn strict() -> bool {
    !std::env::var("SHARDC_FUZZ_STRICT").is_ok_and(|v| v == "0")
}

/// The entry of `known` a panic matches.
pub fn known_panic<'a>(known: &'a [Known], msg: &str, at: &str) -> Option<&'a Known> {
    known
        .iter()
        .find(|k| !k.file.is_empty() && at.contains(k.file) && msg.contains(k.msg))
}

// ---------------------------------------------------------------------------------------------
// Tally.

/// One input file saved when its case fails: the target, the extension and the bytes (as
/// [`save_failure`] takes them).
pub type Saved<'a> = (&'a str, &'a str, &'a [u8]);

/// Counts of one target's outcomes and its failures.
#[derive(Debug, Default)]
pub struct Tally {
    /// Target name.
    pub target: String,
    /// Cases run.
    pub cases: usize,
    /// Inputs accepted.
    pub accepted: usize,
    /// Inputs rejected with a good error.
    pub rejected: usize,
    /// A few of the error messages (distinct by their first words), to show in the summary.
    pub samples: Vec<String>,
    /// Cases that hit a known failure elsewhere, by id.
    pub known: BTreeMap<&'static str, usize>,
    /// Failures: (case, what was done to the input, what went wrong).
    pub failures: Vec<(usize, String, String)>,
    /// When the target started.
    pub started: Option<Instant>,
}

impl Tally {
    /// An empty tally for `target`, started now.
    pub fn new(target: &str) -> Tally {
        Tally {
            target: target.into(),
            started: Some(Instant::now()),
            ..Tally::default()
        }
    }

    /// Counts and runs `one(tally, case)` for cases `0..cases` of `target`, then
    /// [`Tally::finish`]es.
    pub fn run(target: &str, cases: usize, mut one: impl FnMut(&mut Tally, usize)) {
        let mut t = Tally::new(target);
        for case in 0..cases {
            t.cases += 1;
            one(&mut t, case);
        }
        t.finish();
    }

    /// Adds one binary run's outcome: an accepted input must pass `accepted` (its `Err` is a
    /// failure), a rejected one must pass [`check_bin`]; a failure of that saves the input
    /// (`save`: target, extension and bytes, as [`save_failure`] takes them).
    pub fn judge_bin(
        &mut self,
        case: usize,
        how: &str,
        (run, names): (&BinRun, &[&str]),
        save: Saved,
        accepted: impl FnOnce(&BinRun) -> Result<(), String>,
    ) {
        match check_bin(run, names) {
            Ok(None) => match accepted(run) {
                Ok(()) => self.accepted += 1,
                Err(e) => self.fail(case, how, e),
            },
            Ok(Some(msg)) => self.reject(msg),
            Err(e) => {
                save_failure(save.0, case, save.1, save.2);
                self.fail(case, how, e);
            }
        }
    }

    /// Records an input rejected with a good error.
    pub fn reject(&mut self, msg: String) {
        self.rejected += 1;
        let key = |m: &str| m.split_whitespace().take(4).collect::<Vec<_>>().join(" ");
        if self.samples.len() < 4 && !self.samples.iter().any(|s| key(s) == key(&msg)) {
            self.samples.push(msg);
        }
    }

    /// Records a known failure (a failure in strict mode).
    pub fn known(&mut self, case: usize, how: &str, k: &Known) {
        if strict() {
            self.fail(
                case,
                how,
                format!("known failure `{}` ({}): {}", k.id, k.owner, k.repro),
            );
        } else {
            *self.known.entry(k.id).or_insert(0) += 1;
        }
    }

    /// Records a failure, saving the input for reproduction.
    pub fn fail(&mut self, case: usize, how: &str, what: String) {
        self.failures.push((case, how.to_string(), what));
    }

    /// Prints the summary and panics on any failure.
    pub fn finish(self) {
        let started = self.started.unwrap_or_else(Instant::now);
        eprintln!(
            "fuzz {}: {} cases in {:.1} s: {} accepted, {} rejected with a clear error, {} failures{}",
            self.target,
            self.cases,
            started.elapsed().as_secs_f64(),
            self.accepted,
            self.rejected,
            self.failures.len(),
            if self.known.is_empty() {
                String::new()
            } else {
                format!(
                    "; known failures elsewhere (see KNOWN_OTHERS): {}",
                    self.known
                        .iter()
                        .map(|(k, n)| format!("{k} ×{n}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            }
        );
        for m in &self.samples {
            eprintln!("  e.g. {m}");
        }
        if self.failures.is_empty() {
            return;
        }
        let mut report = String::new();
        for (case, how, what) in self.failures.iter().take(20) {
            report.push_str(&format!("  case {case} [{how}]: {what}\n"));
        }
        panic!(
            "fuzz {}: {} of {} cases failed:\n{report}",
            self.target,
            self.failures.len(),
            self.cases
        );
    }
}

/// Where failing inputs are saved: `target/fuzz-failures/<target>/case-<n>.<ext>`.
pub fn save_failure(target: &str, case: usize, ext: &str, bytes: &[u8]) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("fuzz-failures")
        .join(target);
    let _ = std::fs::create_dir_all(&dir);
    let p = dir.join(format!("case-{case}.{ext}"));
    let _ = std::fs::write(&p, bytes);
    p
}

// ---------------------------------------------------------------------------------------------
// Mutators.

/// Numbers and values that break parsers and arithmetic.
pub fn special_value(rng: &mut Rng) -> Value {
    match rng.below(26) {
        0 => Value::from(0),
        1 => Value::from(-1),
        2 => Value::from(1),
        3 => Value::from(2),
        4 => Value::from(3),
        5 => Value::from(7),
        6 => Value::from(1e308),
        7 => Value::from(-1e308),
        8 => Value::from(1e-320),
        9 => Value::from(1u64 << 31),
        10 => Value::from(1u64 << 32),
        11 => Value::from((1u64 << 53) + 1),
        12 => Value::from(u64::MAX),
        13 => Value::from(i64::MIN),
        14 => Value::from(1.5),
        15 => Value::from(-0.0),
        16 => Value::from(""),
        17 => Value::from("x"),
        18 => Value::from("NaN"),
        19 => Value::from(true),
        20 => Value::Null,
        21 => Value::Array(vec![]),
        22 => Value::Object(Map::new()),
        23 => Value::Array(vec![Value::from(1), Value::from(2)]),
        24 => Value::from(1_000_000_000_000u64),
        _ => Value::from(65536),
    }
}

/// One step of a path into a JSON value.
#[derive(Clone, Debug)]
pub enum Step {
    /// Object key.
    Key(String),
    /// Array index.
    Idx(usize),
}

/// Every path in `v` (the root included), in document order.
pub fn json_paths(v: &Value) -> Vec<Vec<Step>> {
    fn walk(v: &Value, here: &mut Vec<Step>, out: &mut Vec<Vec<Step>>) {
        out.push(here.clone());
        match v {
            Value::Object(m) => {
                for (k, x) in m {
                    here.push(Step::Key(k.clone()));
                    walk(x, here, out);
                    here.pop();
                }
            }
            Value::Array(a) => {
                for (i, x) in a.iter().enumerate() {
                    here.push(Step::Idx(i));
                    walk(x, here, out);
                    here.pop();
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(v, &mut Vec::new(), &mut out);
    out
}

/// The value at `path`.
pub fn json_at<'a>(v: &'a mut Value, path: &[Step]) -> Option<&'a mut Value> {
    let mut cur = v;
    for s in path {
        cur = match s {
            Step::Key(k) => cur.as_object_mut()?.get_mut(k)?,
            Step::Idx(i) => cur.as_array_mut()?.get_mut(*i)?,
        };
    }
    Some(cur)
}

/// `a.b[3].c`.
pub fn path_text(path: &[Step]) -> String {
    let mut s = String::new();
    for p in path {
        match p {
            Step::Key(k) => {
                if !s.is_empty() {
                    s.push('.');
                }
                s.push_str(k);
            }
            Step::Idx(i) => s.push_str(&format!("[{i}]")),
        }
    }
    if s.is_empty() {
        "<root>".into()
    } else {
        s
    }
}

/// One of the keys of the non-empty `m`, uniformly.
fn random_key(rng: &mut Rng, m: &Map<String, Value>) -> String {
    m.keys()
        .nth(rng.below(m.len()))
        .cloned()
        .unwrap_or_default()
}

/// One structural mutation of `v`; `keys` are extra key names worth inserting. Returns what
/// it did.
pub fn mutate_json(rng: &mut Rng, v: &mut Value, keys: &[&str]) -> String {
    let paths = json_paths(v);
    let path = rng.pick(&paths).clone();
    let at = path_text(&path);
    let Some(node) = json_at(v, &path) else {
        return "noop".into();
    };
    match rng.below(10) {
        0..=2 => {
            let x = special_value(rng);
            let d = format!("{at} = {x}");
            *node = x;
            d
        }
        3 | 4 => match node.as_f64() {
            Some(x) => {
                let y = match rng.below(7) {
                    0 => x + 1.0,
                    1 => x - 1.0,
                    2 => x * 2.0,
                    3 => (x / 2.0).floor(),
                    4 => -x,
                    5 => x * 1e6,
                    _ => x + 0.5,
                };
                let y = if y.fract() == 0.0 && y.abs() < 9e15 {
                    if y >= 0.0 {
                        Value::from(y as u64)
                    } else {
                        Value::from(y as i64)
                    }
                } else {
                    Value::from(y)
                };
                let d = format!("{at}: {x} -> {y}");
                *node = y;
                d
            }
            None => {
                let x = special_value(rng);
                let d = format!("{at} = {x}");
                *node = x;
                d
            }
        },
        5 => match node {
            Value::Object(m) if !m.is_empty() => {
                let k = random_key(rng, m);
                m.remove(&k);
                format!("delete {at}.{k}")
            }
            Value::Array(a) if !a.is_empty() => {
                let i = rng.below(a.len());
                a.remove(i);
                format!("delete {at}[{i}]")
            }
            _ => {
                *node = Value::Null;
                format!("{at} = null")
            }
        },
        6 => match node {
            Value::Object(m) => {
                let k = if !keys.is_empty() && rng.chance(0.7) {
                    rng.pick(keys).to_string()
                } else {
                    "zz_extra".to_string()
                };
                let x = special_value(rng);
                let d = format!("insert {at}.{k} = {x}");
                m.insert(k, x);
                d
            }
            Value::Array(a) if !a.is_empty() => {
                let i = rng.below(a.len());
                let x = a[i].clone();
                a.insert(i, x);
                format!("duplicate {at}[{i}]")
            }
            _ => {
                let x = std::mem::take(node);
                *node = Value::Array(vec![x]);
                format!("wrap {at} in a list")
            }
        },
        7 => match node {
            Value::Object(m) if !m.is_empty() => {
                let k = random_key(rng, m);
                let x = m.remove(&k).unwrap_or_default();
                let nk = format!("{k}_");
                m.insert(nk, x);
                format!("rename {at}.{k}")
            }
            _ => {
                *node = Value::from(node.to_string());
                format!("{at} as a string")
            }
        },
        8 => {
            let x = std::mem::take(node);
            *node = match x {
                Value::Array(a) => a.into_iter().next().unwrap_or(Value::Null),
                Value::Object(m) => m.into_iter().next().map(|(_, x)| x).unwrap_or(Value::Null),
                other => Value::Array(vec![other]),
            };
            format!("unwrap/wrap {at}")
        }
        _ => {
            let x = special_value(rng);
            let d = format!("{at} = {x}");
            *node = x;
            d
        }
    }
}

/// Tokens that are not JSON numbers, or are numbers no parser should take at face value.
pub const BAD_NUMBERS: &[&str] = &[
    "NaN",
    "Infinity",
    "-Infinity",
    "1e999",
    "-1e999",
    "1e-999",
    "0x10",
    "01",
    "+1",
    "1.",
    "-",
    "18446744073709551616",
    "-9223372036854775809",
    "1e19",
    "\"1\"",
];

/// One byte- or token-level mutation of `text`. Returns what it did.
pub fn mutate_text(rng: &mut Rng, text: &mut Vec<u8>) -> String {
    if text.is_empty() {
        text.extend_from_slice(rng.pick(BAD_NUMBERS).as_bytes());
        return "empty -> bad number".into();
    }
    let n = text.len();
    match rng.below(8) {
        0 => {
            let i = rng.below(n);
            let bit = rng.below(8);
            text[i] ^= 1 << bit;
            format!("flip bit {bit} of byte {i}")
        }
        1 => {
            let i = rng.below(n);
            text.truncate(i);
            format!("truncate to {i} bytes")
        }
        2 => {
            let i = rng.below(n);
            let len = 1 + rng.below((n - i).min(16));
            text.drain(i..i + len);
            format!("delete bytes {i}..{}", i + len)
        }
        3 => {
            let i = rng.below(n);
            let len = 1 + rng.below((n - i).min(64));
            let chunk = text[i..i + len].to_vec();
            let j = rng.below(n + 1);
            text.splice(j..j, chunk);
            format!("copy bytes {i}..{} to {j}", i + len)
        }
        4 | 5 => {
            // Replace a number token.
            let starts: Vec<usize> = (0..n)
                .filter(|&i| {
                    (text[i].is_ascii_digit() || text[i] == b'-')
                        && (i == 0 || !(text[i - 1].is_ascii_alphanumeric() || text[i - 1] == b'.'))
                })
                .collect();
            if starts.is_empty() {
                let i = rng.below(n);
                text[i] = b'0';
                return format!("byte {i} = '0'");
            }
            let s = *rng.pick(&starts);
            let mut e = s + 1;
            while e < n && (text[e].is_ascii_digit() || b".eE+-".contains(&text[e])) {
                e += 1;
            }
            let bad = rng.pick(BAD_NUMBERS);
            text.splice(s..e, bad.bytes());
            format!("number at byte {s} -> {bad}")
        }
        6 => {
            let i = rng.below(n + 1);
            let junk: &[&[u8]] = &[
                b"\0",
                b"\xff\xfe",
                b"{",
                b"]",
                b",",
                b"\"",
                b"\n",
                b"=",
                b"#",
            ];
            let j = rng.pick(junk);
            text.splice(i..i, j.iter().copied());
            format!("insert {:?} at byte {i}", String::from_utf8_lossy(j))
        }
        _ => {
            let i = rng.below(n);
            text[i] = rng.next_u64() as u8;
            format!("byte {i} = random")
        }
    }
}

/// `{"k": x, ...rest}` with `"k": x` put first again: a duplicated top-level key (serde_json's
/// `Value` keeps the last, typed parsers refuse).
pub fn duplicate_key(rng: &mut Rng, v: &Value) -> Option<(String, String)> {
    let m = v.as_object()?;
    if m.is_empty() {
        return None;
    }
    let k = m.keys().nth(rng.below(m.len()))?.clone();
    let x = special_value(rng);
    let body = serde_json::to_string(v).ok()?;
    let text = format!("{{{}:{x},{}", serde_json::to_string(&k).ok()?, &body[1..]);
    Some((text, format!("duplicate key {k} (first = {x})")))
}

/// One line-level mutation of a `key = value` text (TOML): a value replaced by a bad one, a
/// line deleted or duplicated (a duplicated key), a table header renamed. Returns what it did.
pub fn mutate_lines(rng: &mut Rng, text: &str) -> (String, String) {
    let lines: Vec<&str> = text.lines().collect();
    if lines.is_empty() {
        return (text.to_string(), "noop".into());
    }
    let i = rng.below(lines.len());
    let mut out: Vec<String> = lines.iter().map(|s| s.to_string()).collect();
    let how;
    const VALUES: &[&str] = &[
        "0",
        "-1",
        "nan",
        "inf",
        "-inf",
        "1e308",
        "1e-320",
        "-0.0",
        "1.5",
        "4294967296",
        "18446744073709551615",
        "\"x\"",
        "\"\"",
        "true",
        "[]",
        "{}",
        "0.0",
        "2.0",
    ];
    match rng.below(6) {
        0..=2 => {
            // `value = X` inside an inline table, or `key = X`.
            let line = &lines[i];
            if let Some(p) = line.find("value = ") {
                let rest = &line[p + 8..];
                let end = rest.find(',').unwrap_or(rest.len());
                let v = rng.pick(VALUES);
                out[i] = format!("{}value = {v}{}", &line[..p], &rest[end..]);
                how = format!("line {} value = {v}", i + 1);
            } else if let Some(p) = line.find(" = ") {
                let v = rng.pick(VALUES);
                out[i] = format!("{} = {v}", &line[..p]);
                how = format!("line {} = {v}", i + 1);
            } else {
                out[i] = format!("{line} = 1");
                how = format!("line {} gets ` = 1`", i + 1);
            }
        }
        3 => {
            out.remove(i);
            how = format!("delete line {}", i + 1);
        }
        4 => {
            let l = out[i].clone();
            out.insert(i, l);
            how = format!("duplicate line {}", i + 1);
        }
        _ => {
            if let Some(p) = lines[i].find("source = ") {
                out[i] = format!("{}source = \"\" }}", &lines[i][..p]);
                how = format!("line {} source = \"\"", i + 1);
            } else {
                out[i] = format!("[{}]", lines[i].trim_matches(['[', ']']));
                how = format!("line {} as a table header", i + 1);
            }
        }
    }
    (out.join("\n") + "\n", how)
}

/// Every object key in `v`, recursively.
pub fn all_keys(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                out.push(k.clone());
                all_keys(x, out);
            }
        }
        Value::Array(a) => a.iter().for_each(|x| all_keys(x, out)),
        _ => {}
    }
}

/// A fresh directory under the test target's tmp dir, removed when dropped.
pub struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A fresh scratch directory for `name`.
pub fn scratch(name: &str) -> Scratch {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("fuzz")
        .join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("creating a scratch dir");
    Scratch(d)
}

/// The path as a string.
pub fn s(p: &Path) -> String {
    p.to_string_lossy().to_string()
}
