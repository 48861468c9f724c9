# syntax=docker/dockerfile:1
# Build:  docker build -t idemgate .
# Run:    docker run --stop-timeout 45 -p 8080:8080 -v idemgate-data:/var/lib/idemgate \
#           -e IDEMGATE_API_KEY_SHA256=<sha256 of your client's key> idemgate
# (--stop-timeout: a stop drains for drain_delay plus shutdown_grace, 35 s with
# the baked configuration; Docker's own default of 10 s would kill requests
# still in flight, which then wait as `unknown` records for an operator.)
# The baked configuration (config/docker.toml, at /etc/idemgate/idemgate.toml)
# listens on 0.0.0.0:8080, keeps the embedded store in /var/lib/idemgate and
# lists no key: without IDEMGATE_API_KEY_SHA256 (there is no default) the
# container exits at once saying so. Its admin listener (health, metrics)
# answers inside the container only (127.0.0.1:9090, for HEALTHCHECK); to
# scrape /metrics, mount your own file over it (or set IDEMGATE_CONFIG).
# Several replicas on PostgreSQL: deploy/compose.yaml. Reference: docs/reference.md;
# before exposing it: "Hardening" in docs/operations.md.

FROM rust:1.89-slim-bookworm AS build
WORKDIR /src
# Dependencies first, so code changes do not rebuild them.
COPY Cargo.toml Cargo.lock ./
RUN mkdir src benches && echo 'fn main() {}' > src/main.rs && touch src/lib.rs \
    && mkdir -p benches/gateway && echo 'fn main() {}' > benches/gateway/main.rs \
    && cargo build --release --locked --bin idemgate \
    && rm -rf src
COPY src ./src
COPY migrations ./migrations
COPY config ./config
RUN touch src/main.rs src/lib.rs && cargo build --release --locked --bin idemgate

FROM debian:bookworm-slim
# The system's CA roots: https upstreams without ca_file, JWKS URLs, webhooks,
# authorizers and PostgreSQL's sslmode=verify-full check certificates against
# them (docs/tls.md). Not pinned: they must follow Debian's updates.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/*
# A numeric user, so orchestrators can check it is not root (runAsNonRoot).
RUN useradd --system --uid 10001 --gid 0 --home-dir /var/lib/idemgate --shell /usr/sbin/nologin idemgate \
    && mkdir -p /etc/idemgate /var/lib/idemgate \
    && chown 10001:0 /var/lib/idemgate \
    && chmod 0770 /var/lib/idemgate
COPY --from=build /src/target/release/idemgate /usr/local/bin/idemgate
COPY config/docker.toml /etc/idemgate/idemgate.toml
USER 10001
WORKDIR /var/lib/idemgate
ENV IDEMGATE_CONFIG=/etc/idemgate/idemgate.toml
EXPOSE 8080
VOLUME ["/var/lib/idemgate"]
STOPSIGNAL SIGTERM
# Asks the admin listener's /readyz (store reachable, not draining); no curl needed.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 CMD ["/usr/local/bin/idemgate", "healthcheck"]
ENTRYPOINT ["/usr/local/bin/idemgate"]
CMD ["serve"]
