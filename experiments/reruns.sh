#!/usr/bin/env bash
# The seed-table reruns still owed (issues 33 and 35), in the order they are run (the rivals of
# issue 35 before Table 2, whose last seeds are the longer job): each command is
# the one on its results page, with its runs under experiments/runs/<table>/ (finished runs are
# committed there, so this script, started again in a fresh clone, reuses every run that finished
# anywhere and trains only the missing ones; see experiments/lr_grid.py). Each table is written
# to OUT/<table>/ (default runs/reruns/, outside git) when its last run finishes, so nothing
# committed is replaced; publishing it is the docs' "Regenerating results" (docs/results/
# index.md): copy its table, plots and logs into experiments/results/<table>/, rewrite the
# README there, then `python scripts/results_tables.py`.
#
#   experiments/reruns.sh [OUT]       # two runs at a time; resumable; logs in OUT/*.log
#
# Started again with the same OUT, it skips the tables it already wrote there, and everywhere
# the tables already published under experiments/results/ at its protocol (`published` below;
# VERIFY=1 checks their committed runs once more). Its first step restores the runs a
# previous machine left unfinished (experiments/runs/in-progress.tar.gz): before leaving a
# machine, stop the queue (Ctrl-C, or SIGTERM to its process group when it runs in the
# background), run `python experiments/carry.py pack` and commit that archive, or the next
# machine trains those runs again from their first round.
#
# CPU cost on two cores (measured): the pre-training ablation and rank sweep about 1.5 h, Table 2
# about 3 h, the text rivals 30 min and the pre-training rivals 1 h (all finished and committed:
# a run of this script reports them in minutes); the Fashion-MNIST
# Meta-BayFL tables at seed 001's 10 local epochs are 6-20 h each, and ResNet-20's Table IV about
# two days, so they come last.
# A table whose grid fails (a run refused, say) does not stop the queue: the next table runs, and
# the script ends by naming the failed ones (their logs are OUT/<table>.log) and exits 1.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${1:-runs/reruns}
P=${PYTHON:-.venv/bin/python}
SEVEN=1e-4,3e-4,5e-4,8e-4,1e-3,3e-3,5e-3
SGD=3e-4,1e-3,3e-3,1e-2,3e-2,1e-1,3e-1
mkdir -p "$OUT"
# SIGTERM to the queue's process group (`kill -TERM -- -PGID`; Ctrl-C in a terminal) stops it:
# the runs stop cleanly and the drivers exit on their own, so without this trap bash would go on
# to the next table. (Started in the background, bash ignores SIGINT: stop it with SIGTERM.)
trap 'step "interrupted: the queue stops here (run it again to continue)"; exit 130' INT TERM
FAILED=()
step() { echo "$(date '+%F %T') $1" >&2; }
step "runs a previous machine left unfinished (experiments/carry.py)"
$P experiments/carry.py unpack >&2 || exit 2
# A table this script already wrote to OUT is not checked again (restarting the queue would
# otherwise verify every finished run of it: minutes per table); delete OUT/<table> to redo it.
# Nor is one published under experiments/results/ at the protocol the script runs (its runs are
# committed): a fresh clone would otherwise spend about 45 minutes of two cores checking some
# 300 finished runs before it trains one. VERIFY=1 checks those again.
published() { # TABLE-FILE -> its published copy; none for the tables still owed
  case $1 in
    pretrain_ablation/rank_sweep.md | text_rivals/table.md | pretrain_rivals/table.md | \
      pretrain_rivals/fedslop_grid/table.md | text_table2/table.md | bayes_table4/cnn/table.md | \
      bayes_table4/cnn_lr1e-2/table.md | bayes_table4/cnn_temp50/table.md)
      echo "experiments/results/$1" ;;
    bayes_table3/bayfl/table.md | bayes_table3/meta/table.md | bayes_table6/fmnist/table.md)
      echo "experiments/results/${1%/table.md}_e10/table.md" ;;
    bayes_table5/table.md) echo "experiments/results/bayes_table5/fmnist_e10/table.md" ;;
    *) return 1 ;; # Table II and ResNet-20's Table IV: published at the earlier protocol only
  esac
}
made() {
  local pub
  if [ -f "$OUT/$1" ]; then
    step "  $OUT/$1 is there already: skipped"
  elif [ -z "${VERIFY:-}" ] && pub=$(published "$1") && [ -f "$pub" ]; then
    step "  published as $pub: skipped (VERIFY=1 checks its committed runs again)"
  else
    return 1
  fi
}

step "pre-training ablation and rank sweep (seed 000 Table 4 right, Figure 3(d))"
made pretrain_ablation/rank_sweep.md || {
$P experiments/lr_grid.py experiments/pretrain_ablation.yaml --grid fedlore,fedlore_fixed=3e-3 \
  --grid local_galore=5e-3 --jobs 2 --runs experiments/runs/pretrain \
  --out "$OUT/pretrain_ablation" >> "$OUT/pretrain_ablation.log" 2>&1 || FAILED+=("pretrain_ablation")
for r in 8 16 48; do
  $P experiments/lr_grid.py experiments/pretrain_ablation.yaml --set "algorithms=[fedlore]" \
    --set rank=$r --grid fedlore=3e-3 --jobs 2 --runs experiments/runs/pretrain/rank-$r \
    --out "$OUT/pretrain_ablation/rank-$r" >> "$OUT/pretrain_ablation.log" 2>&1 || FAILED+=("pretrain_ablation")
done
$P experiments/rank_sweep.py experiments/pretrain_ablation.yaml --ranks 8,16,32,48 --lr 3e-3 \
  --root experiments/runs/pretrain --out "$OUT/pretrain_ablation" \
  >> "$OUT/pretrain_ablation.log" 2>&1 || FAILED+=("pretrain_ablation")
}

step "FedLore's rivals on Table 2 and Table 3 (issue 35)"
made text_rivals/table.md || $P experiments/lr_grid.py experiments/text_rivals.yaml \
  --grid fedlore,fedgalore,local_galore,fedit,fedfull=$SEVEN --grid fedslop=$SGD \
  --jobs 2 --runs experiments/runs/text --out "$OUT/text_rivals" >> "$OUT/text_rivals.log" 2>&1 || FAILED+=("text_rivals")
made pretrain_rivals/table.md || $P experiments/lr_grid.py experiments/pretrain_rivals.yaml \
  --grid fedlore,fedfull=3e-3 --grid local_galore,fedit=5e-3 --grid fedgalore=$SEVEN \
  --grid fedslop=$SGD --jobs 2 --runs experiments/runs/pretrain \
  --out "$OUT/pretrain_rivals" >> "$OUT/pretrain_rivals.log" 2>&1 || FAILED+=("pretrain_rivals")
# FedSLoP chose the top of its SGD grid in pre-training: the grid extended upward
made pretrain_rivals/fedslop_grid/table.md ||
  $P experiments/lr_grid.py experiments/pretrain_rivals.yaml --set "algorithms=[fedslop]" \
  --grid fedslop=3e-1,1,3 --jobs 2 --runs experiments/runs/pretrain \
  --out "$OUT/pretrain_rivals/fedslop_grid" >> "$OUT/pretrain_rivals.log" 2>&1 || FAILED+=("pretrain_rivals")

step "Table 2 (MiniLM on fortunes)"
made text_table2/table.md || $P experiments/lr_grid.py experiments/text_table2.yaml \
  --grid fedfull,local_galore,fedlore,fedit=$SEVEN \
  --grid ffa_lora,flexlora,lora_fair,rolora,flora,frlora=5e-4,1e-3,3e-3,5e-3 \
  --jobs 2 --runs experiments/runs/text --out "$OUT/text_table2" >> "$OUT/text_table2.log" 2>&1 || FAILED+=("text_table2")

step "Meta-BayFL on Fashion-MNIST at 10 local epochs (seed 001 Tables IV, III, VI, V, II)"
sweep() { # TABLE-FOLDER CONFIG ARGS...
  local name=$1 config=$2
  shift 2
  made "$name/table.md" && return
  mkdir -p "$(dirname "$OUT/$name.log")"
  $P experiments/sweep.py "$config" "$@" --jobs 2 --runs "experiments/runs/$name" \
    --out "$OUT/$name" >> "$OUT/$name.log" 2>&1 || FAILED+=("$name")
}
sweep bayes_table4/cnn experiments/bayes_table4.yaml \
  --methods fedavg,fedprox,meta_bayfl_mcd,meta_bayfl,meta_fl,bayfl,fedavg_mcd
sweep bayes_table4/cnn_lr1e-2 experiments/bayes_table4.yaml --methods fedavg,bayfl --vary lr=1e-2
# not a seed table: whether a longer trial (50 steps, not 5) makes the late-epoch searches pick
# better (at 5 steps their scores lie within the trial noise, experiments/search_noise.py)
sweep bayes_table4/cnn_temp50 experiments/bayes_table4.yaml --methods meta_fl \
  --set method.meta_fl.temp_steps=50
sweep bayes_table3/bayfl experiments/bayes_table3.yaml --methods bayfl \
  --vary data.noise=1e-3,1e-2,1e-1 --vary lr=1e-4,1e-3,1e-2
sweep bayes_table3/meta experiments/bayes_table3.yaml --methods meta_bayfl \
  --vary data.noise=1e-3,1e-2,1e-1
sweep bayes_table6/fmnist experiments/bayes_table6.yaml
sweep bayes_table5 experiments/bayes_table5.yaml --vary num_clients=5,10,15,20
sweep bayes_table2 experiments/bayes_table2.yaml \
  --vary data.fraction=1.0,0.5,0.25,0.1 --vary data.noise=0,1e-4,1e-3,1e-2,1e-1,0.5
sweep bayes_table4/resnet20 experiments/bayes_table4_resnet20.yaml
if ((${#FAILED[@]})); then
  step "done; failed (see $OUT/<name>.log): $(printf '%s\n' "${FAILED[@]}" | sort -u | xargs)"
  exit 1
fi
step "done"
