//! Validated SQL identifiers.
//!
//! Table and column names cannot be bound as statement parameters, so idemq pastes them into
//! SQL text. Only names matching `[A-Za-z_][A-Za-z0-9_]{0,62}` are accepted: that excludes
//! quotes, spaces, semicolons, comments and every other way to smuggle SQL in, and fits the
//! identifier limits of PostgreSQL (63 bytes), MySQL/MariaDB (64) and SQLite.
//!
//! Names are emitted unquoted, so they follow each database's usual rules: PostgreSQL folds
//! them to lower case, and a reserved word (`order`, `user`) is rejected by the database with
//! a syntax error. Use the name exactly as your own DDL created the table.

use idemq_core::StoreError;
use std::fmt;
use std::str::FromStr;

/// The longest identifier accepted, in bytes (PostgreSQL's limit).
pub const MAX_IDENT_LEN: usize = 63;

/// A validated SQL identifier (table or column name): `[A-Za-z_][A-Za-z0-9_]{0,62}`.
///
/// ```
/// use idemq_sql::TableName;
/// assert_eq!(TableName::new("payments_dedup").unwrap().as_str(), "payments_dedup");
/// assert!(TableName::new("t; DROP TABLE x").is_err());
/// assert!(TableName::new("1abc").is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ident(String);

/// A validated table name (see [`Ident`]).
pub type TableName = Ident;

/// A validated column name (see [`Ident`]).
pub type ColumnName = Ident;

/// The default dedup table: `idemq_dedup`.
pub const DEFAULT_TABLE: &str = "idemq_dedup";

impl Ident {
    /// Validates `name`; anything but `[A-Za-z_][A-Za-z0-9_]{0,62}` is a
    /// [`StoreError::Config`] naming the offending input.
    pub fn new(name: &str) -> Result<Self, StoreError> {
        if is_valid_ident(name) {
            Ok(Self(name.to_owned()))
        } else {
            Err(StoreError::Config(format!(
                "invalid SQL identifier {}: use 1 to {MAX_IDENT_LEN} characters from \
                 A-Z a-z 0-9 _, not starting with a digit (e.g. `idemq_dedup`)",
                describe(name)
            )))
        }
    }

    /// The name as written.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// This name with `suffix` appended, validated again (it may become too long).
    pub fn with_suffix(&self, suffix: &str) -> Result<Self, StoreError> {
        Self::new(&format!("{}{suffix}", self.0))
    }
}

impl Default for Ident {
    /// `idemq_dedup`, the default dedup table.
    fn default() -> Self {
        Self(DEFAULT_TABLE.to_owned())
    }
}

impl fmt::Display for Ident {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for Ident {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl FromStr for Ident {
    type Err = StoreError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

impl TryFrom<&str> for Ident {
    type Error = StoreError;
    fn try_from(s: &str) -> Result<Self, Self::Error> {
        Self::new(s)
    }
}

/// Whether `name` matches `[A-Za-z_][A-Za-z0-9_]{0,62}`.
pub fn is_valid_ident(name: &str) -> bool {
    let b = name.as_bytes();
    !b.is_empty()
        && b.len() <= MAX_IDENT_LEN
        && (b[0].is_ascii_alphabetic() || b[0] == b'_')
        && b.iter().all(|c| c.is_ascii_alphanumeric() || *c == b'_')
}

/// Quotes a rejected name for an error message, bounded and with control characters escaped.
fn describe(name: &str) -> String {
    if name.is_empty() {
        return "`` (empty)".to_owned();
    }
    let shown: String = name.chars().take(80).collect();
    let more = if shown.len() < name.len() { "…" } else { "" };
    format!("`{}{more}` ({} bytes)", shown.escape_debug(), name.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_plain_identifiers() {
        for ok in ["a", "_", "idemq_dedup", "T1", "_x9", &"a".repeat(63)] {
            assert!(Ident::new(ok).is_ok(), "{ok}");
        }
    }

    #[test]
    fn rejects_hostile_and_malformed_names() {
        for bad in [
            "",
            "1abc",
            "t; DROP TABLE x",
            "t--",
            "a b",
            "a\"b",
            "a`b",
            "a'b",
            "a.b",
            "a-b",
            "tablé",
            "x\0",
            "/*",
            &"a".repeat(64),
        ] {
            let err = Ident::new(bad).expect_err(bad);
            assert!(matches!(err, StoreError::Config(_)), "{bad}: {err:?}");
            assert!(err.to_string().contains("invalid SQL identifier"), "{err}");
        }
        let msg = Ident::new("t; DROP TABLE x").unwrap_err().to_string();
        assert!(msg.contains("`t; DROP TABLE x`"), "{msg}");
    }

    #[test]
    fn suffix_is_revalidated() {
        let t = Ident::new(&"a".repeat(60)).unwrap();
        assert!(t.with_suffix("_keys").is_err());
        assert_eq!(
            Ident::default().with_suffix("_keys").unwrap().as_str(),
            "idemq_dedup_keys"
        );
    }
}
