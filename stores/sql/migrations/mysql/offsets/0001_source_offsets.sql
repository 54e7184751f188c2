-- idemq source offsets (MySQL 8 / MariaDB 10.6+): the next offset to consume per consumer
-- group, topic and partition, written in the same transaction as the effect and its dedup
-- record. {table} is a validated identifier substituted by SourceOffsets.
-- Group and topic are binary strings: compared exactly, as the broker does.
CREATE TABLE IF NOT EXISTS {table} (
    consumer_group VARBINARY(255) NOT NULL,
    topic          VARBINARY(255) NOT NULL,
    partition_id   BIGINT NOT NULL,
    next_offset    BIGINT NOT NULL,
    updated_ms     BIGINT NOT NULL,
    PRIMARY KEY (consumer_group, topic, partition_id)
) ENGINE = InnoDB;
