-- idemq dedup table and unique-index keys table (MySQL 8 / MariaDB 10.5+).
-- {table} and {keys_table} are validated identifiers substituted by the store.
-- Keys are VARBINARY: exact byte comparison (no case folding, no trailing-space padding).
CREATE TABLE IF NOT EXISTS {table} (
    dedup_key      VARBINARY(257) NOT NULL PRIMARY KEY,
    status         BIGINT NOT NULL,
    token          BIGINT NOT NULL,
    lease_until_ms BIGINT NOT NULL,
    attempts       BIGINT NOT NULL,
    took_over      BIGINT NOT NULL DEFAULT 0,
    payload_hash   VARBINARY(32) NULL,
    result         LONGBLOB NULL,
    first_seen_ms  BIGINT NOT NULL,
    completed_ms   BIGINT NULL,
    expires_ms     BIGINT NULL,
    worker         TEXT NULL,
    KEY expires_idx (expires_ms)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;
CREATE TABLE IF NOT EXISTS {keys_table} (
    dedup_key  VARBINARY(257) NOT NULL PRIMARY KEY,
    created_ms BIGINT NOT NULL,
    KEY created_idx (created_ms)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;
