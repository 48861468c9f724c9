-- Reconciliation probes (`[routes.reconcile]`): the reconciler's bookkeeping
-- on `unknown` records. It belongs to one generation (`probe_generation`): a
-- record resolved, or claimed again and unknown once more, starts afresh.
-- `updated_at` is not touched by probes: it stays the time the record became
-- unknown (what `settle` and the oldest-unknown gauge measure from).
ALTER TABLE idemgate_records
    -- The generation the columns below are about (NULL: never probed).
    ADD COLUMN probe_generation  bigint,
    -- Inconclusive probes so far (other status, error, timeout): the backoff.
    ADD COLUMN probe_attempts    integer NOT NULL DEFAULT 0,
    -- Not probed again before this (exponential backoff).
    ADD COLUMN next_probe_at     timestamptz,
    -- The replica probing it now marks it with a fresh token until
    -- probe_until; its result write must still find that token.
    ADD COLUMN probe_token       uuid,
    ADD COLUMN probe_until       timestamptz;
