//! Reading and writing plan files: JSON syntax, format version, field types named by path,
//! then the structural verifier, then the content hash.
//!
//! The hash is BLAKE3 over the canonical JSON of the plan without its `hash` field: object
//! keys sorted, no whitespace, numbers and strings as serde_json prints them. Both sides hash
//! the *parsed* text (the writer parses what it serialised), so the hash does not depend on
//! formatting, key order or how a float was spelled.

use super::{Plan, PlanError, PLAN_FORMAT_VERSION};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The top-level key holding the content hash.
const HASH_FIELD: &str = "hash";

/// The content hash of a plan's JSON value (`blake3:` and 64 hex digits): over the canonical
/// JSON of `v` without its top-level `hash` field.
pub fn content_hash(v: &Value) -> String {
    let mut h = blake3::Hasher::new();
    match v {
        Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().filter(|k| *k != HASH_FIELD).collect();
            keys.sort();
            h.update(b"{");
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    h.update(b",");
                }
                write_canonical(&Value::String(k.clone()), &mut h);
                h.update(b":");
                write_canonical(&m[k], &mut h);
            }
            h.update(b"}");
        }
        other => write_canonical(other, &mut h),
    }
    format!("blake3:{}", h.finalize().to_hex())
}

fn write_canonical(v: &Value, h: &mut blake3::Hasher) {
    match v {
        Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            h.update(b"{");
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    h.update(b",");
                }
                h.update(
                    serde_json::to_string(k)
                        .expect("invariant: a string serialises")
                        .as_bytes(),
                );
                h.update(b":");
                write_canonical(&m[k], h);
            }
            h.update(b"}");
        }
        Value::Array(a) => {
            h.update(b"[");
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    h.update(b",");
                }
                write_canonical(x, h);
            }
            h.update(b"]");
        }
        Value::String(s) => {
            h.update(
                serde_json::to_string(s)
                    .expect("invariant: a string serialises")
                    .as_bytes(),
            );
        }
        Value::Number(n) => {
            h.update(n.to_string().as_bytes());
        }
        Value::Bool(b) => {
            h.update(if *b { b"true" } else { b"false" });
        }
        Value::Null => {
            h.update(b"null");
        }
    }
}

/// The plan as written: its fields, then `hash`.
#[derive(Serialize)]
struct Stamped<'a> {
    #[serde(flatten)]
    plan: &'a Plan,
    hash: &'a str,
}

/// Pretty JSON of `plan` with its content hash.
pub(super) fn stamp(plan: &Plan) -> String {
    let body = serde_json::to_string(plan).expect("invariant: a plan serialises");
    let v: Value = serde_json::from_str(&body).expect("invariant: a serialised plan parses");
    let hash = content_hash(&v);
    serde_json::to_string_pretty(&Stamped { plan, hash: &hash })
        .expect("invariant: a plan serialises")
}

/// Recomputes and stores the content hash of plan JSON `text` (for tools and tests that edit
/// a plan on purpose and want the verifier, not the hash check, to judge the edit). The text
/// must be a JSON object; nothing else is checked.
pub fn rehash(text: &str) -> Result<String, PlanError> {
    let mut v = parse_value(text)?;
    let hash = content_hash(&v);
    let Value::Object(m) = &mut v else {
        return Err(PlanError::Json(format!(
            "the plan is a JSON {}, not an object",
            kind(&v)
        )));
    };
    m.insert(HASH_FIELD.into(), Value::String(hash));
    Ok(serde_json::to_string_pretty(&v).expect("invariant: a JSON value serialises"))
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

fn parse_value(text: &str) -> Result<Value, PlanError> {
    if text.trim().is_empty() {
        return Err(PlanError::Empty);
    }
    serde_json::from_str(text).map_err(|e| {
        if e.is_eof() {
            PlanError::Truncated {
                line: e.line(),
                column: e.column(),
            }
        } else {
            PlanError::Json(format!("not valid JSON: {}", super::esc(&e.to_string())))
        }
    })
}

/// Reads, type-checks, verifies and hash-checks a plan.
pub(super) fn parse(text: &str) -> Result<Plan, PlanError> {
    let v = parse_value(text)?;
    let Value::Object(m) = &v else {
        return Err(PlanError::Json(format!(
            "the plan is a JSON {}, not an object",
            kind(&v)
        )));
    };
    // A missing version reads as version 0 (no shardc plan has it).
    let found = match m.get("format_version") {
        None => 0,
        Some(x) => x.as_u64().ok_or_else(|| PlanError::Field {
            path: "format_version".into(),
            msg: format!("expected an integer, found a {}", kind(x)),
        })?,
    }
    .min(u32::MAX as u64) as u32;
    if found != PLAN_FORMAT_VERSION {
        return Err(PlanError::Version {
            found,
            expected: PLAN_FORMAT_VERSION,
        });
    }
    let recorded = match m.get(HASH_FIELD) {
        None => return Err(PlanError::MissingHash),
        Some(Value::String(s)) => s.clone(),
        Some(x) => {
            return Err(PlanError::Field {
                path: HASH_FIELD.into(),
                msg: format!("expected a string, found a {}", kind(x)),
            })
        }
    };
    let plan = Plan::deserialize(&v).map_err(|e| field_error(&v, &e))?;
    plan.verify()?;
    let found = content_hash(&v);
    if recorded != found {
        return Err(PlanError::HashMismatch {
            expected: shorten(&recorded),
            found,
        });
    }
    Ok(plan)
}

/// At most 80 characters of a recorded value, escaped.
fn shorten(s: &str) -> String {
    let s = super::esc(s);
    match s.char_indices().nth(80) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s,
    }
}

/// Names the path of a deserialisation error: the first top-level field that fails, and
/// inside the large ones the first failing element.
fn field_error(v: &Value, whole: &serde_json::Error) -> PlanError {
    use super::{PlanChunk, PlanMemory, PlanModel};
    use crate::ir::{Graph, Node, ValueId};
    use crate::schedule::pp::{PipeOp, PipelineSchedule};
    use crate::schedule::{BufferSlot, Step};
    use crate::shard::{Mesh, Provenance, TensorSharding};
    use std::collections::BTreeMap;

    fn check<T: DeserializeOwned>(x: &Value) -> Result<(), String> {
        T::deserialize(x)
            .map(|_| ())
            .map_err(|e| super::esc(&e.to_string()))
    }
    /// `path[i]: msg` for the first element of array `x` that is not a `T`, else the whole.
    fn each<T: DeserializeOwned>(x: &Value, path: &str) -> Option<(String, String)> {
        if let Value::Array(a) = x {
            for (i, e) in a.iter().enumerate() {
                if let Err(m) = check::<T>(e) {
                    return Some((format!("{path}[{i}]"), m));
                }
            }
        }
        check::<Vec<T>>(x).err().map(|m| (path.to_string(), m))
    }
    fn graph(x: &Value, path: &str) -> Option<(String, String)> {
        if let Some(n) = x.get("nodes") {
            if let Some(e) = each::<Node>(n, &format!("{path}.nodes")) {
                return Some(e);
            }
        }
        check::<Graph>(x).err().map(|m| (path.to_string(), m))
    }
    fn nested<T: DeserializeOwned>(x: &Value, path: &str) -> Option<(String, String)> {
        if let Value::Array(a) = x {
            for (i, e) in a.iter().enumerate() {
                if let Some(r) = each::<T>(e, &format!("{path}[{i}]")) {
                    return Some(r);
                }
            }
        }
        None
    }

    type Finder = fn(&Value, &str) -> Option<(String, String)>;
    let fields: [(&str, bool, Finder); 17] = [
        ("format_version", true, |x, p| {
            check::<u32>(x).err().map(|m| (p.into(), m))
        }),
        ("model", true, |x, p| {
            check::<PlanModel>(x).err().map(|m| (p.into(), m))
        }),
        ("mesh", true, |x, p| {
            if let Some(a) = x.get("axes") {
                if let Some(e) = each::<crate::shard::MeshAxis>(a, &format!("{p}.axes")) {
                    return Some(e);
                }
            }
            check::<Mesh>(x).err().map(|m| (p.into(), m))
        }),
        ("strategies", true, |x, p| each::<String>(x, p)),
        ("program", true, graph),
        ("shardings", true, |x, p| each::<TensorSharding>(x, p)),
        ("provenance", true, |x, p| {
            check::<BTreeMap<u32, Provenance>>(x)
                .err()
                .map(|m| (p.into(), m))
        }),
        ("streams", true, |x, p| each::<String>(x, p)),
        ("steps", true, |x, p| each::<Step>(x, p)),
        ("buffers", true, |x, p| each::<BufferSlot>(x, p)),
        ("memory", true, |x, p| {
            check::<PlanMemory>(x).err().map(|m| (p.into(), m))
        }),
        ("pipeline", false, |x, p| {
            check::<Option<PipelineSchedule>>(x)
                .err()
                .map(|m| (p.into(), m))
        }),
        ("pipeline_program", false, |x, p| {
            nested::<PipeOp>(x, p)
                .or_else(|| check::<Vec<Vec<PipeOp>>>(x).err().map(|m| (p.into(), m)))
        }),
        ("pipeline_nodes", false, |x, p| {
            if let Value::Array(a) = x {
                for (r, e) in a.iter().enumerate() {
                    if let Some(f) = nested::<ValueId>(e, &format!("{p}[{r}]")) {
                        return Some(f);
                    }
                }
            }
            check::<Vec<Vec<Vec<ValueId>>>>(x)
                .err()
                .map(|m| (p.into(), m))
        }),
        ("chunks", false, |x, p| {
            if let Value::Array(a) = x {
                for (i, c) in a.iter().enumerate() {
                    if let Some(g) = c.get("program") {
                        if let Some(e) = graph(g, &format!("{p}[{i}].program")) {
                            return Some(e);
                        }
                    }
                    if let Some(s) = c.get("shardings") {
                        if let Some(e) = each::<TensorSharding>(s, &format!("{p}[{i}].shardings")) {
                            return Some(e);
                        }
                    }
                }
            }
            each::<PlanChunk>(x, p)
        }),
        ("comm", false, |x, p| {
            check::<Option<super::CommVolume>>(x)
                .err()
                .map(|m| (p.into(), m))
        }),
        ("train", false, |x, p| {
            if let Some(ps) = x.get("params") {
                if let Some(e) = each::<super::PlanParam>(ps, &format!("{p}.params")) {
                    return Some(e);
                }
            }
            check::<Option<super::PlanTrain>>(x)
                .err()
                .map(|m| (p.into(), m))
        }),
    ];
    for (name, required, find) in fields {
        match v.get(name) {
            None if required => {
                return PlanError::Field {
                    path: name.into(),
                    msg: "missing".into(),
                }
            }
            None => {}
            Some(x) => {
                if let Some((path, msg)) = find(x, name) {
                    return PlanError::Field { path, msg };
                }
            }
        }
    }
    if let Some(x) = v.get("rewrite") {
        if let Err(msg) = check::<Option<crate::rewrite::RewriteReport>>(x) {
            return PlanError::Field {
                path: "rewrite".into(),
                msg,
            };
        }
    }
    PlanError::Json(super::esc(&whole.to_string()))
}
