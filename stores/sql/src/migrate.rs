//! Versioned schema migrations, one directory of plain `.sql` files per backend
//! (`stores/sql/migrations/<backend>/NNNN_name.sql`), embedded in the binary.
//!
//! The applied version is kept per dedup table in `idemq_schema_version`. Migrations run
//! under a lock (SQLite `BEGIN IMMEDIATE`, a PostgreSQL advisory lock, MySQL `GET_LOCK`) so
//! many processes starting at once apply each file exactly once. The placeholders `{table}`,
//! `{keys_table}`, `{fence_table}` and `{attempts_table}` are replaced by validated
//! identifiers only.

use crate::backend::{map_sqlx_error, Dialect, Kind, SqlBackend, Val};
use crate::ident::TableName;
use idemq_core::{now_ms, StoreError};
use sqlx::Pool;

/// The table recording which migration each dedup table is at.
pub const SCHEMA_VERSION_TABLE: &str = "idemq_schema_version";

/// One migration file.
#[derive(Debug, Clone, Copy)]
pub struct Migration {
    /// Applied in increasing order; never renumber a released one.
    pub version: i64,
    /// File name, for logs.
    pub name: &'static str,
    /// The SQL, with `{table}` / `{keys_table}` placeholders.
    pub sql: &'static str,
}

const SQLITE: &[Migration] = &[
    Migration {
        version: 1,
        name: "0001_dedup_table.sql",
        sql: include_str!("../migrations/sqlite/0001_dedup_table.sql"),
    },
    Migration {
        version: 2,
        name: "0002_attempts_table.sql",
        sql: include_str!("../migrations/sqlite/0002_attempts_table.sql"),
    },
    Migration {
        version: 3,
        name: "0003_terminal_expires_index.sql",
        sql: include_str!("../migrations/sqlite/0003_terminal_expires_index.sql"),
    },
];

const POSTGRES: &[Migration] = &[
    Migration {
        version: 1,
        name: "0001_dedup_table.sql",
        sql: include_str!("../migrations/postgres/0001_dedup_table.sql"),
    },
    Migration {
        version: 2,
        name: "0002_fence_table.sql",
        sql: include_str!("../migrations/postgres/0002_fence_table.sql"),
    },
    Migration {
        version: 3,
        name: "0003_attempts_table.sql",
        sql: include_str!("../migrations/postgres/0003_attempts_table.sql"),
    },
    Migration {
        version: 4,
        name: "0004_terminal_expires_index.sql",
        sql: include_str!("../migrations/postgres/0004_terminal_expires_index.sql"),
    },
];

const MYSQL: &[Migration] = &[
    Migration {
        version: 1,
        name: "0001_dedup_table.sql",
        sql: include_str!("../migrations/mysql/0001_dedup_table.sql"),
    },
    Migration {
        version: 2,
        name: "0002_fence_table.sql",
        sql: include_str!("../migrations/mysql/0002_fence_table.sql"),
    },
    Migration {
        version: 3,
        name: "0003_attempts_table.sql",
        sql: include_str!("../migrations/mysql/0003_attempts_table.sql"),
    },
];

const SQLITE_OUTBOX: &[Migration] = &[Migration {
    version: 1,
    name: "outbox/0001_outbox.sql",
    sql: include_str!("../migrations/sqlite/outbox/0001_outbox.sql"),
}];

const POSTGRES_OUTBOX: &[Migration] = &[Migration {
    version: 1,
    name: "outbox/0001_outbox.sql",
    sql: include_str!("../migrations/postgres/outbox/0001_outbox.sql"),
}];

const MYSQL_OUTBOX: &[Migration] = &[Migration {
    version: 1,
    name: "outbox/0001_outbox.sql",
    sql: include_str!("../migrations/mysql/outbox/0001_outbox.sql"),
}];

/// The outbox-table migrations of a dialect, in order (`migrations/<backend>/outbox/`),
/// tracked in [`SCHEMA_VERSION_TABLE`] under the outbox table's name.
pub fn outbox_migrations(dialect: Dialect) -> &'static [Migration] {
    match dialect {
        Dialect::Sqlite => SQLITE_OUTBOX,
        Dialect::Postgres => POSTGRES_OUTBOX,
        Dialect::MySql => MYSQL_OUTBOX,
    }
}

/// The migrations of a dialect, in order.
pub fn migrations(dialect: Dialect) -> &'static [Migration] {
    match dialect {
        Dialect::Sqlite => SQLITE,
        Dialect::Postgres => POSTGRES,
        Dialect::MySql => MYSQL,
    }
}

/// The newest schema version this build knows for `dialect`.
pub fn latest_version(dialect: Dialect) -> i64 {
    migrations(dialect).last().map_or(0, |m| m.version)
}

/// Substitutes the table names and splits a migration into statements (one per `;` at the
/// end of a line; `--` comment lines dropped).
pub fn render(sql: &str, table: &TableName, keys_table: &TableName) -> Vec<String> {
    render_with(sql, table, keys_table, &[])
}

/// [`render`], also substituting each `(placeholder, name)` of `extra`, e.g.
/// `("{fence_table}", …)` (a placeholder not given is left as is: a migration that names it
/// then fails, never touching another table).
pub fn render_with(
    sql: &str,
    table: &TableName,
    keys_table: &TableName,
    extra: &[(&str, &TableName)],
) -> Vec<String> {
    let mut text: String = sql
        .lines()
        .filter(|l| !l.trim_start().starts_with("--"))
        .collect::<Vec<_>>()
        .join("\n")
        .replace("{keys_table}", keys_table.as_str());
    for (placeholder, name) in extra {
        text = text.replace(placeholder, name.as_str());
    }
    let text = text.replace("{table}", table.as_str());
    text.split(";\n")
        .map(|s| s.trim().trim_end_matches(';').trim().to_owned())
        .filter(|s| !s.is_empty())
        .collect()
}

const PG_LOCK_ID: i64 = 0x6964_656d_715f_6d67; // "idemq_mg"
const MYSQL_LOCK: &str = "idemq_migrate";

/// Brings the schema of `table` up to date; returns the version it is at.
pub(crate) async fn run<DB: SqlBackend>(
    pool: &Pool<DB>,
    table: &TableName,
    keys_table: &TableName,
    fence_table: &TableName,
    attempts_table: &TableName,
) -> Result<i64, StoreError> {
    run_named::<DB>(
        pool,
        migrations(DB::DIALECT),
        table,
        keys_table,
        &[
            ("{fence_table}", fence_table),
            ("{attempts_table}", attempts_table),
        ],
    )
    .await
}

/// Brings `table` up to date with the migration series `set`; returns its version.
pub(crate) async fn run_set<DB: SqlBackend>(
    pool: &Pool<DB>,
    set: &'static [Migration],
    table: &TableName,
    keys_table: &TableName,
) -> Result<i64, StoreError> {
    run_named::<DB>(pool, set, table, keys_table, &[]).await
}

async fn run_named<DB: SqlBackend>(
    pool: &Pool<DB>,
    set: &'static [Migration],
    table: &TableName,
    keys_table: &TableName,
    extra: &[(&str, &TableName)],
) -> Result<i64, StoreError> {
    let err = |e| map_sqlx_error::<DB>("migration", e);
    match DB::DIALECT {
        Dialect::MySql => {
            let mut conn = pool.acquire().await.map_err(err)?;
            let got = DB::fetch(
                &mut conn,
                "SELECT GET_LOCK(?, 60)",
                vec![Val::Text(Some(MYSQL_LOCK.into()))],
                &[Kind::I64],
            )
            .await
            .map_err(err)?;
            if got.first().and_then(|r| r.opt_i64(0).ok().flatten()) != Some(1) {
                return Err(StoreError::Unavailable(
                    "mysql migration: timed out waiting for the migration lock".into(),
                ));
            }
            let res = apply::<DB>(&mut conn, set, table, keys_table, extra).await;
            let unlock = DB::execute(
                &mut conn,
                "SELECT RELEASE_LOCK(?)",
                vec![Val::Text(Some(MYSQL_LOCK.into()))],
            )
            .await;
            let version = res?;
            unlock.map_err(err)?;
            Ok(version)
        }
        Dialect::Sqlite | Dialect::Postgres => {
            let begin = if DB::DIALECT == Dialect::Sqlite {
                "BEGIN IMMEDIATE"
            } else {
                "BEGIN"
            };
            let mut tx = pool.begin_with(begin).await.map_err(err)?;
            if DB::DIALECT == Dialect::Postgres {
                DB::execute(
                    &mut tx,
                    "SELECT pg_advisory_xact_lock($1)",
                    vec![Val::I64(Some(PG_LOCK_ID))],
                )
                .await
                .map_err(err)?;
            }
            let version = apply::<DB>(&mut tx, set, table, keys_table, extra).await?;
            tx.commit().await.map_err(err)?;
            Ok(version)
        }
    }
}

async fn apply<DB: SqlBackend>(
    conn: &mut DB::Connection,
    set: &'static [Migration],
    table: &TableName,
    keys_table: &TableName,
    extra: &[(&str, &TableName)],
) -> Result<i64, StoreError> {
    let d = DB::DIALECT;
    let err = |e| map_sqlx_error::<DB>("migration", e);
    DB::execute(
        conn,
        &format!(
            "CREATE TABLE IF NOT EXISTS {SCHEMA_VERSION_TABLE} (dedup_table VARCHAR(64) NOT NULL \
             PRIMARY KEY, version BIGINT NOT NULL, applied_ms BIGINT NOT NULL)"
        ),
        vec![],
    )
    .await
    .map_err(err)?;
    let rows = DB::fetch(
        conn,
        &d.placeholders(format!(
            "SELECT version FROM {SCHEMA_VERSION_TABLE} WHERE dedup_table = ?"
        )),
        vec![Val::Text(Some(table.as_str().to_owned()))],
        &[Kind::I64],
    )
    .await
    .map_err(err)?;
    let current = match rows.first() {
        Some(r) => Some(r.i64(0).map_err(|reason| StoreError::Corrupt {
            key: format!("{SCHEMA_VERSION_TABLE}/{table}"),
            reason,
        })?),
        None => None,
    };
    let from = current.unwrap_or(0);
    let latest = set.last().map_or(0, |m| m.version);
    if from > latest {
        tracing::warn!(
            table = %table,
            schema_version = from,
            known = latest,
            "table schema is newer than this idemq build; continuing"
        );
        return Ok(from);
    }
    let mut version = from;
    for m in set.iter().filter(|m| m.version > from) {
        tracing::info!(table = %table, backend = d.name(), migration = m.name, "applying idemq migration");
        for stmt in render_with(m.sql, table, keys_table, extra) {
            DB::execute(conn, &stmt, vec![])
                .await
                .map_err(|e| map_sqlx_error::<DB>(&format!("migration {} ({stmt})", m.name), e))?;
        }
        version = m.version;
    }
    if current.is_none() {
        DB::execute(
            conn,
            &d.placeholders(format!(
                "INSERT INTO {SCHEMA_VERSION_TABLE} (dedup_table, version, applied_ms) VALUES (?, ?, ?)"
            )),
            vec![
                Val::Text(Some(table.as_str().to_owned())),
                Val::I64(Some(version)),
                Val::I64(Some(now_ms())),
            ],
        )
        .await
        .map_err(err)?;
    } else if version != from {
        DB::execute(
            conn,
            &d.placeholders(format!(
                "UPDATE {SCHEMA_VERSION_TABLE} SET version = ?, applied_ms = ? WHERE dedup_table = ?"
            )),
            vec![
                Val::I64(Some(version)),
                Val::I64(Some(now_ms())),
                Val::Text(Some(table.as_str().to_owned())),
            ],
        )
        .await
        .map_err(err)?;
    }
    Ok(version)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_statements_with_validated_names() {
        let t = TableName::new("pay_dedup").unwrap();
        let k = TableName::new("pay_keys").unwrap();
        for d in [Dialect::Sqlite, Dialect::Postgres, Dialect::MySql] {
            let stmts = render(migrations(d)[0].sql, &t, &k);
            assert!(stmts.len() >= 2, "{d:?}: {stmts:?}");
            assert!(stmts
                .iter()
                .all(|s| !s.contains("{table}") && !s.contains("{keys_table}")));
            assert!(
                stmts[0].starts_with("CREATE TABLE IF NOT EXISTS pay_dedup ("),
                "{}",
                stmts[0]
            );
            assert!(stmts.iter().any(|s| s.contains("pay_keys")));
            assert!(stmts.iter().all(|s| !s.ends_with(';')));
        }
    }

    #[test]
    fn key_columns_fit_the_core_bound() {
        // The migrations size key columns for 257 bytes; a larger core bound needs a new
        // migration that widens them.
        assert_eq!(idemq_core::key::MAX_DEDUP_KEY_BYTES, 257);
        for d in [Dialect::Postgres, Dialect::MySql] {
            assert!(migrations(d)[0].sql.contains("(257)"));
        }
    }

    #[test]
    fn versions_increase() {
        for d in [Dialect::Sqlite, Dialect::Postgres, Dialect::MySql] {
            let o: Vec<i64> = outbox_migrations(d).iter().map(|m| m.version).collect();
            assert!(o.windows(2).all(|w| w[0] < w[1]), "{d:?} outbox: {o:?}");
            let v: Vec<i64> = migrations(d).iter().map(|m| m.version).collect();
            assert!(v.windows(2).all(|w| w[0] < w[1]), "{d:?}: {v:?}");
            assert_eq!(latest_version(d), *v.last().unwrap());
        }
    }
}
