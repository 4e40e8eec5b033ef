#!/bin/sh
# Sourced by redis-node.sh and sentinel.sh: `ask_master [skip]` prints the master the sentinels
# name now (host:port), asking each of SENTINELS in turn but `skip` (a sentinel does not ask
# itself), or REDIS_FIRST_MASTER when none answers (the set's very first start).
ask_master() {
    skip="${1:-}"
    for sentinel in $SENTINELS; do
        [ "$sentinel" = "$skip" ] && continue
        reply="$(redis-cli -h "${sentinel%:*}" -p "${sentinel##*:}" --raw \
            SENTINEL get-master-addr-by-name "$SENTINEL_MASTER" 2>/dev/null || true)"
        host="$(printf '%s\n' "$reply" | sed -n 1p)"
        master_port="$(printf '%s\n' "$reply" | sed -n 2p)"
        if [ -n "$host" ] && [ -n "$master_port" ] && [ "${master_port#*[!0-9]}" = "$master_port" ]; then
            echo "$host:$master_port"
            return 0
        fi
    done
    echo "$REDIS_FIRST_MASTER"
}
