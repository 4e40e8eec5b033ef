#!/bin/sh
# One Redis data node of a Sentinel set (docs/deploy.md, "Redis failover"): the master, or a replica.
# It asks the sentinels which node is the master now and starts as that node's replica, so a node
# that was the master before a failover comes back as a replica of the one the sentinels promoted,
# never as a second master. Only when no sentinel knows a master (the set's very first start) does
# REDIS_FIRST_MASTER start as the master. AOF is on (REDIS_CONF), on each node's own volume.
#   REDIS_NODE          this node's address as the others reach it (a host name or an IP)
#   REDIS_PORT          its port (6379)
#   REDIS_FIRST_MASTER  host:port of the master of the first start
#   REDIS_CONF          its redis.conf (deploy/redis.conf: AOF on, no eviction), copied to the working directory
#   SENTINELS           the sentinels, "host:port host:port host:port"
#   SENTINEL_MASTER     the name the sentinels know the master by (subq)
#   HAND_OVER_WAIT_S    how long to wait for a replica's promotion before starting as the master (30)
#   REDISCLI_AUTH       the set's password (issue 39): this node's requirepass, the masterauth it
#                       replicates with, and what redis-cli sends to the nodes and sentinels; unset: none
#   MIN_REPLICAS_TO_WRITE  as master, refuse writes while fewer replicas than this answer within
#                       10 s (min-replicas-to-write; 1): an old master or one cut off from its
#                       replicas takes no step that no replica has (docs/deploy.md); 0 turns it off
set -eu
port="${REDIS_PORT:-6379}"
. "$(dirname "$0")/ask-master.sh"

# The sentinels still name this node, which is only now starting: it went down and came back before
# they noticed (a container restarted at once). Its data may be older than its replicas' (a lost
# volume, or an AOF behind them), and as the master it would make them resync from it and drop steps
# they had acknowledged (WAIT). So a replica is promoted first (SENTINEL FAILOVER), and this node
# starts as its replica. Fails (and the node starts as the master) when no sentinel takes the
# failover: none answers, or there is no replica to promote (every node down at once).
hand_over() {
    taken=""
    for sentinel in $SENTINELS; do
        reply="$(redis-cli -h "${sentinel%:*}" -p "${sentinel##*:}" --raw \
            SENTINEL failover "$SENTINEL_MASTER" 2>&1 || true)"
        case "$reply" in
            OK | *INPROG*) taken="$sentinel"; break ;;
        esac
    done
    [ -n "$taken" ] || return 1
    tries=$(( ${HAND_OVER_WAIT_S:-30} * 2 ))
    while [ "$tries" -gt 0 ]; do
        if [ "$(ask_master)" != "$REDIS_NODE:$port" ]; then
            return 0
        fi
        sleep 0.5
        tries=$((tries - 1))
    done
    return 1
}

master="$(ask_master)"
if [ "$master" = "$REDIS_NODE:$port" ] && hand_over; then
    master="$(ask_master)"
    echo "redis-node: the sentinels still named $REDIS_NODE:$port the master; a replica took over"
fi
# A fresh copy of the config at each start, in the working directory (the data volume): a failover
# rewrites the running node's config (CONFIG REWRITE), which must neither fail on a read-only
# mount nor carry an old master's address into the next start.
conf="$(pwd)/redis-node.conf"
# Owner only: the password goes into it, never onto the command line (`ps` shows that to everyone).
umask 077
rm -f "$conf"
cp "$REDIS_CONF" "$conf"
if [ -n "${REDISCLI_AUTH:-}" ]; then
    printf 'requirepass %s\nmasterauth %s\n' "$REDISCLI_AUTH" "$REDISCLI_AUTH" >> "$conf"
fi
printf 'min-replicas-to-write %s\nmin-replicas-max-lag 10\n' "${MIN_REPLICAS_TO_WRITE:-1}" >> "$conf"
set -- redis-server "$conf" --port "$port" --replica-announce-ip "$REDIS_NODE" --replica-announce-port "$port"
if [ "$master" != "$REDIS_NODE:$port" ]; then
    set -- "$@" --replicaof "${master%:*}" "${master##*:}"
fi
echo "redis-node: $REDIS_NODE:$port starts as $( [ "$master" = "$REDIS_NODE:$port" ] && echo master || echo "replica of $master" )"
exec "$@"
