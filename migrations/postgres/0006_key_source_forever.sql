-- Legacy clients and durable business identity (numbered 0006: 0004 and 0005
-- are reserved for other changes; the runner applies the listed migrations
-- in order and does not require consecutive versions).
--
-- Which of the route's key sources gave the key: 'header:<name>' or
-- 'body:<JSON Pointer>' (key_from). NULL for records claimed before this
-- column existed (their key came from the route's key header).
ALTER TABLE idemgate_records ADD COLUMN key_source text;

-- Records kept forever (retention = "forever") have expires_at = 'infinity':
-- later than any now(), so the claim's take-over (expires_at <= now()), the
-- sweeper and the read side never find them expired. This index holds just
-- those rows, for the idemgate_forever_records gauge and
-- `keys list --retention forever`; it costs nothing on other records.
CREATE INDEX idemgate_records_forever ON idemgate_records (operation) WHERE expires_at = 'infinity';
