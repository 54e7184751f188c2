-- idemq transactional outbox (MySQL 8 / MariaDB 10.6+).
-- {table} is a validated identifier substituted by the outbox.
-- status: 0 pending, 1 sent, 2 failed. lane: a stable 64-bit hash of destination and ordering
-- key (NULL = unordered); rows of one lane are published in id order.
CREATE TABLE IF NOT EXISTS {table} (
    id             BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
    destination    TEXT NOT NULL,
    msg_key        LONGBLOB NULL,
    ordering_key   LONGBLOB NULL,
    lane           BIGINT NULL,
    headers        LONGBLOB NOT NULL,
    payload        LONGBLOB NOT NULL,
    dedup_key      TEXT NOT NULL,
    status         BIGINT NOT NULL DEFAULT 0,
    attempts       BIGINT NOT NULL DEFAULT 0,
    available_ms   BIGINT NOT NULL,
    lease_until_ms BIGINT NOT NULL DEFAULT 0,
    lease_token    BIGINT NULL,
    created_ms     BIGINT NOT NULL,
    updated_ms     BIGINT NOT NULL,
    last_error     TEXT NULL,
    KEY pending_idx (status, id),
    KEY lane_idx (lane, status, id),
    KEY sent_idx (status, updated_ms)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;
