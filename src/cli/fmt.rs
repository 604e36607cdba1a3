//! Number formatting for reports.

use shardc::compiler::model::scale_to_unit;

/// `1234567` → `1,234,567`.
pub fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Bytes with a binary unit (`1.50 GiB`).
pub fn bytes(n: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let (x, u) = scale_to_unit(n as f64, 1024.0, units.len());
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{x:.2} {}", units[u])
    }
}

/// A count with an SI unit (`16.1 G`).
pub fn si(x: f64) -> String {
    let units = ["", "K", "M", "G", "T", "P", "E"];
    let (x, u) = scale_to_unit(x, 1000.0, units.len());
    format!("{x:.2} {}", units[u])
}
