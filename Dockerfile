# syntax=docker/dockerfile:1
# Build:  docker build -t idemgate .
# Run:    docker run -p 8080:8080 -p 9090:9090 \
#           -v $PWD/config:/etc/idemgate:ro -v idemgate-data:/var/lib/idemgate \
#           -e IDEMGATE_DATABASE_URL=postgres://... idemgate
# The config is read from /etc/idemgate/idemgate.toml; listen on 0.0.0.0 inside
# the container. Relative SQLite paths resolve under /var/lib/idemgate.

FROM rust:1.89-slim-bookworm AS build
WORKDIR /src
# Dependencies first, so code changes do not rebuild them.
COPY Cargo.toml Cargo.lock ./
RUN mkdir src && echo 'fn main() {}' > src/main.rs && touch src/lib.rs \
    && cargo build --release --locked \
    && rm -rf src
COPY src ./src
COPY migrations ./migrations
COPY config ./config
RUN touch src/main.rs src/lib.rs && cargo build --release --locked --bin idemgate

FROM debian:bookworm-slim
RUN useradd --system --uid 10001 --home-dir /var/lib/idemgate --shell /usr/sbin/nologin idemgate \
    && mkdir -p /etc/idemgate /var/lib/idemgate \
    && chown idemgate /var/lib/idemgate
COPY --from=build /src/target/release/idemgate /usr/local/bin/idemgate
COPY config/idemgate.toml /etc/idemgate/idemgate.toml
USER idemgate
WORKDIR /var/lib/idemgate
ENV IDEMGATE_CONFIG=/etc/idemgate/idemgate.toml
EXPOSE 8080 9090
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/idemgate"]
CMD ["serve"]
