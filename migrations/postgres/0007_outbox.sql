-- The outbox: one row per final state change of a route with [routes.events],
-- written in the same statement or transaction as the change. The relay
-- delivers rows at least once, in seq order per scope.
CREATE TABLE idemgate_events (
    seq              bigserial   PRIMARY KEY,
    -- Stable across redeliveries: the receiver deduplicates by it.
    event_id         uuid        NOT NULL DEFAULT gen_random_uuid(),
    event_type       text        NOT NULL CHECK (event_type IN ('completed', 'unknown', 'failed_retryable', 'released')),
    tenant           text        NOT NULL,
    principal        text        NOT NULL,
    operation        text        NOT NULL,
    idempotency_key  text        NOT NULL,
    generation       bigint,
    status           integer,
    operation_id     text,
    actor            text,
    at               timestamptz NOT NULL DEFAULT now(),
    -- The stored response body, for routes with include_body.
    body             bytea,
    delivery         text        NOT NULL DEFAULT 'pending' CHECK (delivery IN ('pending', 'sent', 'parked')),
    attempts         integer     NOT NULL DEFAULT 0,
    next_attempt_at  timestamptz NOT NULL DEFAULT now(),
    -- A relay delivering it holds it until then (fenced by its token).
    lease_token      uuid,
    lease_until      timestamptz,
    last_error       text,
    sent_at          timestamptz
);
CREATE UNIQUE INDEX idemgate_events_event_id ON idemgate_events (event_id);
-- The relay's scan, and the per-scope order check.
CREATE INDEX idemgate_events_pending ON idemgate_events (next_attempt_at) WHERE delivery = 'pending';
CREATE INDEX idemgate_events_scope ON idemgate_events (tenant, principal, operation, idempotency_key, seq) WHERE delivery = 'pending';
-- The sweeper's scan of delivered events.
CREATE INDEX idemgate_events_sent ON idemgate_events (sent_at) WHERE delivery = 'sent';
