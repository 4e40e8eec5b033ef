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
set -eu
port="${REDIS_PORT:-6379}"
. "$(dirname "$0")/ask-master.sh"
master="$(ask_master)"
# A fresh copy of the config at each start, in the working directory (the data volume): a failover
# rewrites the running node's config (CONFIG REWRITE), which must neither fail on a read-only
# mount nor carry an old master's address into the next start.
conf="$(pwd)/redis-node.conf"
cp "$REDIS_CONF" "$conf"
set -- redis-server "$conf" --port "$port" --replica-announce-ip "$REDIS_NODE" --replica-announce-port "$port"
if [ "$master" != "$REDIS_NODE:$port" ]; then
    set -- "$@" --replicaof "${master%:*}" "${master##*:}"
fi
echo "redis-node: $REDIS_NODE:$port starts as $( [ "$master" = "$REDIS_NODE:$port" ] && echo master || echo "replica of $master" )"
exec "$@"
