# tests/run-all.sh's check that the system tests leave nothing behind (tests/lib/leftovers.py
# says what counts). Source it, then:
#   leftovers_baseline       after the lab is up: remember what runs and listens now
#   leftovers_note NAME      after test NAME: remember which leftovers appeared first after it
#   leftovers_check SECS     wait up to SECS for every leftover to be gone; else write them, each
#                            with the test after which it was first seen, to $LEFTOVERS_REPORT and
#                            return 1
#   leftovers_done           remove the working files (the report is the caller's to copy first)
LEFTOVERS_DIR="$(mktemp -d /tmp/gpuhub-leftovers.XXXXXX)"
LEFTOVERS_REPORT="$LEFTOVERS_DIR/report"
_LEFTOVERS_PY="$(dirname "${BASH_SOURCE[0]}")/leftovers.py"

leftovers_baseline() { python3 "$_LEFTOVERS_PY" baseline "$LEFTOVERS_DIR"; : > "$LEFTOVERS_DIR/seen"; }

leftovers_note() {
    local key desc
    while IFS=$'\t' read -r key desc; do
        grep -qF -- "$key"$'\t' "$LEFTOVERS_DIR/seen" || printf '%s\t%s\n' "$key" "$1" >> "$LEFTOVERS_DIR/seen"
    done < <(python3 "$_LEFTOVERS_PY" scan "$LEFTOVERS_DIR")
}

leftovers_check() {
    local secs="$1" i now key desc first
    for ((i = 0; i <= secs; i += 2)); do
        now="$(python3 "$_LEFTOVERS_PY" scan "$LEFTOVERS_DIR")"
        [ -z "$now" ] && return 0
        sleep 2
    done
    : > "$LEFTOVERS_REPORT"
    while IFS=$'\t' read -r key desc; do
        first="$(awk -F'\t' -v k="$key" '$1 == k {print $2; exit}' "$LEFTOVERS_DIR/seen")"
        echo "$desc [after ${first:-the last test}]" >> "$LEFTOVERS_REPORT"
    done <<<"$now"
    return 1
}

leftovers_done() { rm -rf "$LEFTOVERS_DIR"; }
