-- idemq source offsets (PostgreSQL 12+): the next offset to consume per consumer group,
-- topic and partition, written in the same transaction as the effect and its dedup record.
-- {table} is a validated identifier substituted by SourceOffsets.
CREATE TABLE IF NOT EXISTS {table} (
    consumer_group VARCHAR(255) NOT NULL,
    topic          VARCHAR(255) NOT NULL,
    partition_id   BIGINT NOT NULL,
    next_offset    BIGINT NOT NULL,
    updated_ms     BIGINT NOT NULL,
    PRIMARY KEY (consumer_group, topic, partition_id)
);
