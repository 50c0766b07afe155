#!/usr/bin/env bash
# Elastic groups over real processes (docs/multi_worker.md, "Elastic training"): 3 workers of
# elastic_job, one of which kills itself (SIGKILL) inside step 5, while the others are in its
# all-reduce.
#   elastic_test.sh ELASTIC_JOB loss TRANSPORT     the other two go on as epoch 2 and finish
#   elastic_test.sh ELASTIC_JOB rejoin TRANSPORT   ... and the killed worker, started again
#                                                  under its task once it is gone, joins them
#   elastic_test.sh ELASTIC_JOB below-min TRANSPORT  with a minimum of 3, the others end with
#                                                    peer_lost (exit 1)
#   elastic_test.sh ELASTIC_JOB chief-loss TRANSPORT the chief (worker:0) is the one killed:
#                                                    worker:1 succeeds it and the two go on
#   elastic_test.sh ELASTIC_JOB chief-then-rejoin TRANSPORT  the chief dies in step 5, worker:2
#                                                    in step 15; worker:1 goes on alone, and
#                                                    worker:2, started again, finds the group at
#                                                    the chief's address, where its successor
#                                                    serves too, and joins it (1 -> 2)
#   elastic_test.sh ELASTIC_JOB join-at-boundary TRANSPORT  as rejoin, but the others keep
#                                                  committing at step 12 instead of waiting in
#                                                  reform: the restarted worker comes in at one of
#                                                  those step boundaries, and nothing is redone
#   elastic_test.sh ELASTIC_JOB hang TRANSPORT     worker:2 stops (SIGSTOP) inside step 5 for 3 s,
#                                                  past the default peer timeout (800 ms): the
#                                                  others leave it out and go on; continued, it
#                                                  learns it was left out (membership_changed),
#                                                  and its reform joins them again in the same
#                                                  process (no restart)
#   elastic_test.sh ELASTIC_JOB chief-hang TRANSPORT  the chief stops for 3 s: worker:1 succeeds
#                                                  it and the two go on; continued, the chief
#                                                  learns that they did (peer_lost, exit 1) and
#                                                  leads no group of its own
#   elastic_test.sh ELASTIC_JOB pause TRANSPORT    worker:2 stops inside step 5 for 300 ms, within
#                                                  the peer timeout: it is not lost, nothing changes
#   elastic_test.sh ELASTIC_JOB late-reform TRANSPORT  worker:1 dies in step 5, and worker:2 calls
#                                                  reform 2.5 s late, past a reform_timeout of 1 s:
#                                                  the chief goes on alone (3 -> 1), leaves worker:2
#                                                  out, and worker:2's reform joins it again in its
#                                                  own process (1 -> 2)
#   elastic_test.sh ELASTIC_JOB setup-loss TRANSPORT  worker:2 dies while the variables are
#                                                  made (after the first, before the second's
#                                                  creation broadcast ends), before any commit:
#                                                  the other two make it from their own initial
#                                                  value, re-form at their first sync, and go on
#   elastic_test.sh ELASTIC_JOB setup-chief-loss TRANSPORT  the same, the chief the one lost:
#                                                  worker:1 succeeds it
#   elastic_test.sh ELASTIC_JOB setup-rejoin TRANSPORT  as setup-loss, and worker:2, started
#                                                  again, joins the two
# A collective in flight when the worker dies may have completed on some of the others (step 5)
# and not on the rest (step 4); every worker that finishes checks that its variable saw every step exactly once (exit 0).
set -u
job=$1 scenario=$2 transport=$3
source "$(dirname "$0")/lib.sh"
mw_cluster 3 127.0.0.1
said=$(mktemp)
trap 'rm -f "$said"' EXIT
env="CONSORT_TRANSPORT=$transport ELASTIC_JOB_LOG=$said"
case "$scenario" in
  loss) args=(40 4 2 --die 2:5) ;;
  rejoin) args=(40 4 2 --die 2:5 --regrow 3:12) ;;
  below-min) args=(40 4 3 --die 2:5) ;;
  chief-loss) args=(40 4 2 --die 0:5) ;;
  chief-then-rejoin) args=(40 4 1 --die 0:5 --die 2:15 --regrow 2:25) ;;
  join-at-boundary) args=(40 4 2 --die 2:5 --commits 3:12) ;;
  hang) args=(40 4 2 --stop 2:5:3000 --regrow 3:12) ;;
  pause) args=(40 4 2 --stop 2:5:300) ;;
  chief-hang) args=(40 4 2 --stop 0:5:3000) ;;
  late-reform) args=(40 4 1 --die 1:5 --late-reform 2:2500 --reform-timeout 1000 --regrow 2:12) ;;
  setup-loss) args=(40 4 2 --die-in-setup 2) ;;
  setup-chief-loss) args=(40 4 2 --die-in-setup 0) ;;
  setup-rejoin) args=(40 4 2 --die-in-setup 2 --regrow 3:12) ;;
  *) echo "unknown scenario $scenario"; exit 2 ;;
esac
for i in 0 1 2; do
  mw_start "$i" "$env" "$job" "${args[@]}"
done
survivors=0
[ "$scenario" = below-min ] && survivors=1
victim=2
case "$scenario" in chief-loss | chief-hang | setup-chief-loss) victim=0 ;; esac
[ "$scenario" = late-reform ] && victim=1
for i in 0 1 2; do mw_expect "$i" "$survivors"; done
victim_status=137
[ "$scenario" = chief-hang ] && victim_status=1
[ "$scenario" = hang ] && victim_status=0
[ "$scenario" = pause ] || mw_expect "$victim" "$victim_status"
[ "$scenario" = chief-then-rejoin ] && mw_expect 0 137
went_on_pattern='3 -> 2 workers'
went_on_count=2
if [ "$scenario" = chief-then-rejoin ]; then
  went_on_pattern='2 -> 1 workers'
  went_on_count=1
fi
case "$scenario" in rejoin | chief-then-rejoin | join-at-boundary | setup-rejoin) restarts=1 ;; *) restarts=0 ;; esac
if [ "$restarts" = 1 ]; then
  # Once worker:2's process is gone and the others went on without it, it starts again under
  # its own task and joins.
  wait "${MW_PIDS[2]}"
  rc=$?
  [ "$rc" = "$victim_status" ] ||
    { echo "FAIL: worker:2 exited with $rc, expected $victim_status"; exit 1; }
  mw_wait_lines "$said" "$went_on_count" "$went_on_pattern" ||
    { echo "FAIL: the others did not go on without worker:2 within 60 s"; cat "$said"; exit 1; }
  echo "worker:2 exited with $rc and the others went on; starting it again"
  mw_start 2 "$env ELASTIC_JOB_RESTARTED=1" "$job" "${args[@]}"
  mw_expect 2 0
fi
mw_finish || exit 1
echo "all statuses as expected; what the workers said:"
cat "$said"
# expect COUNT PATTERN: COUNT lines of what the workers said match PATTERN.
expect() { mw_lines "$said" "$1" "$2"; }
case "$scenario" in
  loss)
    expect 2 '^worker:[01]: membership: 3 -> 2 workers at step [45]; training resumed [0-9]+ ms'
    expect 2 '^worker:[01]: final step 40: .*\(ok\)$' ;;
  rejoin)
    expect 2 '^worker:[01]: membership: 3 -> 2 workers at step [45]; training resumed [0-9]+ ms'
    expect 2 '^worker:[01]: membership: 2 -> 3 workers at step [0-9]+; training resumed [0-9]+ ms'
    expect 3 '^worker:[012]: final step 40: .*\(ok\)$' ;;
  below-min)
    expect 2 '^worker:[01]: step [45] failed \(peer_lost\): .*2 members remain, fewer than the 3 it needs' ;;
  chief-loss)
    expect 2 '^worker:[12]: membership: 3 -> 2 workers at step [45]; training resumed [0-9]+ ms'
    expect 2 '^worker:[12]: final step 40: .*\(ok\)$' ;;
  chief-then-rejoin)
    expect 1 '^worker:1: membership: 2 -> 1 workers at step 1[45]; training resumed [0-9]+ ms'
    expect 1 '^worker:1: membership: 1 -> 2 workers at step [0-9]+; training resumed [0-9]+ ms'
    expect 2 '^worker:[12]: final step 40: .*\(ok\)$' ;;
  join-at-boundary)
    expect 2 '^worker:[01]: membership: 3 -> 2 workers at step [45]; training resumed [0-9]+ ms'
    expect 2 '^worker:[01]: membership: 2 -> 3 workers at step 12; training resumed [0-9]+ ms'
    expect 2 '^worker:[01]: went on from the commit of step 12 at step 12 \(0 steps redone\)$'
    expect 3 '^worker:[012]: final step 40: .*\(ok\)$' ;;
  hang)
    expect 1 '^worker:2: stopped at [0-9]+ for 3000 ms$'
    expect 2 '^worker:[01]: membership: 3 -> 2 workers at step [4-6]; training resumed [0-9]+ ms'
    # It rejoins in its own process: it saw its old view before and the group of 3 after.
    expect 1 '^worker:2: membership: 3 -> 3 workers at step [56]; training resumed [0-9]+ ms'
    expect 0 '^worker:2: started at'
    expect 0 'failed \('
    expect 2 '^worker:[01]: membership: 2 -> 3 workers at step [0-9]+; training resumed [0-9]+ ms'
    expect 3 '^worker:[012]: final step 40: .*\(ok\)$' ;;
  chief-hang)
    expect 2 '^worker:[12]: membership: 3 -> 2 workers at step [4-6]; training resumed [0-9]+ ms'
    expect 1 '^worker:0: step [56] failed \(peer_lost\): .*the others went on without this chief, under its successor: worker:[12] \(rank [12]\) lost this chief: worker:0 \(rank 0\) sent no heartbeat for 800 ms'
    expect 2 '^worker:[12]: final step 40: .*\(ok\)$' ;;
  late-reform)
    expect 1 '^worker:2: reforms 2500 ms late$'
    expect 1 '^worker:0: membership: 3 -> 1 workers at step [45]; training resumed [0-9]+ ms'
    # Left out, it joins again in its process: its old view before, the group it joined after.
    expect 1 '^worker:2: membership: 3 -> 2 workers at step [45]; training resumed [0-9]+ ms'
    expect 1 '^worker:0: membership: 1 -> 2 workers at step [0-9]+; training resumed [0-9]+ ms'
    expect 0 'failed \('
    expect 2 '^worker:[02]: final step 40: .*\(ok\)$' ;;
  setup-loss)
    expect 1 '^worker:2: killed in the set-up at [0-9]+$'
    expect 2 '^worker:[01]: membership: 3 -> 2 workers at step 0; training resumed [0-9]+ ms'
    expect 2 '^worker:[01]: final step 40: .*\(ok\)$' ;;
  setup-chief-loss)
    expect 1 '^worker:0: killed in the set-up at [0-9]+$'
    expect 2 '^worker:[12]: membership: 3 -> 2 workers at step 0; training resumed [0-9]+ ms'
    expect 2 '^worker:[12]: final step 40: .*\(ok\)$' ;;
  setup-rejoin)
    expect 2 '^worker:[01]: membership: 3 -> 2 workers at step 0; training resumed [0-9]+ ms'
    expect 2 '^worker:[01]: membership: 2 -> 3 workers at step [0-9]+; training resumed [0-9]+ ms'
    expect 3 '^worker:[012]: final step 40: .*\(ok\)$' ;;
  pause)
    expect 1 '^worker:2: stopped at [0-9]+ for 300 ms$'
    expect 1 '^worker:2: continued$'
    expect 0 'membership:'
    expect 3 '^worker:[012]: final step 40: .*\(ok\)$' ;;
esac
echo "ok"
