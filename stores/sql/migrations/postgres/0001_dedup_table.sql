-- idemq dedup table and unique-index keys table (PostgreSQL).
-- {table} and {keys_table} are validated identifiers substituted by the store.
-- Keys use the "C" collation: byte-wise equality and ordering, the order batches lock in.
CREATE TABLE IF NOT EXISTS {table} (
    dedup_key      VARCHAR(257) COLLATE "C" NOT NULL PRIMARY KEY,
    status         BIGINT NOT NULL,
    token          BIGINT NOT NULL,
    lease_until_ms BIGINT NOT NULL,
    attempts       BIGINT NOT NULL,
    took_over      BIGINT NOT NULL DEFAULT 0,
    payload_hash   BYTEA,
    result         BYTEA,
    first_seen_ms  BIGINT NOT NULL,
    completed_ms   BIGINT,
    expires_ms     BIGINT,
    worker         TEXT
);
CREATE INDEX IF NOT EXISTS {table}_expires_idx ON {table} (expires_ms) WHERE status = 1;
CREATE TABLE IF NOT EXISTS {keys_table} (
    dedup_key  VARCHAR(257) COLLATE "C" NOT NULL PRIMARY KEY,
    created_ms BIGINT NOT NULL
);
CREATE INDEX IF NOT EXISTS {keys_table}_created_idx ON {keys_table} (created_ms);
