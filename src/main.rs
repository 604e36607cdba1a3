//! The `shardc` command line. Argument parsing, progress and printing only; the work is done
//! by the library crates.

mod cli;

use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    // Die quietly on a closed pipe (`shardc explain plan.json | head`), like other Unix tools.
    #[cfg(unix)]
    // SAFETY: restoring the default SIGPIPE disposition before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let args = cli::Cli::parse();
    match cli::dispatch(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", one_line(&e));
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes on one line, each cause once: library errors often quote their
/// cause in their own message already.
fn one_line(e: &anyhow::Error) -> String {
    let mut msg = e.to_string();
    for cause in e.chain().skip(1) {
        let c = cause.to_string();
        if !msg.contains(&c) {
            msg.push_str(": ");
            msg.push_str(&c);
        }
    }
    msg.replace('\n', " ")
}
