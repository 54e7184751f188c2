-- idemq dedup table and unique-index keys table (SQLite).
-- {table} and {keys_table} are validated identifiers substituted by the store.
CREATE TABLE IF NOT EXISTS {table} (
    dedup_key      TEXT    NOT NULL PRIMARY KEY,
    status         INTEGER NOT NULL,
    token          INTEGER NOT NULL,
    lease_until_ms INTEGER NOT NULL,
    attempts       INTEGER NOT NULL,
    took_over      INTEGER NOT NULL DEFAULT 0,
    payload_hash   BLOB,
    result         BLOB,
    first_seen_ms  INTEGER NOT NULL,
    completed_ms   INTEGER,
    expires_ms     INTEGER,
    worker         TEXT
);
CREATE INDEX IF NOT EXISTS {table}_expires_idx ON {table} (expires_ms) WHERE status = 1;
CREATE TABLE IF NOT EXISTS {keys_table} (
    dedup_key  TEXT    NOT NULL PRIMARY KEY,
    created_ms INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS {keys_table}_created_idx ON {keys_table} (created_ms);
