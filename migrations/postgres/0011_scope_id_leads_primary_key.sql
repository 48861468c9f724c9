-- The scope id leads the records' primary key, and the database computes it.
--
-- Until now the scope id (the first 8 bytes of a SHA-256 over the scope, as
-- logs print it) had an index of its own, so that `idemgate keys show
-- --scope-id` finds the record a log line is about. Every first write paid
-- for that index twice (the claim's insert and the completion's new row
-- version), about a tenth of the database's work per first write
-- (docs/performance.md). With the scope id as the primary key's first
-- column, that lookup uses the primary key, and a descent compares one
-- 64-bit integer, which decides almost every comparison, before any text.
--
-- Which rows are unique is unchanged: the key still holds the whole scope.
-- So that a scope can never be stored under two ids, the id is computed here,
-- from the scope's own columns, by the function below: every insert calls it,
-- and statements that name one scope look it up through it. It hashes the
-- same bytes as the gateway (`Scope::scope_id`: a domain tag, then each of
-- tenant, principal, operation and key as a big-endian 64-bit byte length
-- and its UTF-8 bytes, whatever the database's encoding); a test compares
-- the two. STABLE rather than IMMUTABLE (convert_to is STABLE): PostgreSQL
-- then inlines it into the statements that call it.
CREATE OR REPLACE FUNCTION idemgate_scope_id(tenant text, principal text, operation text, idempotency_key text) RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE
RETURN ('x' || encode(substr(sha256('idemgate/log-id/v1'::bytea
    || int8send(octet_length(convert_to(tenant, 'UTF8'))::int8) || convert_to(tenant, 'UTF8')
    || int8send(octet_length(convert_to(principal, 'UTF8'))::int8) || convert_to(principal, 'UTF8')
    || int8send(octet_length(convert_to(operation, 'UTF8'))::int8) || convert_to(operation, 'UTF8')
    || int8send(octet_length(convert_to(idempotency_key, 'UTF8'))::int8) || convert_to(idempotency_key, 'UTF8')), 1, 8), 'hex'))::bit(64)::bigint;

-- Records claimed before migration 0005 have no scope id yet; any other
-- stored id is recomputed too, so that the key and the lookups agree. This
-- reads the whole table, and rebuilding the key takes an exclusive lock on
-- it: on a large table, run `idemgate migrate` before the new replicas start.
UPDATE idemgate_records SET scope_id = idemgate_scope_id(tenant, principal, operation, idempotency_key)
WHERE scope_id IS DISTINCT FROM idemgate_scope_id(tenant, principal, operation, idempotency_key);

ALTER TABLE idemgate_records
    ALTER COLUMN scope_id SET NOT NULL,
    DROP CONSTRAINT idemgate_records_pkey,
    ADD CONSTRAINT idemgate_records_pkey PRIMARY KEY (scope_id, idempotency_key, tenant, principal, operation);
DROP INDEX idemgate_records_scope_id;
DROP INDEX idemgate_records_no_scope_id;
