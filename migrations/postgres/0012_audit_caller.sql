-- Who made a change through the admin API: the caller's peer address and a
-- label of the token it presented (`sha256:` and 8 hex digits of the token's
-- SHA-256; never the token). NULL for CLI and reconciler changes and for rows
-- written before this migration.
ALTER TABLE idemgate_audit
    ADD COLUMN peer        text,
    ADD COLUMN token_label text;
