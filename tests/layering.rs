//! The layers the design promises: no import cycle between the files of a crate, nor between
//! its top-level modules. An edge is a `crate::a::b` or `super::x` path in a file (doc links
//! included; test files (`tests.rs`, `*_tests.rs`) and inline `mod tests` left out), resolved to the deepest module
//! file that exists.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const CRATES: [&str; 4] = ["compiler/src", "runtime/src", "kernels/src", "src"];

/// The module path of a file under `base`: `a/b.rs` and `a/b/mod.rs` are `[a, b]`.
fn module_of(base: &Path, file: &Path) -> Vec<String> {
    let rel = file
        .strip_prefix(base)
        .expect("under base")
        .with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        parts.pop();
    }
    parts
}

/// The file of the deepest existing module along `path`.
fn file_of(base: &Path, path: &[String]) -> Option<PathBuf> {
    (1..=path.len()).rev().find_map(|i| {
        let p = path[..i].iter().fold(base.to_path_buf(), |p, s| p.join(s));
        [p.with_extension("rs"), p.join("mod.rs")]
            .into_iter()
            .find(|f| f.is_file())
    })
}

/// The `crate::…` and `super::…` paths in `src`, as (kind, identifier segments).
fn paths(src: &str) -> Vec<(&'static str, Vec<String>)> {
    let mut out = Vec::new();
    for kind in ["crate", "super"] {
        let pat = format!("{kind}::");
        let mut at = 0;
        while let Some(i) = src[at..].find(&pat) {
            let start = at + i;
            at = start + pat.len();
            let before = src[..start].chars().next_back();
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                continue;
            }
            let mut segs = Vec::new();
            let mut rest = &src[at..];
            loop {
                let id: String = rest
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                if id.is_empty() {
                    break;
                }
                rest = &rest[id.len()..];
                segs.push(id);
                match rest.strip_prefix("::") {
                    Some(r) => rest = r,
                    None => break,
                }
            }
            out.push((kind, segs));
        }
    }
    out
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).expect("readable source dir") {
        let p = e.expect("entry").path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs")
            && !p.to_string_lossy().ends_with("tests.rs")
        {
            out.push(p);
        }
    }
}

/// File → files it names, for one crate.
fn edges(base: &Path) -> BTreeMap<PathBuf, BTreeSet<PathBuf>> {
    let mut files = Vec::new();
    rust_files(base, &mut files);
    let mut g = BTreeMap::new();
    for f in files {
        let text = std::fs::read_to_string(&f).expect("readable");
        let text = match text.find("#[cfg(test)]\nmod tests {") {
            Some(i) => &text[..i],
            None => &text[..],
        };
        let me = module_of(base, &f);
        let own = f
            .file_name()
            .is_some_and(|n| n == "mod.rs" || n == "lib.rs");
        let parent: Vec<String> = if own || me.is_empty() {
            me[..me.len().saturating_sub(1)].to_vec()
        } else {
            me[..me.len() - 1].to_vec()
        };
        let mut deps = BTreeSet::new();
        for (kind, segs) in paths(text) {
            let full: Vec<String> = if kind == "crate" {
                segs
            } else {
                parent.iter().cloned().chain(segs).collect()
            };
            if let Some(t) = file_of(base, &full).filter(|t| *t != f) {
                deps.insert(t);
            }
        }
        g.insert(f, deps);
    }
    g
}

/// The strongly connected components of more than one node (Tarjan).
fn cycles<N: Ord + Clone>(g: &BTreeMap<N, BTreeSet<N>>) -> Vec<Vec<N>> {
    struct T<'a, N> {
        g: &'a BTreeMap<N, BTreeSet<N>>,
        index: BTreeMap<N, usize>,
        low: BTreeMap<N, usize>,
        stack: Vec<N>,
        on: BTreeSet<N>,
        out: Vec<Vec<N>>,
    }
    fn visit<N: Ord + Clone>(t: &mut T<'_, N>, v: &N) {
        let i = t.index.len();
        t.index.insert(v.clone(), i);
        t.low.insert(v.clone(), i);
        t.stack.push(v.clone());
        t.on.insert(v.clone());
        for w in t.g.get(v).into_iter().flatten() {
            if !t.index.contains_key(w) {
                visit(t, w);
                let lw = t.low[w];
                let lv = t.low.get_mut(v).expect("visited");
                *lv = (*lv).min(lw);
            } else if t.on.contains(w) {
                let iw = t.index[w];
                let lv = t.low.get_mut(v).expect("visited");
                *lv = (*lv).min(iw);
            }
        }
        if t.low[v] == t.index[v] {
            let mut comp = Vec::new();
            loop {
                let w = t.stack.pop().expect("on the stack");
                t.on.remove(&w);
                let done = w == *v;
                comp.push(w);
                if done {
                    break;
                }
            }
            if comp.len() > 1 {
                t.out.push(comp);
            }
        }
    }
    let mut t = T {
        g,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in g.keys() {
        if !t.index.contains_key(v) {
            visit(&mut t, v);
        }
    }
    t.out
}

#[test]
fn no_import_cycles_between_files_or_top_level_modules() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut found = Vec::new();
    for c in CRATES {
        let base = root.join(c);
        let g = edges(&base);
        for comp in cycles(&g) {
            let names: Vec<String> = comp
                .iter()
                .map(|f| f.strip_prefix(root).unwrap_or(f).display().to_string())
                .collect();
            found.push(format!("files: {}", names.join(" ↔ ")));
        }
        let top = |f: &PathBuf| module_of(&base, f).first().cloned().unwrap_or_default();
        let mut tg: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (f, deps) in &g {
            for d in deps {
                let (a, b) = (top(f), top(d));
                if a != b && !a.is_empty() && !b.is_empty() {
                    tg.entry(a).or_default().insert(b);
                }
            }
        }
        for comp in cycles(&tg) {
            found.push(format!("modules of {c}: {}", comp.join(" ↔ ")));
        }
    }
    assert!(found.is_empty(), "import cycles:\n{}", found.join("\n"));
}

/// The checker itself: a cycle is found, a chain is not.
#[test]
fn the_cycle_finder_finds_cycles() {
    let g: BTreeMap<u32, BTreeSet<u32>> = BTreeMap::from([
        (1, BTreeSet::from([2])),
        (2, BTreeSet::from([3])),
        (3, BTreeSet::from([1])),
        (4, BTreeSet::from([1])),
    ]);
    let c = cycles(&g);
    assert_eq!(c.len(), 1);
    assert_eq!(
        c[0].iter().copied().collect::<BTreeSet<_>>(),
        BTreeSet::from([1, 2, 3])
    );
    let chain: BTreeMap<u32, BTreeSet<u32>> =
        BTreeMap::from([(1, BTreeSet::from([2])), (2, BTreeSet::from([3]))]);
    assert!(cycles(&chain).is_empty());
    let p = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(
        paths("use crate::plan::{Plan}; super::esc(x); xcrate::no; crate::a::b::C"),
        vec![
            ("crate", p(&["plan"])),
            ("crate", p(&["a", "b", "C"])),
            ("super", p(&["esc"]))
        ]
    );
}
