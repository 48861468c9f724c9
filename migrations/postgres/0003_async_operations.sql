-- Async operations (mode = "async"): the record of an accepted operation also
-- holds the request to run, the id clients poll, and the workers' bookkeeping.
ALTER TABLE idemgate_records DROP CONSTRAINT idemgate_records_state_check;
ALTER TABLE idemgate_records ADD CONSTRAINT idemgate_records_state_check
    CHECK (state IN ('in_flight', 'completed', 'unknown', 'queued', 'processing', 'failed_retryable'));
ALTER TABLE idemgate_records
    -- The unguessable id of an async operation (NULL for synchronous records).
    ADD COLUMN operation_id     text,
    -- The accepted request (method, path and query, forwarded headers, body).
    ADD COLUMN request          bytea,
    -- Attempts taken by workers so far.
    ADD COLUMN attempts         integer NOT NULL DEFAULT 0,
    -- Queued: when the next attempt is due (after a retry's backoff).
    ADD COLUMN next_attempt_at  timestamptz,
    -- Processing: written just before the attempt's request leaves; NULL
    -- proves the attempt never sent anything (so an expired lease may re-queue).
    ADD COLUMN sent_at          timestamptz,
    -- The upstream status of the last retryable failure, if it answered.
    ADD COLUMN last_status      integer,
    -- An attempt may have executed (sent, answer lost) and the operation was
    -- run again on a deduplicating upstream: it can no longer end
    -- failed_retryable ("never executed"); used-up retries end unknown.
    ADD COLUMN maybe_executed   boolean NOT NULL DEFAULT false;

-- Operation ids are looked up within the caller's tenant (which also keeps the
-- index local to one shard on a distributed PostgreSQL).
CREATE UNIQUE INDEX idemgate_records_operation_id ON idemgate_records (tenant, operation_id) WHERE operation_id IS NOT NULL;
-- The workers' queue: due operations, oldest first.
CREATE INDEX idemgate_records_queue ON idemgate_records (next_attempt_at) WHERE state = 'queued';
-- The sweeper also removes failed operations past their retention.
DROP INDEX idemgate_records_sweep;
CREATE INDEX idemgate_records_sweep ON idemgate_records (expires_at) WHERE state IN ('completed', 'failed_retryable');
