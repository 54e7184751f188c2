-- The unique-index strategy's attempt counts. Its keys table holds only keys whose effect
-- committed, so runs of a handler that failed (and claims given back without a run) are
-- counted here, per key, for the retry policy: durable across restarts and shared by every
-- consumer of the group. Rows are few (keys that failed) and purged with the keys.
CREATE TABLE IF NOT EXISTS {attempts_table} (
    dedup_key  VARCHAR(257) COLLATE "C" NOT NULL PRIMARY KEY,
    failures   BIGINT NOT NULL,
    unrun      BIGINT NOT NULL,
    updated_ms BIGINT NOT NULL
);
CREATE INDEX IF NOT EXISTS {attempts_table}_updated_idx ON {attempts_table} (updated_ms);
