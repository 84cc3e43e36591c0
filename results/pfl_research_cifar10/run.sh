#!/bin/bash
# pfl-research's CIFAR-10 benchmark setup (issue 49 item 4; docs/performance.md): FedAvg,
# 1,000 IID clients, 50 a round, batch 10, one local epoch, lr 0.1, its CNN
# (--model=pfl_cnn), timed by experiments.benchmark on this machine. From the checkout:
#   bash results/pfl_research_cifar10/run.sh
# round.json: a round as a 1,500-round run has it in 9 rounds of 10 (validation scored,
# not test); eval.json: --eval_every=1 against 10, the round that also scores the
# 10,000 test images (every 10th). GNU time's report of each goes to *.time.txt.
out=results/pfl_research_cifar10
flags="--flagfile=experiments/configs/pfl_research_cifar10.flags --data_dir=../shared/data"
uptime > $out/uptime.txt
/usr/bin/time -v -o $out/round.time.txt nice -n 5 .venv/bin/python -m experiments.benchmark \
  $flags --repeats=3 --warmup=1 --json | tail -1 > $out/round.json
uptime >> $out/uptime.txt
/usr/bin/time -v -o $out/eval.time.txt nice -n 5 .venv/bin/python -m experiments.benchmark \
  $flags --eval_everys=1,10 --repeats=2 --warmup=1 --server_timing=false --json \
  | tail -1 > $out/eval.json
uptime >> $out/uptime.txt
