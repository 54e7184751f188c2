//! Optimistic locking and state machines on the caller's own tables, inside the caller's
//! transaction: one row per entity, so nothing grows with traffic.
//!
//! Both helpers run one guarded `UPDATE`; when it changes no row they read the row (a
//! locking read on PostgreSQL/MySQL, so a concurrent duplicate that just committed is
//! seen) to tell *why*. The caller does its business writes only on `Applied`, in the same
//! transaction, then commits.

use crate::backend::{map_sqlx_error, Kind, SqlBackend, Val};
use crate::ident::{ColumnName, Ident, TableName};
use idemq_core::StoreError;

/// The id of an entity row: an integer or a text column.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum EntityId {
    /// An integer id (`BIGINT`, `INTEGER`...).
    Int(i64),
    /// A text id (`VARCHAR`, `TEXT`...).
    Text(String),
}

impl EntityId {
    fn val(&self) -> Val {
        match self {
            EntityId::Int(i) => Val::I64(Some(*i)),
            EntityId::Text(s) => Val::Text(Some(s.clone())),
        }
    }
}

impl From<i64> for EntityId {
    fn from(v: i64) -> Self {
        EntityId::Int(v)
    }
}

impl From<&str> for EntityId {
    fn from(v: &str) -> Self {
        EntityId::Text(v.to_owned())
    }
}

impl From<String> for EntityId {
    fn from(v: String) -> Self {
        EntityId::Text(v)
    }
}

/// The answer of [`VersionedEntity`]'s operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VersionOutcome {
    /// The version was written: apply the message's effect in this transaction.
    Applied,
    /// The stored version (shown) is not older than the message's / differs from the
    /// expected one: a duplicate or an out-of-order message; skip it.
    Stale(i64),
    /// No row has this id.
    NotFound,
}

/// Optimistic locking on a version (or sequence) column of one row per entity.
///
/// ```no_run
/// # async fn f(pool: idemq_sql::sqlx::SqlitePool) -> Result<(), Box<dyn std::error::Error>> {
/// use idemq_sql::{VersionedEntity, VersionOutcome};
/// let accounts = VersionedEntity::new("accounts", "id", "version")?;
/// let mut tx = pool.begin().await?;
/// // The message says "this is change #8 of account 7".
/// if accounts.apply_if_newer(&mut *tx, 7, 8).await? == VersionOutcome::Applied {
///     idemq_sql::sqlx::query("UPDATE accounts SET balance = balance - 100 WHERE id = 7")
///         .execute(&mut *tx).await?;
/// }
/// tx.commit().await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VersionedEntity {
    table: TableName,
    id_col: ColumnName,
    version_col: ColumnName,
}

impl VersionedEntity {
    /// Validates the table and column names.
    pub fn new(table: &str, id_col: &str, version_col: &str) -> Result<Self, StoreError> {
        Ok(Self {
            table: Ident::new(table)?,
            id_col: Ident::new(id_col)?,
            version_col: Ident::new(version_col)?,
        })
    }

    /// Sets the version to `version` only if the stored one is lower
    /// (`UPDATE … SET v = ? WHERE id = ? AND v < ?`).
    pub async fn apply_if_newer<C>(
        &self,
        conn: &mut C,
        id: impl Into<EntityId>,
        version: i64,
    ) -> Result<VersionOutcome, StoreError>
    where
        C: sqlx::Connection,
        C::Database: SqlBackend,
    {
        let (t, i, v) = (&self.table, &self.id_col, &self.version_col);
        let sql = format!("UPDATE {t} SET {v} = ? WHERE {i} = ? AND {v} < ?");
        let id = id.into();
        self.update_or_explain(
            conn,
            sql,
            vec![Val::I64(Some(version)), id.val(), Val::I64(Some(version))],
            &id,
            "apply_if_newer",
        )
        .await
    }

    /// Sets the version to `new` only if it is `expected` (compare-and-set,
    /// `UPDATE … SET v = ? WHERE id = ? AND v = ?`). Use `new = expected + 1` to bump.
    pub async fn compare_and_set<C>(
        &self,
        conn: &mut C,
        id: impl Into<EntityId>,
        expected: i64,
        new: i64,
    ) -> Result<VersionOutcome, StoreError>
    where
        C: sqlx::Connection,
        C::Database: SqlBackend,
    {
        let (t, i, v) = (&self.table, &self.id_col, &self.version_col);
        let sql = format!("UPDATE {t} SET {v} = ? WHERE {i} = ? AND {v} = ?");
        let id = id.into();
        self.update_or_explain(
            conn,
            sql,
            vec![Val::I64(Some(new)), id.val(), Val::I64(Some(expected))],
            &id,
            "compare_and_set",
        )
        .await
    }

    /// The stored version (a locking read on PostgreSQL/MySQL), `None` if no row.
    pub async fn current<C>(
        &self,
        conn: &mut C,
        id: impl Into<EntityId>,
    ) -> Result<Option<i64>, StoreError>
    where
        C: sqlx::Connection,
        C::Database: SqlBackend,
    {
        self.read(conn, &id.into()).await
    }

    async fn read<C>(&self, conn: &mut C, id: &EntityId) -> Result<Option<i64>, StoreError>
    where
        C: sqlx::Connection,
        C::Database: SqlBackend,
    {
        let d = <C::Database as SqlBackend>::DIALECT;
        let expr = d.cast_i64(self.version_col.as_str());
        match read_column(
            conn,
            &self.table,
            &self.id_col,
            &expr,
            id,
            Kind::I64,
            "read version",
        )
        .await?
        {
            None => Ok(None),
            Some(r) => r.opt_i64(0).map_err(|reason| StoreError::Corrupt {
                key: format!("{}/{id:?}", self.table),
                reason,
            }),
        }
    }

    async fn update_or_explain<C>(
        &self,
        conn: &mut C,
        sql: String,
        args: Vec<Val>,
        id: &EntityId,
        op: &str,
    ) -> Result<VersionOutcome, StoreError>
    where
        C: sqlx::Connection,
        C::Database: SqlBackend,
    {
        let sql = <C::Database as SqlBackend>::DIALECT.placeholders(sql);
        let n = <C::Database as SqlBackend>::execute(conn, &sql, args)
            .await
            .map_err(|e| map_sqlx_error::<C::Database>(op, e))?;
        if n > 0 {
            return Ok(VersionOutcome::Applied);
        }
        Ok(match self.read(conn, id).await? {
            None => VersionOutcome::NotFound,
            Some(current) => VersionOutcome::Stale(current),
        })
    }
}

/// The answer of [`StateMachine::transition`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transition {
    /// The row moved to the target state: apply the effect in this transaction.
    Applied,
    /// The row already is in the target state: a duplicate; skip and ack.
    AlreadyInTarget,
    /// The row is in another state (shown), from which the transition is not allowed.
    Illegal(String),
    /// No row has this id.
    NotFound,
}

/// A status column with guarded transitions
/// (`UPDATE t SET status = :to WHERE id = :id AND status IN (:from…)`).
///
/// Status values are bound as text: use a text-like column (`VARCHAR`, `TEXT`).
///
/// ```no_run
/// # async fn f(pool: idemq_sql::sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// use idemq_sql::{StateMachine, Transition};
/// let orders = StateMachine::new("orders", "id", "status")?;
/// let mut tx = pool.begin().await?;
/// match orders.transition(&mut *tx, 42, &["UNPAID"], "PAID").await? {
///     Transition::Applied => { /* record the payment */ }
///     Transition::AlreadyInTarget => { /* duplicate callback: nothing to do */ }
///     Transition::Illegal(state) => { /* e.g. CANCELLED: refund or alert */ let _ = state; }
///     Transition::NotFound => { /* unknown order */ }
/// }
/// tx.commit().await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateMachine {
    table: TableName,
    id_col: ColumnName,
    status_col: ColumnName,
}

impl StateMachine {
    /// Validates the table and column names.
    pub fn new(table: &str, id_col: &str, status_col: &str) -> Result<Self, StoreError> {
        Ok(Self {
            table: Ident::new(table)?,
            id_col: Ident::new(id_col)?,
            status_col: Ident::new(status_col)?,
        })
    }

    /// Moves row `id` to `to` if its status is one of `from`.
    pub async fn transition<C>(
        &self,
        conn: &mut C,
        id: impl Into<EntityId>,
        from: &[&str],
        to: &str,
    ) -> Result<Transition, StoreError>
    where
        C: sqlx::Connection,
        C::Database: SqlBackend,
    {
        if from.is_empty() {
            return Err(StoreError::Config(format!(
                "state machine on {}.{}: a transition to `{to}` needs at least one source state",
                self.table, self.status_col
            )));
        }
        let id = id.into();
        let (t, i, s) = (&self.table, &self.id_col, &self.status_col);
        let mut sql = format!("UPDATE {t} SET {s} = ? WHERE {i} = ? AND {s} IN (");
        let mut args = vec![Val::Text(Some(to.to_owned())), id.val()];
        for (n, f) in from.iter().enumerate() {
            sql.push_str(if n == 0 { "?" } else { ", ?" });
            args.push(Val::Text(Some((*f).to_owned())));
        }
        sql.push(')');
        let sql = <C::Database as SqlBackend>::DIALECT.placeholders(sql);
        let n = <C::Database as SqlBackend>::execute(conn, &sql, args)
            .await
            .map_err(|e| map_sqlx_error::<C::Database>("transition", e))?;
        if n > 0 {
            return Ok(Transition::Applied);
        }
        Ok(match self.read(conn, &id).await? {
            None => Transition::NotFound,
            Some(cur) if cur == to => Transition::AlreadyInTarget,
            Some(cur) => Transition::Illegal(cur),
        })
    }

    /// The current status (a locking read on PostgreSQL/MySQL), `None` if no row.
    pub async fn current<C>(
        &self,
        conn: &mut C,
        id: impl Into<EntityId>,
    ) -> Result<Option<String>, StoreError>
    where
        C: sqlx::Connection,
        C::Database: SqlBackend,
    {
        self.read(conn, &id.into()).await
    }

    async fn read<C>(&self, conn: &mut C, id: &EntityId) -> Result<Option<String>, StoreError>
    where
        C: sqlx::Connection,
        C::Database: SqlBackend,
    {
        let d = <C::Database as SqlBackend>::DIALECT;
        let expr = d.cast_text(self.status_col.as_str());
        match read_column(
            conn,
            &self.table,
            &self.id_col,
            &expr,
            id,
            Kind::Text,
            "read status",
        )
        .await?
        {
            None => Ok(None),
            Some(r) => r
                .opt_text(0)
                .map(|s| Some(s.unwrap_or("NULL").to_owned()))
                .map_err(|reason| StoreError::Corrupt {
                    key: format!("{}/{id:?}", self.table),
                    reason,
                }),
        }
    }
}

/// Reads one column expression of one entity row (a locking read on PostgreSQL/MySQL).
async fn read_column<C>(
    conn: &mut C,
    table: &Ident,
    id_col: &Ident,
    expr: &str,
    id: &EntityId,
    kind: Kind,
    op: &str,
) -> Result<Option<crate::backend::Row>, StoreError>
where
    C: sqlx::Connection,
    C::Database: SqlBackend,
{
    let d = <C::Database as SqlBackend>::DIALECT;
    let sql = d.placeholders(format!(
        "SELECT {expr} FROM {table} WHERE {id_col} = ?{}",
        d.locking_read()
    ));
    let mut rows = <C::Database as SqlBackend>::fetch(conn, &sql, vec![id.val()], &[kind])
        .await
        .map_err(|e| map_sqlx_error::<C::Database>(op, e))?;
    Ok(if rows.is_empty() {
        None
    } else {
        Some(rows.swap_remove(0))
    })
}
