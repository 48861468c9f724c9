-- Generations drawn on the tenant's shard, not from one sequence on the
-- coordinator (docs/scaling.md, "Generations"), so that a gateway may send
-- its statements to any node.
--
-- One counter row per tenant, colocated with the tenant's records: it lives
-- and moves with the tenant's shard, and a claim, take-over, take or
-- resolution draws its generation by raising it on that shard. Every
-- generation a tenant's records ever held came from its counter (or, before
-- this migration, from the sequence), so a drawn value is above every
-- generation any scope of the tenant ever had, swept and released ones
-- included.
CREATE TABLE idemgate_generations (
    tenant      text COLLATE "C" PRIMARY KEY,
    generation  bigint NOT NULL
);
SELECT create_distributed_table('idemgate_generations', 'tenant', colocate_with => 'idemgate_records');

-- A tenant's first counter starts above every value the sequence ever gave
-- (the floor: `last_value`, whether or not it was drawn), then the sequence
-- goes: a replica of an older version still drawing from it would hand out
-- generations below the counters', so its claims now fail (503, nothing
-- forwarded) until it is replaced.
INSERT INTO idemgate_settings (name, value)
SELECT 'citus_generation_floor', convert_to(last_value::text, 'UTF8') FROM idemgate_generation
ON CONFLICT (name) DO NOTHING;
DROP SEQUENCE idemgate_generation;

-- Which migrations are applied, on every node: a replica whose URL names a
-- worker finds the schema up to date there and starts without migrating
-- (schema changes still go through the coordinator).
SELECT create_reference_table('idemgate_schema_migrations');
