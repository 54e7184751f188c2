-- Records that ended their lifecycle, completed (1) or rolled back (2), are purged by their
-- expiry: one partial index over both, in place of the one over completed records only.
DROP INDEX IF EXISTS {table}_expires_idx;
CREATE INDEX IF NOT EXISTS {table}_terminal_expires_idx ON {table} (expires_ms) WHERE status <> 0;
