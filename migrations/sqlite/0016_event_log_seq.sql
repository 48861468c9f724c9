-- The PostgreSQL event log's second index and the batches' seq bound (see
-- its migration). The embedded store has no event log: nothing changes.
SELECT 1;
