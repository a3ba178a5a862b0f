"""The harnesses that run corekv's peers (vLLM's CPU build, LMCache inside vLLM) on the same token
ids as corekv, each in the peer's own venv, through one runner (:mod:`peers.runner`).

The scripts here are run by path (``python benchmarks/peers/vllm_w1_w2.py ...``); each puts
``benchmarks/`` on ``sys.path`` first, so ``workloads``, ``waves`` and ``peers.runner`` import the
same way in the driver, in the peer's child process and in the tests.
"""
