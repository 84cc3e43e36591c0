#!/bin/bash
# Host-held clients (issue 51): FedAvg on Synthetic(1, 1) of 51 samples a client, 100,000
# and 1,000,000 clients at 0.1 % and 0.01 % participation, 1,000 clients scored a round
# (every client in the last round); one JSON file each. From the checkout:
#   bash results/host_clients/run.sh
for K in 100000 1000000; do
  for P in 0.001 0.0001; do
    nice -n 10 .venv/bin/python -m experiments.benchmark --algorithm=fedavg \
      --dataset=synthetic --num_clients=$K --participation=$P --client_data=host \
      --eval_clients=1000 --synthetic_size_mu=0 --synthetic_size_sigma=0 --repeats=3 \
      --warmup=1 --torch=false --json | tail -1 > results/host_clients/K${K}_p${P}.json
  done
done
