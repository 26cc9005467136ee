# Sourced by gpu_all.sh (and its test, benchmarks/test_gpu_all.py): run_part NAME SECONDS
# COMMAND... runs COMMAND with its output in $out/NAME.log and appends its outcome (exit code,
# time, last line, failed tests) to $summary; it never fails, so the next part still runs.
run_part() {  # name, seconds, command...
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  # at the limit one SIGINT to the command's process group, not SIGTERM: pytest then stops
  # like Ctrl-C, printing its failures so far and writing its junit XML (SIGTERM leaves
  # neither; coreutils' timeout sends SIGINT twice, see _run_limited.py); a kill 20 s later
  # if it hangs; exit 124 when cut
  python "$(dirname "${BASH_SOURCE[0]}")/_run_limited.py" "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "[$name] exit $rc after $((SECONDS - start)) s (limit $limit s): $(tail -n 1 "$out/$name.log")" \
    | tee -a "$summary"
  grep -E "^(FAILED|ERROR) " "$out/$name.log" | head -n 40 | tee -a "$summary"
  return 0
}
