//! Bounds on the strings that come from Slurm or from a user and end up in a usage record, a
//! job token, a label or a log line: a length cap and no control characters.
//!
//! A value that breaks a bound is *refused*, never truncated or written raw: the caller records
//! the field as unknown and logs the [`Refusal`] (which describes the value without quoting it).
//! The plugin applies these to everything it reads from a hook's environment; the agent may
//! apply the same to what it ingests.

use std::fmt;

/// Cap for user names (the same as a token's user field).
pub const MAX_USER_BYTES: usize = crate::token::MAX_USER_BYTES;

/// Cap for every other field: account, partition, node, GPU lists, exit codes, counts.
pub const MAX_FIELD_BYTES: usize = 256;

/// Why a value was refused. Its `Display` never contains the value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// Longer than the cap, in bytes.
    TooLong { len: usize, cap: usize },
    /// Holds a control character (or a line/paragraph separator) at this byte offset.
    Control { at: usize },
    /// Was not valid UTF-8 (a replacement character at this byte offset after lossy decoding).
    NotUtf8 { at: usize },
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::TooLong { len, cap } => write!(f, "is {len} bytes long, over the {cap}-byte limit"),
            Refusal::Control { at } => write!(f, "holds a control character at byte {at}"),
            Refusal::NotUtf8 { at } => write!(f, "is not valid UTF-8 (at byte {at})"),
        }
    }
}

impl std::error::Error for Refusal {}

/// Checks `value` against `cap` bytes and the character rules.
pub fn check(value: &str, cap: usize) -> Result<(), Refusal> {
    if value.len() > cap {
        return Err(Refusal::TooLong { len: value.len(), cap });
    }
    for (at, c) in value.char_indices() {
        if c.is_control() || c == '\u{2028}' || c == '\u{2029}' {
            return Err(Refusal::Control { at });
        }
        if c == char::REPLACEMENT_CHARACTER {
            return Err(Refusal::NotUtf8 { at });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_and_control_characters() {
        assert_eq!(check("alice", MAX_USER_BYTES), Ok(()));
        assert_eq!(check("john.doe", MAX_USER_BYTES), Ok(()));
        assert_eq!(check("", MAX_FIELD_BYTES), Ok(()));
        assert_eq!(check(&"a".repeat(64), MAX_USER_BYTES), Ok(()));
        assert_eq!(check(&"a".repeat(65), MAX_USER_BYTES), Err(Refusal::TooLong { len: 65, cap: 64 }));
        assert_eq!(check(&"x".repeat(100 * 1024), MAX_FIELD_BYTES), Err(Refusal::TooLong { len: 102_400, cap: 256 }));
        assert_eq!(check("gpu\nroot", MAX_FIELD_BYTES), Err(Refusal::Control { at: 3 }));
        assert_eq!(check("a\u{1b}[31m", MAX_FIELD_BYTES), Err(Refusal::Control { at: 1 }));
        assert_eq!(check("a\tb", MAX_FIELD_BYTES), Err(Refusal::Control { at: 1 }));
        assert_eq!(check("a\u{7f}", MAX_FIELD_BYTES), Err(Refusal::Control { at: 1 }));
        assert_eq!(check("a\u{85}", MAX_FIELD_BYTES), Err(Refusal::Control { at: 1 }));
        assert_eq!(check("a\u{2028}", MAX_FIELD_BYTES), Err(Refusal::Control { at: 1 }));
        assert_eq!(check("ab\u{fffd}", MAX_FIELD_BYTES), Err(Refusal::NotUtf8 { at: 2 }));
        let shown = check("secret\nvalue", MAX_FIELD_BYTES).unwrap_err().to_string();
        assert!(!shown.contains("secret"), "a refusal never quotes the value: {shown}");
    }
}
