-- The PostgreSQL event log's seq floor for a lane's delivered snapshot (see
-- its migration). The embedded store has no event log: nothing changes.
SELECT 1;
