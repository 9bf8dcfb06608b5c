"""A randomized, Jepsen-style fault run on the network test bed (issue 36 §3).

``python -m tests.chaos --minutes 30 --seed 7`` brings up the cluster of
tests/cluster/ (Temporal, PostgreSQL, two control workers, two routers behind
HAProxy, four nodes), sends a seeded open-loop mix of requests through the
load balancer, strikes a random fault every ``--every`` seconds, heals it,
checks the invariants after each heal and the books at the end, and prints
the report (exit status 1 on any violation). ``make test`` runs a short
seeded run (tests/cluster/test_fault_run.py).
"""
