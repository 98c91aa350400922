#!/usr/bin/env bash
# Walk the full-screen UI's journey in a detached tmux session and save each screen as text:
#   Source (the built-in demo) -> Recipe (tq4 typed) -> Convert (into demo-tq4) -> Chat (streaming from a 1 MB expert
#   cache, one reply, the expert map, the profile exported) -> Profile -> Serve (one request with curl) -> Help, then
#   quit.
#
#   scripts/tui_journey.sh [OUTPUT_DIR]      (default: docs/tui-journey, relative to the repository root)
#
# The app runs at 100x30 in a fresh temporary directory with its own cache (TQBENCH_CACHE_DIR): it never reads or
# writes your cache or state, and the paths it shows are short (relative to that directory). Each step waits for the
# text it expects on the screen (tmux capture-pane), not for a fixed time. Needs tmux; TQBENCH (default
# .venv/bin/tqbench) is the command run; LD_PRELOAD is passed through (see the README's OpenBLAS note for Linux).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/docs/tui-journey}"
TQBENCH="${TQBENCH:-$ROOT/.venv/bin/tqbench}"
TIMEOUT="${TIMEOUT:-180}"  # seconds any one step may take (the conversion is the longest)
WIDTH=100
HEIGHT=30

command -v tmux >/dev/null || { echo "tui_journey.sh: tmux is not installed" >&2; exit 1; }
[ -x "$TQBENCH" ] || { echo "tui_journey.sh: no $TQBENCH (install the project first, or set TQBENCH)" >&2; exit 1; }
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/tqbench-journey.XXXXXX")"
SOCKET="tqbench-journey-$$"  # a private tmux server: your own sessions are never touched
SESSION=journey
T=(tmux -L "$SOCKET")

cleanup() {
  "${T[@]}" kill-server 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

screen() {
  "${T[@]}" capture-pane -p -t "$SESSION" 2>/dev/null && return 0
  echo "tui_journey.sh: the app is gone (it exited or crashed)" >&2
  exit 1
}

# wait_for TEXT...: until every TEXT is on the screen (fixed strings); on a timeout the screen is saved and shown.
wait_for() {
  local deadline=$((SECONDS + TIMEOUT)) text missing
  while :; do
    missing=""
    local shot
    shot="$(screen)"
    for text in "$@"; do
      grep -qF -- "$text" <<<"$shot" || { missing="$text"; break; }
    done
    [ -z "$missing" ] && return 0
    if ((SECONDS >= deadline)); then
      screen >"$OUT/timeout.txt"
      echo "tui_journey.sh: timed out waiting for \"$missing\" (the screen is in $OUT/timeout.txt):" >&2
      cat "$OUT/timeout.txt" >&2
      exit 1
    fi
    sleep 0.2
  done
}

# toast TEXT: let a notification's toast (its lines start with "▌ ") showing TEXT go away (after 5 s), so that it
# does not cover the saved screen; one already gone (or never caught on the screen) is not waited for.
toast() {
  local seen=6
  while ((seen > 0)) && ! screen | grep -qF -- "▌ $1"; do
    sleep 0.2
    seen=$((seen - 1))
  done
  wait_gone "▌ $1"
}

# wait_gone TEXT: until TEXT has left the screen.
wait_gone() {
  local deadline=$((SECONDS + TIMEOUT))
  while screen | grep -qF -- "$1"; do
    ((SECONDS < deadline)) || { echo "tui_journey.sh: \"$1\" stayed on the screen" >&2; exit 1; }
    sleep 0.2
  done
}

keys() { "${T[@]}" send-keys -t "$SESSION" "$@"; }   # key names: Up, Enter, BTab, C-u, ...
# leave_field: esc out of the Chat screen's message field, then wait for the footer to offer typing again (a key sent
# right behind an escape would arrive as alt+key).
leave_field() { keys Escape; wait_for "i Type"; }
type_text() { "${T[@]}" send-keys -t "$SESSION" -l -- "$1"; }  # literal text
# clear: ctrl+u empties the focused field; text typed right behind it could reach the field before the key was handled
# (and be cleared with it), so let it settle first.
clear() { keys C-u; sleep 0.5; }

save() {  # save NAME: the screen as it is now, after a moment for the last keys' redraw to settle
  sleep 0.5
  screen >"$OUT/$1.txt"
  echo "saved $OUT/$1.txt"
}

rm -f "$OUT"/[0-9][0-9]-*.txt "$OUT/timeout.txt"  # the screens of an earlier run (only the names this script writes)
"${T[@]}" -f /dev/null new-session -d -s "$SESSION" -x "$WIDTH" -y "$HEIGHT" -c "$WORK" \
  env TQBENCH_CACHE_DIR="$WORK/cache" LD_PRELOAD="${LD_PRELOAD:-}" "$TQBENCH"
"${T[@]}" set-option -t "$SESSION" window-size manual >/dev/null

# 1. Source: the built-in demo (copied into the temporary cache on first use), its totals by role.
wait_for "kimi_k3" "routed_expert" "p Recipe"
save 01-source

# 2. Recipe: shift+tab back to the name field, type tq4; the plan's column follows.
keys p
wait_for "tab: next part" "current" "bits/weight"
keys BTab
clear
type_text "tq4"
keys Enter
wait_for "tq4-g64" "exp down  none"
save 02-recipe
keys Escape  # leave the name field: the app's one-letter keys work again
wait_for "↑↓ Row"  # (a key sent right behind an escape would arrive as alt+key)

# 3. Convert: the Recipe screen's recipe; the output typed (shift+tab twice from the table), then r.
keys c
wait_for "recipe     tq4-g64" "r: start"
keys BTab BTab
clear
type_text "demo-tq4"
keys Enter
wait_for "output     demo-tq4" "new output: 1 shard"
save 03-convert-ready
keys r
wait_for "written to demo-tq4"
save 04-convert-done

# 4. Chat: the conversion just written (the last converted model), resident first.
keys t
wait_for "(last converted model)" "ready: greedy"
save 05-chat-loaded

# 5. The streaming settings (esc leaves the message field, o opens them): a 1 MB expert cache, one read worker (tab
# three times: past the host RAM tier and max active experts to prefetch workers).
leave_field
keys o
wait_for "streaming settings" "expert cache budget" "cache routing margin"
clear
type_text "1MB"
keys Tab Tab Tab
clear
type_text "1"
save 06-chat-settings
keys Enter
wait_for "streaming experts: cache 1.00 MB, 1 worker" "no expert routed yet"
toast "Re-opening the model"

# 6. One reply (the new conversation's message field has the keys): the map fills as experts page in; the summary
# has the engine's hit rate.
type_text "def parse_args(argv):"
keys Enter
wait_for "processed" "hits "
save 07-chat-reply

# 7. The map: esc leaves the message field, tab focuses the map, down + enter opens layer L2 (every expert).
leave_field
keys Tab Down Enter
wait_for "▾"
save 08-chat-map-layer-open

# 8. e exports the learned profile (the path is shown; the notification is waited out).
keys e
wait_for "profile exported to"
toast "profile exported to"
save 09-chat-exported

# 9. Profile: the learned heat map of the same model.
keys h
wait_for "learned:" "routings" "hottest (share)"
save 10-profile

# 10. Serve: the same model behind the OpenAI API on a free port (0), experts streamed from a 1 MB cache; one request
# with curl; the status, the request's line and the map; x stops.
keys w
wait_for "Serve" "Attach"
keys Tab  # from the request log (the screen's keys work there) to the port field
sleep 0.5  # (a key sent right behind a focus change can reach the field that had it)
clear
type_text "0"
keys Tab
sleep 0.5
keys Tab
sleep 0.5
clear
type_text "1MB"
keys Enter
wait_for "serving demo-tq4 at http://127.0.0.1:"
url="$(screen | grep -oE 'http://127\.0\.0\.1:[0-9]+/v1' | head -1)"
curl -s "$url/chat/completions" -H "Content-Type: application/json" \
  -d '{"messages": [{"role": "user", "content": "def parse_args(argv):"}], "max_tokens": 16}' >/dev/null
wait_for "requests 1 (1 ok)" "experts: hit rate"
save 11-serve
keys x
wait_for "r Start"

# 11. Help: every key of every screen; esc closes it.
keys "?"
wait_for "Keys (esc closes"
save 12-help
keys Escape
wait_gone "Keys (esc closes"  # (a key sent right behind an escape would arrive as alt+key)

keys q
deadline=$((SECONDS + 30))
while "${T[@]}" has-session -t "$SESSION" 2>/dev/null; do
  ((SECONDS < deadline)) || { echo "tui_journey.sh: the app did not quit" >&2; exit 1; }
  sleep 0.2
done
echo "done: $(ls "$OUT"/*.txt | wc -l) screens in $OUT"
