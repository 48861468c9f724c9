//! TLS towards upstreams (filled in below).
