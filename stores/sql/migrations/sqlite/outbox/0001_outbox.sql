-- idemq transactional outbox (SQLite).
-- {table} is a validated identifier substituted by the outbox.
-- status: 0 pending, 1 sent, 2 failed. lane: a stable 64-bit hash of destination and ordering
-- key (NULL = unordered); rows of one lane are published in id order. AUTOINCREMENT: ids
-- are never reused after a purge.
CREATE TABLE IF NOT EXISTS {table} (
    id             INTEGER PRIMARY KEY AUTOINCREMENT,
    destination    TEXT    NOT NULL,
    msg_key        BLOB,
    ordering_key   BLOB,
    lane           INTEGER,
    headers        BLOB    NOT NULL,
    payload        BLOB    NOT NULL,
    dedup_key      TEXT    NOT NULL,
    status         INTEGER NOT NULL DEFAULT 0,
    attempts       INTEGER NOT NULL DEFAULT 0,
    available_ms   INTEGER NOT NULL,
    lease_until_ms INTEGER NOT NULL DEFAULT 0,
    lease_token    INTEGER,
    created_ms     INTEGER NOT NULL,
    updated_ms     INTEGER NOT NULL,
    last_error     TEXT
);
CREATE INDEX IF NOT EXISTS {table}_pending_idx ON {table} (id) WHERE status = 0;
CREATE INDEX IF NOT EXISTS {table}_lane_idx ON {table} (lane, id) WHERE status <> 1;
CREATE INDEX IF NOT EXISTS {table}_sent_idx ON {table} (updated_ms) WHERE status = 1;
