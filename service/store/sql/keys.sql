-- name: ensure_key
-- The first replica to start creates the secret; the others read the same one.
INSERT INTO service_keys (name, secret) VALUES ($1, $2) ON CONFLICT (name) DO NOTHING;

-- name: get_key
-- Read a server-wide secret.
SELECT secret FROM service_keys WHERE name = $1;
