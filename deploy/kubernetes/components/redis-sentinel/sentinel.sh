#!/bin/sh
# One Redis Sentinel of three (docs/deploy.md, "Redis failover"). It writes its own sentinel.conf
# (a sentinel rewrites the file as it learns, so it must be writable, in SENTINEL_DIR) to watch the
# master the other sentinels name now, or REDIS_FIRST_MASTER when none answers (the first start).
# A master silent for SENTINEL_DOWN_AFTER_MS is down once SENTINEL_QUORUM sentinels agree, and
# they promote the replica with the most data.
#   SENTINEL_NODE                 this sentinel's address as the others reach it
#   SENTINEL_PORT                 its port (26379)
#   SENTINEL_DIR                  a writable folder for its config
#   SENTINELS                     every sentinel, "host:port host:port host:port" (itself included)
#   SENTINEL_MASTER               the master's name (subq: SUBQ_REDIS_SENTINEL_MASTER)
#   REDIS_FIRST_MASTER            host:port of the master of the first start
#   SENTINEL_DOWN_AFTER_MS        5000; SENTINEL_FAILOVER_TIMEOUT_MS 30000; SENTINEL_QUORUM 2
#   REDISCLI_AUTH                 the set's password (issue 39): the nodes' (auth-pass) and this
#                                 sentinel's own (requirepass, which it sends its peers too); unset: none
set -eu
port="${SENTINEL_PORT:-26379}"
. "$(dirname "$0")/ask-master.sh"
master="$(ask_master "$SENTINEL_NODE:$port")"
conf="$SENTINEL_DIR/sentinel.conf"
umask 077  # owner only: the password goes into it, never onto the command line
rm -f "$conf"
cat > "$conf" <<CONF
port $port
dir $SENTINEL_DIR
sentinel resolve-hostnames yes
sentinel announce-hostnames yes
sentinel announce-ip $SENTINEL_NODE
sentinel announce-port $port
sentinel monitor $SENTINEL_MASTER ${master%:*} ${master##*:} ${SENTINEL_QUORUM:-2}
sentinel down-after-milliseconds $SENTINEL_MASTER ${SENTINEL_DOWN_AFTER_MS:-5000}
sentinel failover-timeout $SENTINEL_MASTER ${SENTINEL_FAILOVER_TIMEOUT_MS:-30000}
sentinel parallel-syncs $SENTINEL_MASTER 1
CONF
if [ -n "${REDISCLI_AUTH:-}" ]; then
    printf 'sentinel auth-pass %s %s\nrequirepass %s\n' "$SENTINEL_MASTER" "$REDISCLI_AUTH" "$REDISCLI_AUTH" >> "$conf"
fi
echo "sentinel: $SENTINEL_NODE:$port watches $SENTINEL_MASTER at $master"
exec redis-server "$conf" --sentinel
