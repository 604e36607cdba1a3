//! Turning an NVRTC log into a numbered excerpt of the offending source lines.
//!
//! NVRTC reports errors as `NAME(LINE): error: message` (also `catastrophic error`), where
//! `LINE` counts lines of the exact text that was compiled, from 1. The excerpt shows, for each
//! distinct error line (at most [`MAX_ERRORS`]), [`CONTEXT_LINES`] lines either side, with the
//! offending line marked by `>`.

use std::fmt::Write as _;

/// Errors shown in an excerpt; further ones are counted.
pub const MAX_ERRORS: usize = 5;
/// Lines of context either side of an error line.
pub const CONTEXT_LINES: usize = 2;

/// One `NAME(LINE): error: message` diagnostic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diagnostic<'a> {
    /// The file name NVRTC printed (the program name).
    pub file: &'a str,
    /// 1-based line in the compiled text.
    pub line: usize,
    /// Text after `error: `.
    pub message: &'a str,
}

/// The error diagnostics of an NVRTC log, in log order (warnings are skipped).
pub fn parse_diagnostics(log: &str) -> Vec<Diagnostic<'_>> {
    log.lines().filter_map(parse_line).collect()
}

fn parse_line(line: &str) -> Option<Diagnostic<'_>> {
    let close = line.find("): ")?;
    let open = line[..close].rfind('(')?;
    let number = &line[open + 1..close];
    if number.is_empty() || !number.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let rest = &line[close + 3..];
    let message = rest
        .strip_prefix("error: ")
        .or_else(|| rest.strip_prefix("catastrophic error: "))?;
    Some(Diagnostic {
        file: &line[..open],
        line: number.parse().ok()?,
        message,
    })
}

/// The numbered excerpt of `src` for the errors in `log`. When the log names no line (a bad
/// option, for instance) the excerpt says so and the caller still has the full log.
pub fn source_excerpt(src: &str, log: &str) -> String {
    let diags = parse_diagnostics(log);
    if diags.is_empty() {
        return "(the NVRTC log names no source line)".to_owned();
    }
    let lines: Vec<&str> = src.lines().collect();
    let width = lines.len().max(1).to_string().len();
    let mut out = String::new();
    let mut shown: Vec<usize> = Vec::new();
    for d in &diags {
        if shown.contains(&d.line) {
            continue;
        }
        if shown.len() == MAX_ERRORS {
            let more = diags.iter().filter(|x| !shown.contains(&x.line)).count();
            let _ = writeln!(out, "... and {more} more error(s)");
            break;
        }
        shown.push(d.line);
        let _ = writeln!(out, "{}:{}: error: {}", d.file, d.line, d.message);
        let first = d.line.saturating_sub(CONTEXT_LINES).max(1);
        let last = (d.line + CONTEXT_LINES).min(lines.len());
        for n in first..=last {
            let mark = if n == d.line { '>' } else { ' ' };
            let _ = writeln!(out, "{mark} {n:>width$} | {}", lines[n - 1]);
        }
        if d.line > lines.len() {
            let _ = writeln!(out, "  (line {} is past the end of the source)", d.line);
        }
    }
    out.truncate(out.trim_end().len());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const SRC: &str =
        "line one\nline two\nline three\nline four\nline five\nline six\nline seven\n";

    #[test]
    fn parses_nvrtc_lines() {
        let log = "norm.cu(4): error: identifier \"undefined_fn\" is undefined\n\
                   \n\
                   norm.cu(2): warning #177-D: variable \"x\" was declared but never referenced\n\
                   x.cu(1): catastrophic error: could not open source file \"cuda_bf16.h\"\n\
                   2 errors detected in the compilation of \"norm.cu\".\n";
        let d = parse_diagnostics(log);
        assert_eq!(
            d,
            vec![
                Diagnostic {
                    file: "norm.cu",
                    line: 4,
                    message: "identifier \"undefined_fn\" is undefined"
                },
                Diagnostic {
                    file: "x.cu",
                    line: 1,
                    message: "could not open source file \"cuda_bf16.h\""
                },
            ]
        );
    }

    #[test]
    fn excerpt_format() {
        let log =
            "k.cu(4): error: bad thing\nk.cu(4): error: same line again\nk.cu(7): error: end\n";
        let expected = "\
k.cu:4: error: bad thing
  2 | line two
  3 | line three
> 4 | line four
  5 | line five
  6 | line six
k.cu:7: error: end
  5 | line five
  6 | line six
> 7 | line seven";
        assert_eq!(source_excerpt(SRC, log), expected);
    }

    #[test]
    fn excerpt_at_file_start_and_past_end() {
        let log = "k.cu(1): error: first\nk.cu(99): error: beyond\n";
        let expected = "\
k.cu:1: error: first
> 1 | line one
  2 | line two
  3 | line three
k.cu:99: error: beyond
  (line 99 is past the end of the source)";
        assert_eq!(source_excerpt(SRC, log), expected);
    }

    #[test]
    fn excerpt_caps_error_count() {
        let log: String = (1..=7)
            .map(|l| format!("k.cu({l}): error: e{l}\n"))
            .collect();
        let ex = source_excerpt(SRC, &log);
        assert!(ex.ends_with("... and 2 more error(s)"), "{ex}");
        assert_eq!(ex.matches(": error: ").count(), MAX_ERRORS);
    }

    #[test]
    fn excerpt_without_line_numbers() {
        let log = "nvrtc error: invalid option --bogus\n";
        assert_eq!(
            source_excerpt(SRC, log),
            "(the NVRTC log names no source line)"
        );
    }
}
