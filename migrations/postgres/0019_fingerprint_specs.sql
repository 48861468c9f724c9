-- The fingerprint settings (`fingerprint.exclude`, `.defaults`, `.headers`)
-- a record's hash was computed under, and the settings each operation has
-- had.
--
-- A record's hash is what its request fingerprinted as under the settings
-- in force when it was written. When a rollout or a reload changes them,
-- an identical retry of a recorded request fingerprints differently under
-- the new ones; it used to get 409 `idempotency-key-reused` (whose advice,
-- a new key, would run it twice). From now on a record keeps the digest of
-- its settings (`fingerprint_spec`, as `<digest>:<claim token>`: a replica
-- of an earlier version that takes the record over writes a new claim
-- token and leaves the column, which then no longer counts), and every
-- replica adds its routes' settings to `idemgate_fingerprint_specs` when it
-- applies a configuration (a row per operation and settings, written once).
-- A request whose fingerprint differs from its record's, written under
-- other settings, is fingerprinted under the record's own settings too; if
-- that gives the record's hash, it is the recorded request, and it is
-- answered as such (replayed, in progress, unknown). Only the settings the
-- record was written under count: a request that differs from the recorded
-- one under them is refused as before. The table is read only on such a
-- mismatch, from a list each replica keeps.
ALTER TABLE idemgate_records ADD COLUMN fingerprint_spec text;
CREATE TABLE idemgate_fingerprint_specs (
    operation     text        COLLATE "C" NOT NULL,
    spec          text        NOT NULL,
    registered_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (operation, spec)
);
