//! The one place the CLI writes to the terminal. A closed pipe (`gpuhub usage | head`) exits
//! quietly instead of panicking.
#![allow(clippy::print_stdout)]

use std::io::Write;

fn write_or_exit(s: &str) {
    let mut out = std::io::stdout().lock();
    if let Err(e) = out.write_all(s.as_bytes()).and_then(|_| out.flush())
        && e.kind() == std::io::ErrorKind::BrokenPipe
    {
        std::process::exit(0);
    }
}

/// One line to stdout.
pub fn line(s: &str) {
    write_or_exit(&format!("{s}\n"));
}

/// Pretty JSON to stdout.
pub fn json(v: &serde_json::Value) {
    write_or_exit(&format!("{}\n", serde_json::to_string_pretty(v).unwrap_or_default()));
}

/// `gpuhub: error: ...` to stderr.
pub fn error(msg: &str) {
    eprintln!("gpuhub: error: {msg}");
}

/// A table with a header row; columns padded to their widest cell. Cells are sanitized.
pub fn table(header: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    let rows: Vec<Vec<String>> = rows.iter().map(|r| r.iter().map(|c| crate::util::sanitize(c)).collect()).collect();
    for r in &rows {
        for (i, c) in r.iter().enumerate() {
            if i < widths.len() {
                widths[i] = widths[i].max(c.chars().count());
            }
        }
    }
    let fmt = |cells: Vec<String>| {
        cells
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{:<w$}", c, w = widths.get(i).copied().unwrap_or(0)))
            .collect::<Vec<_>>()
            .join("  ")
            .trim_end()
            .to_string()
    };
    let mut s = fmt(header.iter().map(|h| h.to_string()).collect());
    s.push('\n');
    for r in rows {
        s.push_str(&fmt(r));
        s.push('\n');
    }
    write_or_exit(&s);
}
