-- The fingerprint settings (`fingerprint.exclude`, `.defaults`, `.headers`)
-- each operation has had. A replica adds its routes' settings when it
-- starts and at every reload (a row per operation and settings, written
-- once).
--
-- A record's hash is what its request fingerprinted as under the settings
-- in force when it was written. When a rollout or a reload changes them,
-- an identical retry of a recorded request fingerprints differently under
-- the new ones; it used to get 409 `idempotency-key-reused` (whose advice,
-- a new key, would run it twice). From now on a request whose fingerprint
-- differs from its record's is also fingerprinted under each of the other
-- settings listed here for its operation: if one of them gives the
-- record's hash, it is the recorded request, and it is answered as such
-- (replayed, in progress, unknown). Nothing on the claim's path reads this
-- table: only a mismatch does, through a list each replica keeps.
CREATE TABLE idemgate_fingerprint_specs (
    operation     text        COLLATE "C" NOT NULL,
    spec          text        NOT NULL,
    registered_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (operation, spec)
);
