-- Issue 11 item 5: the fence table. In-transaction completions are inserted here, keyed by
-- (dedup_key, token), instead of updating the heartbeated dedup row (which fails under
-- REPEATABLE READ / SERIALIZABLE); a takeover inserts a tombstone (kind 0) for the old token
-- first, which waits for an open completion (kind 1) of that token and then either loses
-- (the completion is folded into the dedup row) or fences it. See docs/stores-sql.md.
CREATE TABLE IF NOT EXISTS {fence_table} (
    dedup_key    VARCHAR(257) COLLATE "C" NOT NULL,
    token        BIGINT NOT NULL,
    kind         BIGINT NOT NULL,
    result       BYTEA,
    completed_ms BIGINT NOT NULL,
    expires_ms   BIGINT NOT NULL,
    PRIMARY KEY (dedup_key, token)
);
CREATE INDEX IF NOT EXISTS {fence_table}_expires_idx ON {fence_table} (expires_ms);
