-- idemq source offsets (SQLite): the next offset to consume per consumer group, topic and
-- partition, written in the same transaction as the effect and its dedup record.
-- {table} is a validated identifier substituted by SourceOffsets.
CREATE TABLE IF NOT EXISTS {table} (
    consumer_group TEXT NOT NULL,
    topic          TEXT NOT NULL,
    partition_id   INTEGER NOT NULL,
    next_offset    INTEGER NOT NULL,
    updated_ms     INTEGER NOT NULL,
    PRIMARY KEY (consumer_group, topic, partition_id)
);
