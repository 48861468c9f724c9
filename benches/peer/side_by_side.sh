#!/usr/bin/env bash
# The peer benchmark (`scripts/bench --peer`; see docs/performance-notes.md).
# Side by side, in ONE run on one machine: the Node peer (@node-idempotency/core +
# Redis, AOF fsync per REDIS_DURABILITY, default always) against idemgate on
# PostgreSQL (fsync on, synchronous_commit on) and idemgate on its embedded SQLite store.
# Same nginx upstream, same wrk scripts, same body; targets interleaved per phase.
#
#   IDEMGATE_BIN=/path/to/target/release/idemgate ./side_by_side.sh
#   IDEMGATE_BASE_BIN=/path/to/an/older/idemgate ...   # adds target `base`: that binary
#       on the same PostgreSQL, interleaved with the others, and `*_pg_vs_base` ratios
#   PGBOUNCER=1 ...   # adds targets `pgbt` and `pgbs`: the gateway through PgBouncer
#       (Debian's package) in transaction mode (store.pooler = "transaction") and in
#       session mode, in front of the same PostgreSQL, and a `pgbouncer@cN:` line of
#       their figures over the direct `pg` (PgBouncer's CPU counts in their stacks)
#
# Prints per run: rps p50 p99, upstream requests seen (must equal first writes),
# cpu_us/r (the CPU time per request of the target's whole stack: the peer's Node
# process and Redis; idemgate and every PostgreSQL process; idemgate on SQLite),
# then `ratios: first_pg_vs_peer=X replay_pg_vs_peer=Y first_sqlite_vs_peer=Z
# replay_sqlite_vs_peer=W` per connection count, and a closing `ratios:` line at the
# highest one. ROUNDS (default 3) repeats the measured phases, the targets
# interleaved within each round; every figure on the `ratios` lines is the median
# over the rounds of that round's figure, and `cpu_first_pg_vs_peer` is the median
# of the rounds' whole-stack CPU per first write, idemgate on PostgreSQL over the
# peer. After each PostgreSQL run: seq_scan+N, the sequential scans of
# idemgate_records during it (pg_stat_user_tables; backends report at most once
# a second, so a count can lag into the next run).
set -euo pipefail
export LC_ALL=C
HERE="$(cd "$(dirname "$0")" && pwd)"
PEER_DIR="$HERE/node-peer"; WRK_DIR="$HERE/wrk"
BIN="${IDEMGATE_BIN:?set IDEMGATE_BIN to the idemgate release binary}"
DURATION="${DURATION:-10s}"; CONNS="${CONNS:-16 64}"; WRK_THREADS="${WRK_THREADS:-2}"
REDIS_DURABILITY="${REDIS_DURABILITY:-always}"; REPLAY_KEYS="${REPLAY_KEYS:-1000}"
BASE_BIN="${IDEMGATE_BASE_BIN:-}"
PGBOUNCER="${PGBOUNCER:-0}"
POOLED=""; [[ $PGBOUNCER == 1 ]] && POOLED=" pgbt pgbs"
TARGETS="${TARGETS:-peer pg${BASE_BIN:+ base}$POOLED sqlite}"
ROUNDS="${ROUNDS:-3}"
export ORDER_BODY='{"item":"widget","qty":1}'
API_KEY="side-by-side-key"
for b in node redis-server redis-cli nginx wrk curl initdb pg_ctl; do
  command -v "$b" >/dev/null || { echo "missing: $b" >&2; exit 1; }; done
if [[ $PGBOUNCER == 1 ]] && ! command -v pgbouncer >/dev/null && [[ ! -x /usr/sbin/pgbouncer ]]; then
  echo "missing: pgbouncer (PGBOUNCER=1)" >&2; exit 1; fi
case "$REDIS_DURABILITY" in
  none) RARGS=(--save "" --appendonly no) ;;
  everysec) RARGS=(--save "" --appendonly yes --appendfsync everysec) ;;
  always) RARGS=(--save "" --appendonly yes --appendfsync always) ;;
esac
mkdir -p /tmp/peerbench; RUN="$(mktemp -d /tmp/peerbench/sbs.XXXXXX)"; chmod 755 "$RUN"
echo "run dir: $RUN"
PIDS=()
stop_pid() { local p=$1; kill -TERM "$p" 2>/dev/null || true
  for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
  kill -KILL "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; }
cleanup() { local rc=$?; set +e
  for (( i=${#PIDS[@]}-1; i>=0; i-- )); do stop_pid "${PIDS[$i]}"; done
  for p in ${PGB_PID[@]:-}; do kill -INT "$p" 2>/dev/null; done
  [[ -n "${PGDATA_DIR:-}" ]] && runuser -u postgres -- pg_ctl -D "$PGDATA_DIR" -m immediate stop >/dev/null 2>&1
  exit $rc; }
trap cleanup EXIT; trap 'exit 130' INT TERM
free_port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }
wait_until() { local w=$1 t=$2; shift 2; for _ in $(seq "$t"); do "$@" >/dev/null 2>&1 && return 0; sleep 0.1; done; echo "timeout: $w" >&2; return 1; }

# ---- redis + nginx upstream + peer ------------------------------------------
RP=$(free_port); UP=$(free_port); PP=$(free_port); PGP=$(free_port); GP=$(free_port); GA=$(free_port); SP=$(free_port); SA=$(free_port); BP=$(free_port); BA=$(free_port)
TXP=$(free_port); TXGP=$(free_port); TXGA=$(free_port); SSP=$(free_port); SSGP=$(free_port); SSGA=$(free_port)
redis-server --port "$RP" --bind 127.0.0.1 --daemonize no --dir "$RUN" --logfile "$RUN/redis.log" "${RARGS[@]}" &
PIDS+=($!); REDIS_PID=$!; wait_until redis 50 redis-cli -p "$RP" ping
NGX="$RUN/nginx"; mkdir -p "$NGX/tmp"; chmod 755 "$NGX"
cat > "$NGX/nginx.conf" <<EOF
daemon off; master_process on; user nobody nogroup; worker_processes 1; pid $NGX/nginx.pid;
error_log $NGX/error.log warn; events { worker_connections 4096; }
http { access_log off; client_body_temp_path $NGX/tmp/body; proxy_temp_path $NGX/tmp/proxy;
  fastcgi_temp_path $NGX/tmp/f; uwsgi_temp_path $NGX/tmp/u; scgi_temp_path $NGX/tmp/s;
  keepalive_requests 1000000; keepalive_timeout 75s;
  server { listen 127.0.0.1:$UP; default_type application/json;
    location = /v1/orders { return 201 '{"id":1}'; }
    location = /__nginx_status { stub_status; }
    location / { return 200 '{"ok":true}'; } } }
EOF
nginx -p "$NGX" -c "$NGX/nginx.conf" -e "$NGX/error.log" & PIDS+=($!)
wait_until nginx 50 curl -fsS "http://127.0.0.1:$UP/__nginx_status"
[[ -d "$PEER_DIR/node_modules/@node-idempotency/core" ]] || (cd "$PEER_DIR" && npm ci --no-audit --no-fund)
PEER_PORT=$PP UPSTREAM_URL="http://127.0.0.1:$UP" REDIS_PORT=$RP PEER_WORKERS=1 node "$PEER_DIR/server.js" > "$RUN/peer.log" 2>&1 &
PIDS+=($!); NODE_PID=$!; wait_until peer 100 curl -fsS "http://127.0.0.1:$PP/__peer/health"

# ---- private PostgreSQL (defaults: fsync on, synchronous_commit on) ------------
PGDATA_DIR="$RUN/pg"; mkdir -p "$PGDATA_DIR" "$RUN/pglog"; chown postgres "$PGDATA_DIR" "$RUN/pglog"
runuser -u postgres -- initdb -D "$PGDATA_DIR" -A trust -U postgres >/dev/null
runuser -u postgres -- pg_ctl -D "$PGDATA_DIR" -l "$PGDATA_DIR/../pglog/pg.log" -w \
  -o "-c listen_addresses=127.0.0.1 -p $PGP -k $RUN/pglog -c shared_buffers=512MB -c max_connections=200" start >/dev/null
export IDEMGATE_DATABASE_URL="postgres://postgres@127.0.0.1:$PGP/postgres"

# ---- idemgate on each store ----------------------------------------------------
KEYHASH=$(printf %s "$API_KEY" | sha256sum | cut -d' ' -f1)
mkcfg() { # mkcfg <file> <port> <admin> <store-block>
cat > "$1" <<EOF
[server]
listen = "127.0.0.1:$2"
[store]
$4
[admin]
listen = "127.0.0.1:$3"
[[upstreams]]
name = "orders"
url = "http://127.0.0.1:$UP"
timeout = "10s"
[[identity.sources]]
kind = "api_key"
header = "authorization"
keys = [ { sha256 = "$KEYHASH", tenant = "acme", principal = "bench" } ]
[[routes]]
operation = "create_order"
method = "POST"
path = "/v1/orders"
upstream = "orders"
retention = "24h"
EOF
}
mkcfg "$RUN/pg.toml" "$GP" "$GA" $'kind = "postgres"\nurl_env = "IDEMGATE_DATABASE_URL"'
mkcfg "$RUN/sqlite.toml" "$SP" "$SA" "kind = \"sqlite\"
path = \"$RUN/idemgate.db\""
"$BIN" migrate --config "$RUN/pg.toml" >/dev/null 2>&1 || true
"$BIN" serve --config "$RUN/pg.toml" > "$RUN/gw-pg.log" 2>&1 & PIDS+=($!); GW_PG_PID=$!
"$BIN" serve --config "$RUN/sqlite.toml" > "$RUN/gw-sqlite.log" 2>&1 & PIDS+=($!); GW_SQLITE_PID=$!
wait_until idemgate-pg 100 curl -fsS "http://127.0.0.1:$GA/readyz"
wait_until idemgate-sqlite 100 curl -fsS "http://127.0.0.1:$SA/readyz"
if [[ -n $BASE_BIN ]]; then
  mkcfg "$RUN/base.toml" "$BP" "$BA" $'kind = "postgres"\nurl_env = "IDEMGATE_DATABASE_URL"'
  "$BASE_BIN" serve --config "$RUN/base.toml" > "$RUN/gw-base.log" 2>&1 & PIDS+=($!); GW_BASE_PID=$!
  wait_until idemgate-base 100 curl -fsS "http://127.0.0.1:$BA/readyz"
fi
# PgBouncer as Debian ships it, plus the lines a user adds (docs/operations.md,
# "Behind a connection pooler"); run as postgres (it refuses root).
declare -A PGB_PID
if [[ $PGBOUNCER == 1 ]]; then
  PGB_BIN=$(command -v pgbouncer || echo /usr/sbin/pgbouncer)
  mkdir -p "$RUN/pgb"; printf '"postgres" "bench"\n' > "$RUN/pgb/userlist.txt"
  for mode in transaction session; do
    port=$TXP; [[ $mode == session ]] && port=$SSP
    printf '%s\n' "[databases]" "postgres = host=127.0.0.1 port=$PGP dbname=postgres" "[pgbouncer]" \
      "logfile = $RUN/pgb/$mode.log" "pidfile = $RUN/pgb/$mode.pid" "listen_addr = 127.0.0.1" "listen_port = $port" \
      "unix_socket_dir =" "auth_type = md5" "auth_file = $RUN/pgb/userlist.txt" "pool_mode = $mode" > "$RUN/pgb/$mode.ini"
  done
  chown -R postgres "$RUN/pgb"
  for mode in transaction session; do
    runuser -u postgres -- "$PGB_BIN" -d "$RUN/pgb/$mode.ini"
    wait_until "pgbouncer $mode" 100 test -s "$RUN/pgb/$mode.pid"
    PGB_PID[$mode]=$(cat "$RUN/pgb/$mode.pid")
  done
  for t in pgbt pgbs; do
    mode=transaction; gp=$TXGP; ga=$TXGA; port=$TXP
    [[ $t == pgbs ]] && { mode=session; gp=$SSGP; ga=$SSGA; port=$SSP; }
    mkcfg "$RUN/$t.toml" "$gp" "$ga" "kind = \"postgres\"
url = \"postgres://postgres:bench@127.0.0.1:$port/postgres\"
pooler = \"$mode\""
    "$BIN" serve --config "$RUN/$t.toml" > "$RUN/gw-$t.log" 2>&1 & PIDS+=($!)
    if [[ $t == pgbt ]]; then GW_PGBT_PID=$!; else GW_PGBS_PID=$!; fi
    wait_until "idemgate-$t" 100 curl -fsS "http://127.0.0.1:$ga/readyz"
  done
fi
declare -A URL=([peer]="http://127.0.0.1:$PP" [pg]="http://127.0.0.1:$GP" [sqlite]="http://127.0.0.1:$SP" [base]="http://127.0.0.1:$BP" \
  [pgbt]="http://127.0.0.1:$TXGP" [pgbs]="http://127.0.0.1:$SSGP")
export AUTH_HEADER_VALUE="Bearer $API_KEY"
ups() { curl -fsS "http://127.0.0.1:$UP/__nginx_status" | awk 'NR==3{print $3}'; }
seqscans() { runuser -u postgres -- psql -h "$RUN/pglog" -p "$PGP" -qAt \
  -c "SELECT coalesce(sum(seq_scan), 0) FROM pg_stat_user_tables WHERE relname = 'idemgate_records'" postgres; }

# CPU time (clock ticks) of processes, each with its waited-for children
# (PostgreSQL backends that exited), from /proc/PID/stat.
ticks() { local t=0 p f; for p in "$@"; do f=$(cat "/proc/$p/stat" 2>/dev/null) || continue; f=${f##*) }
  set -- $f; t=$((t + ${12} + ${13} + ${14} + ${15})); done; echo "$t"; }
pg_pids() { local pm; pm=$(head -n 1 "$PGDATA_DIR/postmaster.pid"); echo "$pm" $(pgrep -P "$pm"); }
# Each target's CPU per request is what its whole stack spends: the peer's Node
# process and Redis, idemgate and every PostgreSQL process, idemgate on SQLite.
cpu_parts() { case $1 in
  peer) echo "node $(ticks "$NODE_PID") redis $(ticks "$REDIS_PID")" ;;
  pg) echo "idemgate $(ticks "$GW_PG_PID") postgres $(ticks $(pg_pids))" ;;
  base) echo "idemgate $(ticks "$GW_BASE_PID") postgres $(ticks $(pg_pids))" ;;
  pgbt) echo "idemgate $(ticks "$GW_PGBT_PID") postgres $(ticks $(pg_pids)) pgbouncer $(ticks "${PGB_PID[transaction]}")" ;;
  pgbs) echo "idemgate $(ticks "$GW_PGBS_PID") postgres $(ticks $(pg_pids)) pgbouncer $(ticks "${PGB_PID[session]}")" ;;
  sqlite) echo "idemgate $(ticks "$GW_SQLITE_PID")" ;; esac; }
# "cpu_us/r=T (a A + b B)" from two cpu_parts readings and a request count.
cpu_per_request() { python3 - "$1" "$2" "$3" "$(getconf CLK_TCK)" <<'PY'
import sys
a, b, n, hz = sys.argv[1].split(), sys.argv[2].split(), int(sys.argv[3] or 0), int(sys.argv[4])
us = [(name, (int(y) - int(x)) * 1e6 / hz / max(n, 1)) for name, x, y in zip(a[::2], a[1::2], b[1::2])]
print("cpu_us/r=%d (%s)" % (sum(u for _, u in us), " + ".join("%s %d" % (name, u) for name, u in us)))
PY
}

# Per round: RPS[target-phase-conns-round], CPU[...] (whole-stack us per request) and
# GWCPU[...] (idemgate's own us per request).
declare -A RPS CPU GWCPU
# The targets whose store is the private PostgreSQL.
on_pg() { [[ $1 == pg || $1 == base || $1 == pgbt || $1 == pgbs ]]; }
run() { # run <target> <phase> <script> <conns> <dur> <round>
  local t=$1 ph=$2 s=$3 c=$4 d=$5 r=${6:-0} u0 u1 res seq="" s0=0 cpu
  local out="$RUN/wrk-$t-$ph-$c-r$r.txt"
  u0=$(ups); on_pg "$t" && s0=$(seqscans); local c0; c0=$(cpu_parts "$t")
  LABEL="$t-$ph-c$c" KEY_PREFIX="$t-$ph-$c-$RANDOM$RANDOM" REPLAY_PREFIX="replay-$t-" REPLAY_KEYS="$REPLAY_KEYS" \
    timeout $(( ${d%s} + 20 )) wrk -t"$WRK_THREADS" -c"$c" -d"$d" --timeout 5s -s "$s" "${URL[$t]}" > "$out" 2>&1
  local c1; c1=$(cpu_parts "$t"); u1=$(ups); if on_pg "$t"; then sleep 1; local s1; s1=$(seqscans); seq=" seq_scan+$((s1 - s0)) (total $s1)"; fi; res=$(grep '^RESULT' "$out" | sed 's/^RESULT //')
  RPS[$t-$ph-$c-$r]=$(echo "$res" | grep -o 'rps=[0-9.]*' | cut -d= -f2)
  cpu=$(cpu_per_request "$c0" "$c1" "$(echo "$res" | grep -o 'requests=[0-9]*' | cut -d= -f2)")
  CPU[$t-$ph-$c-$r]=$(echo "$cpu" | sed 's/^cpu_us\/r=\([0-9]*\).*/\1/')
  GWCPU[$t-$ph-$c-$r]=$(echo "$cpu" | grep -o '(idemgate [0-9]*' | grep -o '[0-9]*$' || true)
  printf '%-8s %-6s c=%-3s r=%s %s upstream+%s%s %s\n' "$t" "$ph" "$c" "$r" "$(echo "$res" | grep -o 'requests=.*p99_ms=[0-9.]*') $(echo "$res" | grep -o 'status_ge400=[0-9]*')" "$((u1 - u0 - 1))" "$seq" "$cpu"
}
for t in $TARGETS; do run "$t" warm "$WRK_DIR/first_writes.lua" 16 3s >/dev/null; done
# STEADY=1: what autovacuum does after the first minute, done at once (ANALYZE), so that the
# measured runs see steady-state plans; STEADY=0 measures a freshly migrated database as is.
if [[ "${STEADY:-1}" == 1 ]]; then
  runuser -u postgres -- psql -h "$RUN/pglog" -p "$PGP" -qAt -c "ANALYZE" postgres
  echo "steady: ANALYZE after the warm-up"
else
  echo "cold: no ANALYZE (fresh database)"
fi
for r in $(seq "$ROUNDS"); do for c in $CONNS; do for t in $TARGETS; do run "$t" first "$WRK_DIR/first_writes.lua" "$c" "$DURATION" "$r"; done; done; done
for t in $TARGETS; do
  TARGET_URL="${URL[$t]}" REPLAY_PREFIX="replay-$t-" REPLAY_KEYS="$REPLAY_KEYS" timeout 90 node "$PEER_DIR/prewarm.js" > "$RUN/prewarm-$t.txt" 2>&1 \
    || { echo "prewarm failed for $t:"; cat "$RUN/prewarm-$t.txt"; exit 1; }
done
for r in $(seq "$ROUNDS"); do for c in $CONNS; do for t in $TARGETS; do run "$t" replay "$WRK_DIR/replays.lua" "$c" "$DURATION" "$r"; done; done; done
# ratio <table> <a> <b>: the median over the rounds of a/b (a, b: target-phase-conns).
ratio() { local -n tab=$1; local vals=() r
  for r in $(seq "$ROUNDS"); do vals+=("${tab[$2-$r]:-}" "${tab[$3-$r]:-}"); done
  python3 -c "
import sys, statistics
v = sys.argv[1:]
pairs = [(float(a), float(b)) for a, b in zip(v[::2], v[1::2]) if a and b and float(b) > 0]
print('%.2f' % statistics.median(a / b for a, b in pairs) if pairs else 'n/a')" "${vals[@]}"; }
for c in $CONNS; do
  echo "ratios@c$c: first_pg_vs_peer=$(ratio RPS pg-first-$c peer-first-$c) replay_pg_vs_peer=$(ratio RPS pg-replay-$c peer-replay-$c) first_sqlite_vs_peer=$(ratio RPS sqlite-first-$c peer-first-$c) replay_sqlite_vs_peer=$(ratio RPS sqlite-replay-$c peer-replay-$c) cpu_first_pg_vs_peer=$(ratio CPU pg-first-$c peer-first-$c) cpu_first_sqlite_vs_peer=$(ratio CPU sqlite-first-$c peer-first-$c)"
done
if [[ -n $BASE_BIN ]]; then for c in $CONNS; do
  echo "base@c$c: first_pg_vs_base=$(ratio RPS pg-first-$c base-first-$c) replay_pg_vs_base=$(ratio RPS pg-replay-$c base-replay-$c) cpu_first_pg_vs_base=$(ratio CPU pg-first-$c base-first-$c) cpu_replay_pg_vs_base=$(ratio CPU pg-replay-$c base-replay-$c) gw_cpu_first_pg_vs_base=$(ratio GWCPU pg-first-$c base-first-$c) gw_cpu_replay_pg_vs_base=$(ratio GWCPU pg-replay-$c base-replay-$c)"
done; fi
if [[ $PGBOUNCER == 1 ]]; then for c in $CONNS; do
  echo "pgbouncer@c$c: first_pgbt_vs_pg=$(ratio RPS pgbt-first-$c pg-first-$c) replay_pgbt_vs_pg=$(ratio RPS pgbt-replay-$c pg-replay-$c) cpu_first_pgbt_vs_pg=$(ratio CPU pgbt-first-$c pg-first-$c) cpu_replay_pgbt_vs_pg=$(ratio CPU pgbt-replay-$c pg-replay-$c) first_pgbs_vs_pg=$(ratio RPS pgbs-first-$c pg-first-$c) replay_pgbs_vs_pg=$(ratio RPS pgbs-replay-$c pg-replay-$c) cpu_first_pgbs_vs_pg=$(ratio CPU pgbs-first-$c pg-first-$c) cpu_replay_pgbs_vs_pg=$(ratio CPU pgbs-replay-$c pg-replay-$c)"
done; fi
echo "redis_durability=$REDIS_DURABILITY nproc=$(nproc) duration=$DURATION steady=${STEADY:-1} rounds=$ROUNDS"
top=$(printf '%s\n' $CONNS | sort -n | tail -n 1)
echo "ratios: first_pg_vs_peer=$(ratio RPS pg-first-$top peer-first-$top) replay_pg_vs_peer=$(ratio RPS pg-replay-$top peer-replay-$top) cpu_first_pg_vs_peer=$(ratio CPU pg-first-$top peer-first-$top) (at $top connections; medians of $ROUNDS interleaved rounds)"
