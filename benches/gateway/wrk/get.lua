-- A plain GET of the URL's path: the same request to the upstream, nginx and
-- idemgate's pass-through (a non-idempotent method on the route's path).
wrk.method = "GET"
