-- The unique-index strategy's attempt counts. Its keys table holds only keys whose effect
-- committed, so runs of a handler that failed (and claims given back without a run) are
-- counted here, per key, for the retry policy: durable across restarts and shared by every
-- consumer of the group. Rows are few (keys that failed) and purged with the keys.
CREATE TABLE IF NOT EXISTS {attempts_table} (
    dedup_key  TEXT    NOT NULL PRIMARY KEY,
    failures   INTEGER NOT NULL,
    unrun      INTEGER NOT NULL,
    updated_ms INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS {attempts_table}_updated_idx ON {attempts_table} (updated_ms);
