"""The benchmarks' workloads, defined once: the token ids every system of a comparison is given.

Each builder returns token ids (lists of ints); a benchmark that runs a peer in another venv
(``benchmarks/peers/``) builds them here, in the driver, and hands the same ids to the peer as
JSON, so no peer re-tokenizes anything. The text comes from the seed documents
(:mod:`seed_documents`) or, for W3, from this package.

* :mod:`workloads.w1_w2`: W1 (six questions after one long system prompt) and W2 (32 prompts
  sharing a 384-token prefix), and how each is split into waves of requests submitted together;
* :mod:`workloads.w3`: four input-grounded tasks (output that copies much of the prompt), for
  speculative decoding;
* :mod:`workloads.chats`: multi-turn conversations whose every turn resends the history (the
  seed's memory-pressure workload, and chats through the model's chat template);
* :mod:`workloads.lmcache_qa`: LMCache's long-document QA and multi-round QA, scaled down.
"""
