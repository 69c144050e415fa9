#!/usr/bin/env bash
# The simulator's swarm in the scope people run (300 seeds x 40 requests, chaos, mixed, the
# default stalls), on seeds this run picks for itself (from the day, so a failure replays the
# same day with the printed range): the run is clean with every coverage mark hit, and every
# deliberate bug the swarm reaches makes it exit 1.
#
# usage: scripts/swarm-check.sh [FIRST_SEED]   (needs a release build of the CLI)
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="$REPO_ROOT/target/release/kvhandoff"
[ -x "$BIN" ] || { echo "swarm-check: build the CLI first (cargo build --release)" >&2; exit 2; }

# Seeds nobody chose: a new range of 300 each day, far from the ranges the docs quote.
first="${1:-$(( 100000 + ($(date +%s) / 86400) % 10000 * 300 ))}"
seeds="$first..$((first + 300))"
echo "swarm-check: seeds $seeds, 40 requests, mixed, chaos"

# The mutations the swarm catches at this scope: since 2026-11-29 every one of
# `kvhandoff sim --list-mutations` (docs/testing.md, "Mutation check").
CAUGHT=(
    free_on_deadline free_on_peer_dead accept_stale_write_done skip_epoch_floor
    free_source_on_abandon handshake_always_restart release_before_reads_end short_grant_fence
    free_on_first_source_settled long_grant_fence lose_last_read_post decline_during_read
    accept_from_overdue_peer read_on_stale_grant unbounded_peer_tombstones
    accept_prior_incarnation trust_named_rank return_blocks_at_read_bound
    serve_rejoined_session_at_once wait_out_rejoined_peers_fence tell_fenced_twice
    fan_hand_back_at_failure fan_proof_of_last_pair ready_on_first_part ack_partial_write_at_once
    extend_lapsed_registration write_on_expired_lease reader_ready_on_first_part
    read_back_from_first_rank trust_late_reads match_expired_registration evict_young_tombstones
    ignore_heartbeat_sender give_up_on_early_refusal skip_record_refresh
    answer_ahead_without_address
)

# A new deliberate bug must join the list (and be caught here) or the check fails.
for mutation in $("$BIN" sim --list-mutations); do
    if [[ " ${CAUGHT[*]} " != *" $mutation "* ]]; then
        echo "swarm-check: mutation $mutation is not in CAUGHT" >&2
        exit 1
    fi
done

report="$(mktemp)"
trap 'rm -f -- "$report"' EXIT
if ! "$BIN" sim --seeds "$seeds" --requests 40 --json >"$report"; then
    echo "swarm-check: the swarm without a mutation is not clean on $seeds" >&2
    exit 1
fi
python3 - "$report" <<'EOF'
import json, sys
report = json.load(open(sys.argv[1]))
missed = [mark for mark, hits in report["coverage"].items() if hits == 0]
if missed:
    sys.exit(f"swarm-check: marks not hit: {missed}")
print(f"swarm-check: clean, {len(report['coverage'])} marks hit")
EOF

failed=0
for mutation in "${CAUGHT[@]}"; do
    if "$BIN" sim --seeds "$seeds" --requests 40 --mutation "$mutation" --json >"$report" 2>/dev/null; then
        echo "swarm-check: $mutation NOT caught on $seeds" >&2
        failed=1
    else
        count="$(python3 -c 'import json,sys; print(len(json.load(open(sys.argv[1]))["violations"]))' "$report" 2>/dev/null || echo 0)"
        if [ "$count" -gt 0 ]; then
            echo "swarm-check: $mutation caught ($count violations)"
        else
            echo "swarm-check: $mutation failed the run without a violation (a panic?)" >&2
            failed=1
        fi
    fi
done
exit "$failed"
