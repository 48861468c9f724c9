-- Citus: the schema of migrations 0001.. (created above as plain tables on
-- the coordinator, in this same transaction) distributed by tenant.
--
-- A distributed table's unique constraints must contain the distribution
-- column: the keys of the audit trail and the outbox gain `tenant`. The
-- tenant goes last, so that each shard keeps the lookups by `id`, `seq` and
-- `event_id` alone on the same index descents as on one node (the relay's
-- follow-up writes, `events redeliver`), and the rows stay exactly as
-- unique as before (the old key alone was already unique).
ALTER TABLE idemgate_audit DROP CONSTRAINT idemgate_audit_pkey, ADD CONSTRAINT idemgate_audit_pkey PRIMARY KEY (id, tenant);
ALTER TABLE idemgate_events DROP CONSTRAINT idemgate_events_pkey, ADD CONSTRAINT idemgate_events_pkey PRIMARY KEY (seq, tenant);
DROP INDEX idemgate_events_event_id;
CREATE UNIQUE INDEX idemgate_events_event_id ON idemgate_events (event_id, tenant);

-- Colocated tables must agree on the distribution column's collation: the
-- audit trail's scope columns compare byte for byte like the records' and
-- the outbox's (migration 0009).
ALTER TABLE idemgate_audit
    ALTER COLUMN tenant TYPE text COLLATE "C",
    ALTER COLUMN principal TYPE text COLLATE "C",
    ALTER COLUMN operation TYPE text COLLATE "C",
    ALTER COLUMN idempotency_key TYPE text COLLATE "C";

-- The scope id function runs inside the statements the workers execute.
SELECT create_distributed_function('idemgate_scope_id(text, text, text, text)');

-- A handful of rows every node reads.
SELECT create_reference_table('idemgate_settings');

-- Records, and beside each tenant's records its events and audit rows: a
-- final state and its event, a resolution and its audit row, stay on one
-- shard and commit on one node.
SELECT create_distributed_table('idemgate_records', 'tenant');
SELECT create_distributed_table('idemgate_events', 'tenant', colocate_with => 'idemgate_records');
SELECT create_distributed_table('idemgate_audit', 'tenant', colocate_with => 'idemgate_records');
